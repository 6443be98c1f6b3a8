"""Model clients share one TLS context: crewAI builds a client per model call or answer, and reading
the CA bundle into a new context cost 105 ms of every warm resume."""

from __future__ import annotations

import ssl
from typing import Any

import httpx
from crewai.llm import LLM

from flowkube_runner.engine.tls import share_default_contexts


def context_of(client: httpx.Client | httpx.AsyncClient) -> ssl.SSLContext:
    ctx: ssl.SSLContext = client._transport._pool._ssl_context  # type: ignore[union-attr]
    return ctx


def test_clients_with_the_default_settings_share_one_verifying_context() -> None:
    share_default_contexts()
    share_default_contexts()  # idempotent: not wrapped twice
    a, b, c = httpx.Client(), httpx.Client(), httpx.AsyncClient()
    assert context_of(a) is context_of(b)
    assert context_of(a).verify_mode == ssl.CERT_REQUIRED and context_of(a).check_hostname
    assert context_of(c).verify_mode == ssl.CERT_REQUIRED
    # A client that asks for anything else keeps what it asked for.
    own = ssl.create_default_context()
    assert context_of(httpx.Client(verify=own)) is own
    unverified = context_of(httpx.Client(verify=False))
    assert unverified is not context_of(a) and unverified.verify_mode == ssl.CERT_NONE


def test_crewai_model_objects_built_per_call_reuse_the_context(monkeypatch: Any) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "stub")
    share_default_contexts()
    first, second = LLM(model="gpt-4o-mini"), LLM(model="gpt-4o-mini")
    sync_a, sync_b = first._client._client, second._client._client
    assert context_of(sync_a) is context_of(sync_b)
    assert context_of(first._async_client._client) is context_of(sync_a)


