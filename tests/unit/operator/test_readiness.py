"""Readiness: a replica gets webhook and state API traffic only once it can answer it."""

from __future__ import annotations

from pathlib import Path

from flowkube_operator.app import App
from flowkube_operator.kube import tls
from flowkube_operator.settings import Settings


def serving(tmp_path: Path) -> tls.ServingTLS:
    return tls.issue(tls.ca_from_dir(str(tmp_path)), str(tmp_path), ["127.0.0.1"], "")


def test_ready_waits_for_the_ca_in_the_webhook_configurations_and_the_webhook_server(tmp_path: Path) -> None:
    app = App(Settings(webhook_enabled=True, leader_election=False), serving(tmp_path))
    assert "not logged in" in app.not_ready()
    app.kube = object()  # type: ignore[assignment]
    assert "not logged in" in app.not_ready()  # logged in, the CA not installed yet
    app.ca_installed = True
    assert app.webhook_server is not None
    assert "webhook server is not listening" in app.not_ready()
    app.webhook_server.listening = True
    assert "state API" in app.not_ready()
    app.state_serving = True
    assert app.not_ready() == ""


def test_without_webhooks_only_the_login_and_the_state_api_count(tmp_path: Path) -> None:
    app = App(Settings(webhook_enabled=False, leader_election=False), serving(tmp_path))
    app.kube, app.state_serving = object(), True  # type: ignore[assignment]
    assert app.not_ready() == ""


def test_the_composition_root_wires_the_state_api_and_the_metrics_to_the_controller(tmp_path: Path) -> None:
    app = App(Settings(webhook_enabled=False, leader_election=False), serving(tmp_path))
    flow = {"metadata": {"name": "f", "namespace": "ns", "uid": "u1", "resourceVersion": "3"},
            "spec": {"flowRef": "a:B"}, "status": {"phase": "Running", "runs": [{"pod": "f-0"}]}}
    app.controller.cache.flow_event("ADDED", flow)
    assert app.controller.cache.active_run("ns", "f-0") == ("f", "u1", "")  # what the state API asks
    assert 'flow="f"' in app.metrics.render()  # the metrics heard the Flow
    assert app.controller.state_ca.startswith("-----BEGIN CERTIFICATE-----")  # runner pods trust this CA
