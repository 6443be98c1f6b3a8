"""Label selectors as the API server matches them (which Flows and namespaces a quota covers)."""

from __future__ import annotations

from typing import Any

import pytest

from flowkube_api.selectors import SelectorError, parse


def test_match_labels_and_expressions_match_as_kubernetes_does() -> None:
    team = parse({"matchLabels": {"team": "a"},
                  "matchExpressions": [{"key": "tier", "operator": "In", "values": ["gold", "silver"]},
                                       {"key": "trial", "operator": "DoesNotExist"},
                                       {"key": "env", "operator": "NotIn", "values": ["dev"]}]})
    assert team.matches({"team": "a", "tier": "gold"})
    assert team.matches({"team": "a", "tier": "silver", "env": "prod"})
    assert not team.matches({"team": "a", "tier": "bronze"})
    assert not team.matches({"team": "a", "tier": "gold", "trial": ""}), "DoesNotExist: not even empty"
    assert not team.matches({"team": "a", "tier": "gold", "env": "dev"})
    assert not team.matches({"team": "b", "tier": "gold"}) and not team.matches(None)
    assert parse({"matchExpressions": [{"key": "k", "operator": "Exists"}]}).matches({"k": ""})
    assert parse(None).matches({}) and parse({}).matches({"any": "thing"}), "an empty selector matches all"


@pytest.mark.parametrize(("selector", "field"), [
    ([], "selector: a label selector is an object"),
    ({"matchLabels": ["a"]}, "selector.matchLabels"),
    ({"matchLabels": {"a": 1}}, "selector.matchLabels.a"),
    ({"matchExpressions": [{"operator": "In", "values": ["x"]}]}, r"selector.matchExpressions\[0\].key"),
    ({"matchExpressions": [{"key": "k", "operator": "Like"}]}, r"matchExpressions\[0\].operator"),
    ({"matchExpressions": [{"key": "k", "operator": "In"}]}, "In needs at least one value"),
    ({"matchExpressions": [{"key": "k", "operator": "Exists", "values": ["x"]}]}, "Exists takes no values"),
    ({"matchExpressions": [{"key": "k", "operator": "In", "values": ["x"] * 65}]}, "at most 64 strings"),
    ({"matchExpressions": [{"key": "k", "operator": "Exists"}] * 33}, "at most 32 requirements"),
])
def test_a_selector_that_is_not_well_formed_is_refused_naming_its_field(selector: Any, field: str) -> None:
    with pytest.raises(SelectorError, match=field):
        parse(selector)
