"""`kubectl flow run-template` and `trigger`: a Flow started from a template or a CronFlow."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flowkube_api.constants import (
    API_VERSION,
    CLUSTER_TEMPLATE_KIND,
    CLUSTER_TEMPLATE_PLURAL,
    CRONFLOW_KIND,
    CRONFLOW_PLURAL,
    KIND,
    TEMPLATE_KIND,
    TEMPLATE_PLURAL,
)
from flowkube_api.cron import cronflow_flow
from flowkube_api.templates import describe_ref, parameter_problems
from flowkube_kubectl.args import Args, UsageError, flag_on, namespace_of
from flowkube_kubectl.kube import KubectlError, kubectl_json
from flowkube_kubectl.show import short

TRIGGERED_BY = "kubectl-flow"  # the value of ANNOTATION_TRIGGERED_BY on a Flow `trigger` started


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")  # Python's json module would take NaN and Infinity


def param_value(text: str) -> Any:
    """A -p VALUE: the JSON value when it parses as JSON, else the text itself."""
    try:
        return json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError):
        return text


def read_params(params: list[str], flag: str = "-p", form: str = "KEY=VALUE") -> dict[str, str]:
    """KEY: VALUE text of each -p KEY=VALUE (VALUE read from FILE for KEY=@FILE), before any parsing;
    the same for fork's --input KEY=VALUE and --output METHOD=TEXT (``flag``, ``form``)."""
    out: dict[str, str] = {}
    for p in params:
        key, eq, text = p.partition("=")
        if not eq or not key:
            raise UsageError(f"{flag} {p!r} needs {form}")
        if key in out:
            raise UsageError(f"{flag} {key} given twice")
        if text.startswith("@"):
            try:
                text = Path(text[1:]).expanduser().read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise UsageError(f"{flag} {key}={text}: cannot read {text[1:]!r}: {e}") from None
        out[key] = text
    return out


def template_inputs(texts: dict[str, str], template_spec: dict[str, Any]) -> dict[str, Any]:
    """spec.inputs from the -p texts: JSON values, except that a parameter of type string gets the
    text itself unless it is a JSON string (`-p version=1.10` is "1.10", not 1.1)."""
    types = {p.get("name"): p.get("type") for p in template_spec.get("parameters") or [] if isinstance(p, dict)}
    out: dict[str, Any] = {}
    for key, text in texts.items():
        value = param_value(text)
        out[key] = text if types.get(key) == "string" and not isinstance(value, str) else value
    return out


def template_flow(template: str, kind: str, inputs: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """The Flow run-template creates: NAME, or TEMPLATE-<suffix> from the API server."""
    spec: dict[str, Any] = {"templateRef": {"name": template, "kind": kind}}
    if inputs:
        spec["inputs"] = inputs
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": name} if name else {"generateName": f"{template}-"}, "spec": spec}


def _parameter_lines(what: str, template_spec: dict[str, Any]) -> list[str]:
    params = [p for p in template_spec.get("parameters") or [] if isinstance(p, dict)]
    lines = [f"{what} takes:" if params else f"{what} declares no parameters."]
    for p in params:
        facts = [str(p.get("type") or "any JSON")]
        if "default" in p:
            facts.append(f"default {json.dumps(p['default'])}")
        elif p.get("required"):
            facts.append("required")
        lines.append(f"  -p {p.get('name')}=...  ({', '.join(facts)})"
                     + (f" {short(p['description'])}" if p.get("description") else ""))
    return lines


def run_template(a: Args) -> int:
    """Read the template, check the -p values against its parameters, then create the Flow (or print it)."""
    texts = read_params(a.params)
    cluster = flag_on(a, "--cluster-template")
    kind, plural = (CLUSTER_TEMPLATE_KIND, CLUSTER_TEMPLATE_PLURAL) if cluster else (TEMPLATE_KIND, TEMPLATE_PLURAL)
    ref = {"name": a.pos[0], "kind": kind}
    namespace = namespace_of(a)
    try:
        template = kubectl_json(["get", plural, a.pos[0]], a.kube)
    except KubectlError as e:
        if "(Forbidden)" in str(e):  # may run a ClusterFlowTemplate, not read it: the webhook checks
            print(f"kubectl flow: cannot read {describe_ref(namespace, ref)}; the parameters are checked when "
                  "the Flow is created", file=sys.stderr)
            template = {}
        elif "(NotFound)" not in str(e):
            raise
        else:
            where = "" if cluster or namespace else " in the current namespace"
            hint = f"kubectl get {plural}" + ("" if cluster else "; a ClusterFlowTemplate: add --cluster-template")
            print(f"kubectl flow: error: {describe_ref(namespace, ref)} not found{where} ({hint})", file=sys.stderr)
            return 1
    what = describe_ref(template.get("metadata", {}).get("namespace") or namespace, ref)
    tspec = template.get("spec") or {}
    inputs = template_inputs(texts, tspec)
    problems = parameter_problems(tspec, inputs, what)
    if problems:
        for problem in problems:
            print(f"kubectl flow: error: {problem}", file=sys.stderr)
        print("\n".join(_parameter_lines(what, tspec)), file=sys.stderr)
        return 1
    return create_flow(a, template_flow(a.pos[0], kind, inputs, a.opts.get("--name")))


def create_flow(a: Args, body: dict[str, Any]) -> int:
    """Create the Flow and print its name (with --dry-run: print the Flow instead)."""
    if flag_on(a, "--dry-run"):
        print(json.dumps(body, indent=2))
        return 0
    name = kubectl_json(["create", "-f", "-"], a.kube, json.dumps(body))["metadata"]["name"]
    print(name)
    print(f"Follow it: kubectl flow get {name}", file=sys.stderr)
    return 0


def trigger_flow(cronflow: dict[str, Any], now: datetime, name: str | None = None) -> dict[str, Any]:
    """The Flow `trigger` creates: the operator's scheduled Flow for ``now`` (one function serves
    both: `flowkube_api.cron.cronflow_flow`), named NAME or CRONFLOW-manual-<suffix> by the API server,
    annotated as started by kubectl flow, owned without blockOwnerDeletion."""
    return cronflow_flow(cronflow, now, name=name, triggered_by=TRIGGERED_BY)


def trigger(a: Args) -> int:
    """Read the CronFlow, then create its Flow for now (or print it)."""
    try:
        cronflow = kubectl_json(["get", CRONFLOW_PLURAL, a.pos[0]], a.kube)
    except KubectlError as e:
        if "(NotFound)" not in str(e):
            raise
        namespace = namespace_of(a)
        where = f' in namespace "{namespace}"' if namespace else " in the current namespace"
        print(f'kubectl flow: error: {CRONFLOW_KIND} "{a.pos[0]}" not found{where} (kubectl get {CRONFLOW_PLURAL})',
              file=sys.stderr)
        return 1
    return create_flow(a, trigger_flow(cronflow, datetime.now(UTC), a.opts.get("--name")))
