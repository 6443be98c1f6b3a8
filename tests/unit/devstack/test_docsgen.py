"""docs/configuration.md is generated from the operator's Settings and the chart's Deployment."""

from __future__ import annotations

from flowkube_devstack import docsgen
from flowkube_operator.settings import Settings


def test_configuration_page_lists_every_setting() -> None:
    text = docsgen.CONFIGURATION_FILE.read_text()
    for name in Settings.model_fields:
        assert f"| `{docsgen.env_var(name)}` |" in text, f"{name} is missing from docs/configuration.md"


def test_chart_values_are_traced_to_their_variables() -> None:
    sources = docsgen.chart_env_sources()
    assert sources["FLOWKUBE_METRICS_PER_FLOW"].values == ("metrics.perFlow",)
    assert sources["FLOWKUBE_RUNNER_DEFAULT_ENV"].values == ("runner.defaultEnv",)  # {{ toJson . }} in a with
    assert sources["FLOWKUBE_RUNNER_IMAGE"].values == ("runner.image.repository", "runner.image.tag")
    assert sources["FLOWKUBE_VALIDATOR_URL"].only_when == "validator.enabled"
    assert sources["FLOWKUBE_WEBHOOK_SERVICE"].from_release
    assert sources["FLOWKUBE_LEADER_ELECTION_NAMESPACE"].from_release  # valueFrom: the pod's namespace
    for var in sources:  # the chart sets nothing the operator does not read
        assert var.removeprefix("FLOWKUBE_").lower() in Settings.model_fields, var
