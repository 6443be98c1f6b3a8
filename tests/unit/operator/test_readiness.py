"""Readiness: a replica gets webhook and state API traffic only once it can answer it."""

from __future__ import annotations

from flowkube_operator import webhook
from flowkube_operator.handlers import Runtime


def test_ready_waits_for_the_ca_in_the_webhook_configurations_and_the_webhook_server() -> None:
    runtime = Runtime()
    assert "not logged in" in runtime.not_ready()
    runtime.kube = object()  # type: ignore[assignment]
    assert "not logged in" in runtime.not_ready()  # logged in, the CA not installed yet
    runtime.ca_installed = True
    server = webhook.FlowkubeWebhookServer(addr="127.0.0.1", port=0)
    runtime.webhook_server = server
    assert "webhook server is not listening" in runtime.not_ready()
    server.listening = True
    assert "state API" in runtime.not_ready()
    runtime.state_runner = object()  # type: ignore[assignment]
    assert runtime.not_ready() == ""


def test_without_webhooks_only_the_login_and_the_state_api_count() -> None:
    runtime = Runtime(kube=object(), ca_installed=True, state_runner=object())  # type: ignore[arg-type]
    assert runtime.not_ready() == ""
