"""Shared pieces of the models: patterns, JSON-kept types, CEL rules."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, JsonValue

_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
FLOW_REF_PATTERN = f"^{_DOTTED}:{_DOTTED}$"
FlowRef = Annotated[str, Field(pattern=FLOW_REF_PATTERN, max_length=512)]
# A container image reference, by the grammar of the distribution project's `reference` package (the
# one the kubelet parses with): an optional registry host (and port), lower-case path components, an
# optional tag and an optional digest. Anything else ("../../etc", a NUL byte, upper-case paths) would
# be admitted and then wait forever on the node as InvalidImageName.
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?))*(?::[0-9]+)?"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE_REFERENCE_PATTERN = (rf"^(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::[a-zA-Z0-9_][a-zA-Z0-9_.-]{{0,127}})?"
                           r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$")

# Marker for "any JSON object, kept as is" (x-kubernetes-preserve-unknown-fields in the CRD).
FreeObject = Annotated[
    dict[str, Any], Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})
]
FreeObjectList = list[FreeObject]
# Any JSON value, kept as is (a parameter's default).
AnyJson = Annotated[Any, Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True,
                                                  "x-flowkube-any": True})]
ParameterType = Literal["string", "integer", "number", "boolean", "object", "array"]
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
IntOrString = Annotated[int | str, Field(json_schema_extra={"x-kubernetes-int-or-string": True})]


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, JsonValue]:
    r: dict[str, JsonValue] = {"rule": rule, "message": message}
    if field_path:
        r["fieldPath"] = field_path
    return r
