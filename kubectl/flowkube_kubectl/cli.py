"""`kubectl flow`: a kubectl plugin over the same patch and reads a person would type.

    kubectl flow get [-A]                              list Flows: phase, definition, tokens, age
    kubectl flow get NAME                              pending request, conversation, runs, usage, checkpoints
    kubectl flow feedback NAME TEXT [--request-id ID]  answer a pending feedback request
    kubectl flow say NAME TEXT [--timeout SECONDS]     send one message to a conversation, print the reply
    kubectl flow chat NAME [--timeout SECONDS]         talk to a conversation, one message per line
    kubectl flow console [--port PORT] [--no-browser]  the web console on this machine, with your kubeconfig
    kubectl flow run-template TEMPLATE [-p KEY=VALUE]... [--cluster-template] [--name NAME | --generate-name]
                              [--dry-run]              start a Flow from a FlowTemplate, print its name
    kubectl flow trigger CRONFLOW [--name NAME]
                              [--dry-run]              start a CronFlow's Flow now, print its name
    kubectl flow fork NAME --at CHECKPOINT [--input KEY=VALUE]... [--output METHOD=TEXT]...
                              [--name NEW] [--from-namespace NS]
                              [--dry-run]              a new Flow from a checkpoint of Flow NAME, with edits
    kubectl flow quota [NAME] [-A]                     FlowQuotas: each limit's use, reservations and reset

run-template reads the template (a ClusterFlowTemplate with --cluster-template: kubectl's own --cluster
names a kubeconfig cluster) and checks the parameters before it creates anything. The Flow is named
NAME, or TEMPLATE-<suffix> by the API server (--generate-name, the default); --dry-run prints it
instead. -p/--param KEY=VALUE sets spec.inputs.KEY, once per key: VALUE is JSON when it parses as
JSON (300, true, '["a", "b"]', '{"k": 1}', '"quoted text"') and text otherwise, and kept as text for
a parameter of type string; KEY=@FILE reads VALUE from FILE (quote a text that starts with @: '"@x"').

trigger starts one Flow of a CronFlow now, as `kubectl create job --from=cronjob/NAME` does for a
CronJob: its flowTemplate, labelled flowkube.io/cronflow and owned by the CronFlow like a scheduled
one (so its concurrencyPolicy, history limits and usage count it), annotated flowkube.io/scheduled-at
(now) and flowkube.io/triggered-by: kubectl-flow. The Flow is named NAME, or CRONFLOW-manual-<suffix>
by the API server; --dry-run prints it instead.

fork creates a new Flow that starts from checkpoint CHECKPOINT of Flow NAME (its origin: one of the
ids `kubectl flow get NAME` lists under Checkpoints) instead of from its start methods. Its spec is
the origin's, copied (definition, flowRef or templateRef, inputs, env, resources, budget, ...), with
spec.forkFrom naming the origin, its uid and the checkpoint. --input KEY=VALUE sets the state field
KEY before the fork runs on (VALUE as for -p: JSON when it parses, else text; @FILE reads it);
--output METHOD=TEXT replaces the output of METHOD (METHOD=@FILE reads TEXT from FILE): the methods
that completed after it run again. The fork is named NEW, or NAME-fork-CHECKPOINT, and labelled
flowkube.io/forked-from=NAME; -n/--namespace is the fork's namespace, --from-namespace the origin's
(default: the same). Creating it needs get on the origin; --dry-run prints it instead.

quota lists each FlowQuota's limits, and each ClusterFlowQuota's (cluster/NAME) when you may list them,
(one row per cap: tokens, or USD), what the covered Flows used of
them in the current window and what their calls in flight hold, as the operator last wrote them
(at most quotas.statusSeconds old), and when each calendar window resets.

Flags go anywhere on the line; `--` ends them (for a TEXT that starts with `-`). kubectl's own
-n/--namespace, --context, --kubeconfig, --cluster, --user, --as, --as-group, --request-timeout,
-s/--server, --token, --insecure-skip-tls-verify and --certificate-authority are passed to every
kubectl call. It calls `kubectl` itself (or $KUBECTL), so contexts, namespaces and credentials
behave exactly as in kubectl.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import UTC, datetime

from flowkube_api.constants import (
    PLURAL,
    SINGULAR,
)
from flowkube_api.inbox import feedback_patch
from flowkube_kubectl.args import Args, UsageError, parse
from flowkube_kubectl.chat import chat, report, send
from flowkube_kubectl.console import console
from flowkube_kubectl.fork import fork
from flowkube_kubectl.kube import KubectlError, kubectl_json, patch_status
from flowkube_kubectl.quota import quota
from flowkube_kubectl.show import describe, flow_table
from flowkube_kubectl.start import run_template, trigger

_OWN_COMMANDS: dict[str, Callable[[Args], int]] = {  # commands a module of their own runs whole
    "console": console, "run-template": run_template, "trigger": trigger, "fork": fork, "quota": quota}


def _run(a: Args) -> int:
    if a.cmd in _OWN_COMMANDS:
        return _OWN_COMMANDS[a.cmd](a)
    timeout = float(a.opts.get("--timeout", 300))
    if a.cmd == "feedback":
        out = patch_status(a.pos[0], feedback_patch(a.pos[1], a.opts.get("--request-id")), a.kube)
        sys.stdout.write(out.stdout)
        sys.stderr.write(out.stderr)
        return out.returncode
    if a.cmd == "say":
        return report(send(a.pos[0], a.pos[1], a.kube, timeout))
    if a.cmd == "chat":
        return chat(a.pos[0], a.kube, timeout)
    if a.pos:
        print(describe(kubectl_json(["get", SINGULAR, a.pos[0]], a.kube)))
        return 0
    items = kubectl_json(["get", PLURAL, *["--all-namespaces"] * a.all_namespaces], a.kube).get("items") or []
    if not items:
        print("No flows found.", file=sys.stderr)
        return 0
    print(flow_table(items, a.all_namespaces, datetime.now(UTC)))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        if args.help:
            print(__doc__)
            return 0
        return _run(args)
    except UsageError as e:
        print(f"kubectl flow: error: {e}\nSee 'kubectl flow --help' for usage.", file=sys.stderr)
        return 2
    except KubectlError as e:
        sys.stderr.write(str(e))
        return e.returncode
