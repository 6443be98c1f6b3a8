"""Generate docs/configuration.md from the operator's `Settings` and the chart's Deployment template.

    ./dev generate            # rewrite docs/configuration.md (with every other generated file)
    ./dev generate --check    # exit 1 when it is stale (run by ./dev test)

One row per field of `flowkube_operator.settings.Settings`: its environment variable, type, default
and description (the field's own `description`), and the Helm value the chart sets it from, read
off `charts/flowkube/templates/deployment.yaml` (includes resolved through `_helpers.tpl`).
"""

from __future__ import annotations

import json
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo

from flowkube_operator.settings import Settings

REPO = Path(__file__).resolve().parents[2]
CONFIGURATION_FILE = REPO / "docs" / "configuration.md"
TEMPLATES = REPO / "charts" / "flowkube" / "templates"
DEPLOYMENT_FILE = TEMPLATES / "deployment.yaml"
HELPERS_FILE = TEMPLATES / "_helpers.tpl"
COMMAND = "./dev generate"  # every generated file; `python -m flowkube_devstack.docsgen --write`: this one
UNDOCUMENTED = "*(no description in `Settings`)*"

_ENV_NAME = re.compile(r"^\s*- name: (?P<name>[A-Z][A-Z0-9_]*)\s*$")
_ENV_VALUE = re.compile(r"^\s*value: (?P<expr>.*)$")
_CONFIGMAP_NAME = re.compile(r"^\s*name: (?P<expr>\{\{.*\}\}[-\w]*)\s*$")  # inside configMapKeyRef
_ENV_FIELD = re.compile(r"^\s*fieldPath: metadata\.namespace\s*$")  # the pod's namespace: the release's
_OPEN = re.compile(r"\{\{-?\s*(?P<kind>if|with|range)\b(?P<cond>[^}]*)\}\}")
_END = re.compile(r"\{\{-?\s*end\s*-?\}\}")
_VALUES_REF = re.compile(r"\.Values\.(?P<key>[A-Za-z0-9_.]+[A-Za-z0-9_])")
_INCLUDE = re.compile(r'include "(?P<name>[^"]+)"')
_DEFINE = re.compile(r'\{\{-?\s*define "(?P<name>[^"]+)"\s*-?\}\}(?P<body>.*?)\{\{-?\s*end\s*-?\}\}', re.S)


# ------------------------------------------------------------------------------------------- chart


@dataclass(frozen=True)
class ChartSource:
    """Where the chart's Deployment gets one operator environment variable from."""

    values: tuple[str, ...]  # dotted values.yaml keys the env value is made of
    from_release: bool  # the value names the release (its namespace or resource names)
    only_when: str | None  # the values.yaml switch the variable is set under, if any

    def describe(self) -> str:
        if self.from_release:
            text = "set by the chart from the release's namespace and names"
        elif self.values:
            text = ", ".join(f"`{v}`" for v in self.values)
        else:
            text = "set by the chart"
        return f"{text}; only when `{self.only_when}`" if self.only_when else text


def _helpers(text: str) -> dict[str, str]:
    return {m["name"]: m["body"] for m in _DEFINE.finditer(text)}


def _expand(expr: str, helpers: dict[str, str], seen: frozenset[str] = frozenset()) -> str:
    """`expr` with the body of every named template it includes appended, recursively."""
    parts = [expr]
    for m in _INCLUDE.finditer(expr):
        name = m["name"]
        if name in helpers and name not in seen:
            parts.append(_expand(helpers[name], helpers, seen | {name}))
    return "\n".join(parts)


def chart_env_sources(deployment: str | None = None, helpers: str | None = None) -> dict[str, ChartSource]:
    """Every `FLOWKUBE_*` variable the Deployment template sets, and the values it comes from."""
    deployment = DEPLOYMENT_FILE.read_text() if deployment is None else deployment
    defined = _helpers(HELPERS_FILE.read_text() if helpers is None else helpers)
    blocks: list[tuple[str, str | None]] = []  # (kind, the .Values key it tests or scopes to)
    sources: dict[str, ChartSource] = {}
    pending: str | None = None
    for line in deployment.splitlines():
        for token in re.finditer(f"{_OPEN.pattern}|{_END.pattern}", line):
            opened = _OPEN.fullmatch(token.group(0))
            if opened is not None:
                ref = _VALUES_REF.search(opened["cond"])
                blocks.append((opened["kind"], ref["key"] if ref else None))
            elif blocks:
                blocks.pop()
        name = _ENV_NAME.match(line)
        if name is not None:
            pending = name["name"] if name["name"].startswith(Settings.model_config.get("env_prefix", "")) or (
                name["name"] in _ALIASES) else None
            continue
        if pending is not None and _ENV_FIELD.match(line):
            sources[pending] = ChartSource(values=(), from_release=True, only_when=None)
            pending = None
            continue
        configmap = _CONFIGMAP_NAME.match(line)
        if pending is not None and configmap is not None:  # `valueFrom.configMapKeyRef`: the chart's own
            sources[pending] = ChartSource(values=_configmap_values(configmap["expr"]), from_release=False,
                                           only_when=None)
            pending = None
            continue
        value = _ENV_VALUE.match(line)
        if value is None or pending is None:
            continue
        text = _expand(value["expr"], defined)
        keys = tuple(dict.fromkeys(m["key"] for m in _VALUES_REF.finditer(text)))
        kind, scope = blocks[-1] if blocks else ("", None)
        only_when: str | None = None
        if kind == "with" and scope is not None and not keys:
            keys = (scope,)  # `{{ toJson . }}` inside `{{- with .Values.x }}`: the value is x itself
        elif kind == "if" and scope is not None and scope not in keys:
            only_when = scope
        sources[pending] = ChartSource(values=keys, from_release=".Release." in text, only_when=only_when)
        pending = None
    return sources


def _configmap_values(name_expr: str) -> tuple[str, ...]:
    """The values a ConfigMap of the chart is rendered from, found by the name expression its
    `configMapKeyRef` uses."""
    for template in sorted(TEMPLATES.glob("*.yaml")):
        text = template.read_text()
        if "kind: ConfigMap" in text and f"name: {name_expr}" in text:
            return tuple(dict.fromkeys(m["key"] for m in _VALUES_REF.finditer(text.split("data:", 1)[-1])))
    return ()


# ---------------------------------------------------------------------------------------- settings


_ALIASES = frozenset(f.validation_alias for f in Settings.model_fields.values() if isinstance(f.validation_alias, str))


def env_var(field_name: str) -> str:
    alias = Settings.model_fields[field_name].validation_alias
    if isinstance(alias, str):  # a standard variable read as it is named (OTEL_EXPORTER_OTLP_ENDPOINT)
        return alias
    return f"{Settings.model_config.get('env_prefix', '')}{field_name}".upper()


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in get_args(annotation))
        return f"{origin.__name__}[{args}]"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field: FieldInfo) -> str:
    lower = next((m.ge for m in field.metadata if hasattr(m, "ge")), None)
    upper = next((m.le for m in field.metadata if hasattr(m, "le")), None)
    if lower is not None and upper is not None:
        return f", {lower} to {upper}"
    if lower is not None:
        return f", at least {lower}"
    if upper is not None:
        return f", at most {upper}"
    return ""


def field_type(field: FieldInfo) -> str:
    """The type as a reader sets it: dicts are JSON; lists marked NoDecode are parsed by the field."""
    name = _type_name(field.annotation)
    origin = get_origin(field.annotation)
    no_decode = any(getattr(m, "__name__", "") == "NoDecode" for m in field.metadata)
    if origin is dict or (origin is list and not no_decode):
        name += " (JSON)"
    return name + _bounds(field)


def field_default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    return f"`{json.dumps(value, separators=(',', ':'))}`"


def undocumented_fields() -> list[str]:
    """Settings fields without a description: the page shows a placeholder for them."""
    return [name for name, f in Settings.model_fields.items() if not f.description]


def _cell(text: str) -> str:
    """Text safe in a Markdown table cell (`<name>` would otherwise be read as an HTML tag)."""
    return text.replace("|", r"\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def settings_table(sources: dict[str, ChartSource] | None = None) -> str:
    sources = chart_env_sources() if sources is None else sources
    rows = ["| Variable | Type | Default | Helm value | Description |", "|---|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        var = env_var(name)
        source = sources.get(var)
        helm = source.describe() if source is not None else "— (set it through `extraEnv`)"
        description = _cell(field.description) if field.description else UNDOCUMENTED
        rows.append(f"| `{var}` | {field_type(field)} | {field_default(field)} | {helm} | {description} |")
    return "\n".join(rows) + "\n"


HEADER = f"""\
<!-- Generated by `{COMMAND}` (this file alone: `python -m flowkube_devstack.docsgen --write`) from
     operator/flowkube_operator/settings.py and charts/flowkube/templates/deployment.yaml. Do not edit. -->

# Configuration

The operator reads its settings from environment variables with the prefix
`{Settings.model_config.get("env_prefix", "")}` (pydantic-settings, `operator/flowkube_operator/settings.py`).
The Helm chart sets them from its values; the column *Helm value* names the `values.yaml` keys each
variable is made from (see [charts/flowkube/README.md](../charts/flowkube/README.md) for every value).
A variable the chart does not set can be given to the operator through the chart's `extraEnv`.

Defaults are the settings' own, written as JSON. Dicts are read from the environment as JSON;
list settings are parsed as their description says (comma-separated, shell words).

Runner pods are configured by the operator, not by these variables; the few a runner reads for
itself (`FLOWKUBE_STATE_RETRY_SECONDS`, `FLOWKUBE_STATE_TOKEN_FILE`) are in
[operations.md](operations.md#runner-pods-variables).

"""


def render_configuration() -> str:
    """The full text of docs/configuration.md."""
    return HEADER + settings_table()
