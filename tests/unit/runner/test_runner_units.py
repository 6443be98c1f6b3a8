"""Fast tests of the runner's pure parts: report model, stores, configuration."""

from __future__ import annotations

import base64
import gzip
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from flowkube_api import constants as c
from flowkube_api.report import FeedbackRequest, RunReport, TokenUsage, Usage, excerpt
from flowkube_runner.config import ConfigError, RunnerConfig
from flowkube_runner.store import (
    ConfigMapStore,
    FileStore,
    StateCorrupt,
    StateTooLarge,
    StoreError,
    decode_json,
    encode_json,
)


def usage(total: int, model: str) -> Usage:
    one = TokenUsage(total_tokens=total, prompt_tokens=total - 1, completion_tokens=1, successful_requests=1)
    return Usage(**one.model_dump(), by_model={model: one})


def test_usage_adds_totals_and_per_model() -> None:
    total = usage(10, "a") + usage(5, "b") + usage(7, "a")
    assert (total.total_tokens, total.successful_requests) == (22, 3)
    assert total.by_model["a"].total_tokens == 17
    assert total.by_model["b"].total_tokens == 5
    assert Usage() + Usage() == Usage()


def test_report_round_trips_with_api_field_names() -> None:
    report = RunReport(
        pod="f-1",
        trigger=c.Trigger.RESUME,
        result=c.RunResult.PAUSED,
        reason=c.Reason.RUN_PAUSED,
        exit_code=c.EXIT_OK,
        flow_id="abc",
        usage=usage(3, "m"),
        feedback_request=FeedbackRequest(id="review-1", method="review", emit=["a", "b"], default_outcome="a"),
    )
    data = json.loads(gzip.decompress(report.encode()))
    assert data["flowId"] == "abc"
    assert data["usage"]["byModel"]["m"]["cachedPromptTokens"] == 0
    assert data["feedbackRequest"]["defaultOutcome"] == "a"
    assert RunReport.decode(report.encode()) == report


def test_termination_summary_stays_under_the_kubelet_limit() -> None:
    huge = "x" * 100_000
    report = RunReport(
        pod="f-1",
        trigger=c.Trigger.KICKOFF,
        result=c.RunResult.FAILED,
        reason=c.Reason.FLOW_ERROR,
        exit_code=c.EXIT_RETRYABLE,
        message=huge,
        output=huge,
        usage=Usage(**{f"m{i}": 1 for i in range(0)}, by_model={f"model-{i}": TokenUsage() for i in range(200)}),
    )
    summary = report.termination_summary()
    assert len(summary.encode()) <= 4096
    parsed = RunReport.model_validate_json(summary)
    assert parsed.reason == c.Reason.FLOW_ERROR


def test_excerpt_never_splits_a_character() -> None:
    assert excerpt("é" * 3000, 4095).encode() == ("é" * 2047).encode()
    assert excerpt("short") == "short"


def test_compressible_state_of_several_megabytes_fits() -> None:
    document = {"rows": [{"id": i, "text": "the same sentence again and again"} for i in range(60_000)]}
    assert len(json.dumps(document)) > 3_000_000
    data = encode_json(document)
    assert len(data) <= c.STATE_LIMIT
    assert decode_json(data, "state") == document


def test_state_over_the_limit_is_refused_not_truncated() -> None:
    noise = base64.b64encode(os.urandom(c.STATE_LIMIT)).decode()
    with pytest.raises(StateTooLarge, match="over the"):
        encode_json({"blob": noise})


def test_corrupt_bytes_are_reported_as_such() -> None:
    with pytest.raises(StateCorrupt):
        decode_json(b"not gzip", "state")


def test_file_store(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s")
    assert store.get("k") is None
    store.put("k", b"v1")
    store.put("k", b"v2")
    assert store.get("k") == b"v2"
    with pytest.raises(StoreError):
        store.put("../escape", b"x")


class FakeApiServer:
    """Just enough of the API server for one ConfigMap: GET and JSON merge patch."""

    def __init__(self) -> None:
        self.binary: dict[str, str] = {"other": base64.b64encode(b"keep").decode()}
        self.requests: list[httpx.Request] = []
        self.fail_next = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.fail_next:
            self.fail_next -= 1
            return httpx.Response(503, json={"message": "etcd leader changed"})
        if request.url.path != "/api/v1/namespaces/ns/configmaps/demo-state":
            return httpx.Response(404, json={"message": "not found"})
        if request.method == "PATCH":
            assert request.headers["content-type"] == "application/merge-patch+json"
            patch: dict[str, Any] = json.loads(request.content)
            self.binary.update(patch["binaryData"])
        return httpx.Response(200, json={"metadata": {"name": "demo-state"}, "binaryData": self.binary})


def test_configmap_store_patches_only_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("flowkube_runner.store.time.sleep", lambda _s: None)
    server = FakeApiServer()
    client = httpx.Client(transport=httpx.MockTransport(server), base_url="https://api")
    store = ConfigMapStore(client, "ns", "demo-state")
    assert store.get(c.STATE_KEY) is None
    store.put(c.STATE_KEY, b"\x00state")
    assert store.get(c.STATE_KEY) == b"\x00state"
    assert base64.b64decode(server.binary["other"]) == b"keep"
    server.fail_next = 2
    assert store.get(c.STATE_KEY) == b"\x00state"  # transient 503s are retried
    assert {r.method for r in server.requests} == {"GET", "PATCH"}


def test_configmap_store_reports_missing_object() -> None:
    client = httpx.Client(transport=httpx.MockTransport(FakeApiServer()), base_url="https://api")
    with pytest.raises(StoreError, match="404"):
        ConfigMapStore(client, "ns", "gone").get(c.STATE_KEY)


def env(**extra: str) -> dict[str, str]:
    base = {
        c.ENV_FLOW_NAME: "demo",
        c.ENV_POD_NAME: "demo-1",
        c.ENV_TRIGGER: "resume",
        c.ENV_SPEC: json.dumps({"flowRef": "m:C", "inputs": {"a": 1}, "budget": {"maxTotalTokens": 5}}),
        c.ENV_FEEDBACK: json.dumps({"requestId": "r-1", "text": "ok", "timedOut": False}),
        c.ENV_PRIOR_TOTAL_TOKENS: "7",
    }
    return {**base, **extra}


def test_config_from_env() -> None:
    config = RunnerConfig.from_env(env())
    assert config.trigger is c.Trigger.RESUME
    assert config.spec.flow_ref == "m:C" and config.spec.inputs == {"a": 1}
    assert config.spec.budget.max_total_tokens == 5
    assert config.feedback is not None and config.feedback.request_id == "r-1"
    assert config.prior_total_tokens == 7
    assert config.state_configmap == "demo-state"
    assert config.termination_log == Path("/dev/termination-log")


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ({c.ENV_SPEC: "{"}, c.Reason.INVALID_DEFINITION),
        ({c.ENV_SPEC: json.dumps({"flowRef": "m:C", "definition": {}})}, c.Reason.INVALID_DEFINITION),
        ({c.ENV_TRIGGER: "restart"}, c.Reason.INTERNAL_ERROR),
        ({c.ENV_POD_NAME: ""}, c.Reason.INTERNAL_ERROR),
    ],
)
def test_config_errors_name_their_reason(override: dict[str, str], reason: c.Reason) -> None:
    with pytest.raises(ConfigError) as info:
        RunnerConfig.from_env(env(**override))
    assert info.value.reason is reason


def test_configmap_store_waits_for_rbac_and_an_api_server_restart() -> None:
    answers = [httpx.Response(403, json={"message": "forbidden"}), httpx.Response(503),
               httpx.Response(200, json={"binaryData": {}})]

    def server(request: httpx.Request) -> httpx.Response:
        return answers.pop(0)

    client = httpx.Client(transport=httpx.MockTransport(server), base_url="https://api")
    assert ConfigMapStore(client, "ns", "demo-state", retry_for=10).get(c.STATE_KEY) is None
    assert answers == []

    denied = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(403, json={"message": "no"})),
                          base_url="https://api")
    with pytest.raises(StoreError):
        ConfigMapStore(denied, "ns", "demo-state", retry_for=0.5).get(c.STATE_KEY)
