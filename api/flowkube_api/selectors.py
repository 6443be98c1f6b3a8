"""Kubernetes label selectors (``matchLabels``, ``matchExpressions``), as the API server matches them:
which Flows a FlowQuota covers, which namespaces a ClusterFlowQuota does (issue 41). Standard
library only; a selector that is not well-formed is refused, naming its field, not matched loosely.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
EXPRESSIONS_LIMIT = 32  # requirements of one selector
VALUES_LIMIT = 64  # values of one requirement


class SelectorError(ValueError):
    """A selector that is not well-formed; the message names the field."""


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str
    values: frozenset[str]

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        if self.operator == "In":
            return labels.get(self.key) in self.values
        return self.key not in labels or labels[self.key] not in self.values  # NotIn


@dataclass(frozen=True)
class Selector:
    """All of its requirements hold (an empty selector matches everything, as Kubernetes' does)."""

    requirements: tuple[Requirement, ...]

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        found = labels or {}
        return all(r.matches(found) for r in self.requirements)


def parse(selector: Mapping[str, Any] | None, field: str = "selector") -> Selector:
    """``selector`` (a LabelSelector object; None: everything), or ``SelectorError`` naming the field."""
    if selector is None:
        return Selector(())
    if not isinstance(selector, Mapping):
        raise SelectorError(f"{field}: a label selector is an object (matchLabels, matchExpressions)")
    requirements: list[Requirement] = []
    match_labels = selector.get("matchLabels") or {}
    if not isinstance(match_labels, Mapping):
        raise SelectorError(f"{field}.matchLabels: an object of label keys and values")
    for key, value in match_labels.items():
        if not isinstance(value, str):
            raise SelectorError(f"{field}.matchLabels.{key}: a label value is a string")
        requirements.append(Requirement(str(key), "In", frozenset({value})))
    expressions = selector.get("matchExpressions") or []
    if not isinstance(expressions, list) or len(expressions) > EXPRESSIONS_LIMIT:
        raise SelectorError(f"{field}.matchExpressions: a list of at most {EXPRESSIONS_LIMIT} requirements")
    requirements += [_requirement(e, f"{field}.matchExpressions[{i}]") for i, e in enumerate(expressions)]
    return Selector(tuple(requirements))


def _requirement(e: Any, where: str) -> Requirement:
    if not isinstance(e, Mapping) or not isinstance(e.get("key"), str) or not e["key"]:
        raise SelectorError(f"{where}.key: required")
    operator, values = e.get("operator"), e.get("values") or []
    if operator not in OPERATORS:
        raise SelectorError(f"{where}.operator: one of {', '.join(OPERATORS)}")
    if not isinstance(values, list) or len(values) > VALUES_LIMIT or not all(isinstance(v, str) for v in values):
        raise SelectorError(f"{where}.values: a list of at most {VALUES_LIMIT} strings")
    if operator in ("In", "NotIn") and not values:
        raise SelectorError(f"{where}.values: {operator} needs at least one value")
    if operator in ("Exists", "DoesNotExist") and values:
        raise SelectorError(f"{where}.values: {operator} takes no values")
    return Requirement(e["key"], str(operator), frozenset(values))
