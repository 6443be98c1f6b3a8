"""Fast tests of the runner's pure parts: report model, stores, configuration."""

from __future__ import annotations

import base64
import gzip
import json
import os
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from flowkube_api import constants as c
from flowkube_api.report import FeedbackRequest, RunReport, TokenUsage, Usage, excerpt
from flowkube_runner.config import ConfigError, RunnerConfig
from flowkube_runner.store import (
    FileStore,
    StateApiStore,
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
    )
    # As the runner fills a report in (assigned, not validated: a report over the bounds is refused
    # only where the operator decodes it, and the runner's encoders clip it first).
    report.message = report.output = huge
    report.usage = Usage(by_model={f"model-{i}": TokenUsage() for i in range(200)})
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


class FakeStateApi:
    """The operator's state API as the runner sees it: GET/PUT of one key, bearer token required."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {"other": b"keep"}
        self.requests: list[httpx.Request] = []
        self.fail_next = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.fail_next:
            self.fail_next -= 1
            return httpx.Response(503, json={"message": "the operator is starting; retry"})
        assert request.headers["authorization"] == "Bearer pod-token"
        key = request.url.path.removeprefix(c.STATE_API_PREFIX)
        if request.method == "PUT":
            self.values[key] = request.content
            return httpx.Response(204)
        if key not in self.values:
            return httpx.Response(404, json={"message": "no such key"})
        return httpx.Response(200, content=self.values[key])


def state_store(tmp_path: Path, transport: Any, **kwargs: Any) -> StateApiStore:
    (tmp_path / "token").write_text("pod-token\n")
    store = StateApiStore.from_environment({c.ENV_STATE_URL: "https://operator:8443",
                                            c.ENV_STATE_TOKEN_FILE: str(tmp_path / "token")})
    store._client = httpx.Client(transport=httpx.MockTransport(transport), base_url="https://operator:8443",
                                 auth=store._client.auth)
    for k, v in kwargs.items():
        setattr(store, f"_{k}", v)
    return store


def test_state_api_store_reads_and_writes_keys_with_the_pod_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("flowkube_runner.store.time.sleep", lambda _s: None)
    server = FakeStateApi()
    store = state_store(tmp_path, server)
    assert store.get(c.STATE_KEY) is None
    store.put(c.STATE_KEY, b"\x00state")
    assert store.get(c.STATE_KEY) == b"\x00state"
    assert server.values["other"] == b"keep"
    server.fail_next = 2
    assert store.get(c.STATE_KEY) == b"\x00state"  # an operator restart's 503s are waited out
    with pytest.raises(StoreError, match="invalid key"):
        store.get("../x")


def test_a_value_a_follower_stored_is_sent_again_only_for_leader_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica that does not reconcile stores the report and answers 503 Flowkube-Stored: the
    final report is sent again for a moment (to reach the leader), not for the whole retry window."""
    clock = [0.0]
    monkeypatch.setattr("flowkube_runner.store.time.monotonic", lambda: clock[0])
    monkeypatch.setattr("flowkube_runner.store.time.sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    follower = FakeStateApi()

    def answer(request: httpx.Request) -> httpx.Response:
        follower(request)
        return httpx.Response(503, headers={c.HEADER_STORED: "true"}, json={"message": "send it again"})

    store = state_store(tmp_path, answer)
    store.put(c.report_key("demo-1"), b"final", leader_for=2.0)  # stored: no error
    assert len(follower.requests) == 4 and clock[0] < 4
    with pytest.raises(StoreError):  # a warm report waits for the leader for the whole window
        state_store(tmp_path, answer, retry_for=10.0).put(c.report_key("demo-1"), b"warm")


def test_state_api_store_configuration_errors_are_clear() -> None:
    with pytest.raises(StoreError, match=c.ENV_STATE_URL):
        StateApiStore.from_environment({})
    with pytest.raises(StoreError, match=c.ENV_STATE_CA):
        StateApiStore.from_environment({c.ENV_STATE_URL: "https://x", c.ENV_STATE_CA: "not a certificate"})


def test_state_api_store_too_large_is_state_too_large(tmp_path: Path) -> None:
    store = state_store(tmp_path, lambda r: httpx.Response(413, json={"message": "too large"}))
    with pytest.raises(StateTooLarge):
        store.put(c.STATE_KEY, b"x")


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
    assert config.spec.budget is not None and config.spec.budget.max_total_tokens == 5
    assert config.feedback is not None and config.feedback.request_id == "r-1"
    assert config.prior_total_tokens == 7
    assert config.termination_log == Path("/dev/termination-log")
    assert not config.quotas and config.quota_heartbeat_seconds == 0
    quotas = RunnerConfig.from_env(env(**{c.ENV_QUOTAS: "true", c.ENV_QUOTA_HEARTBEAT_SECONDS: "10"}))
    assert quotas.quotas and quotas.quota_heartbeat_seconds == 10


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ({c.ENV_SPEC: "{"}, c.Reason.INVALID_DEFINITION),
        ({c.ENV_SPEC: json.dumps({"flowRef": "m:C", "definition": {}})}, c.Reason.INVALID_DEFINITION),
        ({c.ENV_SPEC: json.dumps({"flowRef": "m:C", "budget": {"maxCost": "lots"}})}, c.Reason.INVALID_SPEC),
        ({c.ENV_SPEC: json.dumps({"flowRef": "not a class"})}, c.Reason.INVALID_FLOW_REF),
        ({c.ENV_SPEC: json.dumps({"flowRef": "m:C", "inputs": "text"})}, c.Reason.INVALID_INPUTS),
        ({c.ENV_TRIGGER: "restart"}, c.Reason.INTERNAL_ERROR),
        ({c.ENV_POD_NAME: ""}, c.Reason.INTERNAL_ERROR),
    ],
)
def test_config_errors_name_their_reason(override: dict[str, str], reason: c.Reason) -> None:
    with pytest.raises(ConfigError) as info:
        RunnerConfig.from_env(env(**override))
    assert info.value.reason is reason


def test_the_runner_holds_flowkube_spec_to_the_apis_bounds() -> None:
    """The runner reads FLOWKUBE_SPEC with the API's own model: a budget the API server refuses
    (maxTotalTokens >= 1) is refused here too, naming the field as the API would."""
    spec = json.dumps({"flowRef": "m:C", "budget": {"maxTotalTokens": 0}})
    with pytest.raises(ConfigError) as info:
        RunnerConfig.from_env(env(**{c.ENV_SPEC: spec}))
    assert info.value.reason is c.Reason.INVALID_SPEC
    assert str(info.value) == f"{c.ENV_SPEC}: spec.budget.maxTotalTokens: Input should be greater than or equal to 1"
    with pytest.raises(ConfigError) as info:
        RunnerConfig.from_env(env(**{c.ENV_SPEC: json.dumps({"definition": {"name": "d"}, "flowRef": "m:C"})}))
    assert "exactly one of spec.definition or spec.flowRef must be set" in str(info.value)


def test_the_runner_reads_the_spec_the_operator_writes() -> None:
    from flowkube_api.models import Budget, FlowSpec
    from flowkube_api.runspec import RunnerSpec
    from flowkube_operator.settings import Settings
    from tests.unit.operator.pods import pod_of as runner_pod

    spec = {"definition": {"name": "d", "methods": {"a": {"start": True}}}, "inputs": {"x": [1, None]},
            "budget": {"maxTotalTokens": 9, "maxCost": "0.50"}, "suspend": False}
    pod = runner_pod({"metadata": {"name": "f", "namespace": "ns", "uid": "u"}, "spec": spec}, index=0,
                     trigger=c.Trigger.KICKOFF, settings=Settings())
    written = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}
    config = RunnerConfig.from_env({**env(), **written, c.ENV_POD_NAME: "f-0"})
    assert config.spec == RunnerSpec.of(FlowSpec.model_validate(spec))
    assert config.spec.budget == Budget(max_total_tokens=9, max_cost=Decimal("0.5"))
    assert config.spec.definition_document() == spec["definition"] and config.spec.inputs == {"x": [1, None]}


def test_state_api_store_waits_out_an_operator_restart_but_not_a_refusal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("flowkube_runner.store.time.sleep", lambda _s: None)
    answers: list[Any] = [httpx.ConnectError("refused"), httpx.Response(503), httpx.Response(429),
                          httpx.Response(409, json={"message": "earlier Flow's state"}), httpx.Response(404)]

    def server(request: httpx.Request) -> httpx.Response:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    assert state_store(tmp_path, server, retry_for=10).get(c.STATE_KEY) is None
    assert answers == []
    with pytest.raises(StoreError, match="403"):
        state_store(tmp_path, lambda r: httpx.Response(403, json={"message": "not a runner pod"}),
                    retry_for=10, refused_for=0.5).get(c.STATE_KEY)


def test_the_finished_tasks_kept_never_make_a_methods_state_too_large() -> None:
    """A method's end is written without the finished tasks of the methods still running when they
    would take the state over its limit (those tasks are then paid again after a pod loss, nothing
    else is lost); and a method's own tasks are dropped in the write that completes it."""
    from flowkube_runner.engine.persistence import StorePersistence
    from flowkube_runner.store import StateTooLarge, decode_json

    class SmallStore:
        limit, value = 2500, b""

        def get(self, key: str) -> bytes | None:
            return self.value or None

        def put(self, key: str, value: bytes, *, leader_for: float | None = None) -> None:
            if len(value) > self.limit:
                raise StateTooLarge(len(value), self.limit)
            self.value = value

    store = SmallStore()
    persistence = StorePersistence()
    cache = persistence.bind(store, "pod-1", None)
    cache._slots = {"a|crew|h|0": [{"raw": "A1"}], "b|crew|h|0": [{"raw": os.urandom(3000).hex()}]}
    persistence.save_state("flow-1", "a", {"topic": "x"})
    written = decode_json(store.value, "state")
    assert written["lastMethod"] == "a" and written["state"] == {"topic": "x"}
    assert written["tasks"] == {} and cache.snapshot() == {}, "b's big task did not fit: nothing kept"
    assert persistence.failure is None
    cache._slots = {"a|crew|h|0": [{"raw": "A1"}], "c|crew|h|0": [{"raw": "C1"}]}
    persistence.save_state("flow-1", "a", {"topic": "y"})
    assert decode_json(store.value, "state")["tasks"] == {"c|crew|h|0": [{"raw": "C1"}]}, "a's own tasks dropped"


def test_quota_reservations_go_to_the_state_api_and_a_refusal_is_quota_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime as dt

    from flowkube_api.report import Charge
    from flowkube_runner.store import QuotaRefused

    monkeypatch.setattr("flowkube_runner.store.time.sleep", lambda _s: None)
    seen: list[tuple[str, Any]] = []
    answers = iter([httpx.Response(503, json={"message": "not the leader"}), httpx.Response(200, json={"id": 7}),
                    httpx.Response(204), httpx.Response(402, json={"message": "FlowQuota ns/q: limit all ..."}),
                    httpx.Response(404, json={"message": "spend quotas are not enforced"})])

    def server(request: httpx.Request) -> httpx.Response:
        assert request.headers["Authorization"] == "Bearer pod-token"
        seen.append((request.url.path, json.loads(request.content)))
        return next(answers)

    store = state_store(tmp_path, server)
    assert store.reserve("gpt-4o", 1200, Decimal("0.0105")) == 7  # a follower's 503 is asked again
    at = dt.datetime(2026, 11, 28, 8, tzinfo=dt.UTC)
    charge = Charge(at=at, model="gpt-4o", total_tokens=300, cost=Decimal("0.002"))
    charged = [{"at": "2026-11-28T08:00:00Z", "model": "gpt-4o", "totalTokens": 300, "cost": "0.002"}]
    store.settle(7, [charge], held=[(9, "gpt-4o", 50, Decimal("0.001"))])
    with pytest.raises(QuotaRefused, match=r"^FlowQuota ns/q: limit all"):
        store.reserve("gpt-4o", 1200, Decimal("0.0105"), charges=[charge])
    assert store.reserve("gpt-4o", 1, None) == 0, "an operator that enforces no quota: nothing to settle"
    store.settle(0, None)
    first = {"model": "gpt-4o", "tokens": 1200, "cost": "0.0105", "priced": True, "charges": [], "held": []}
    assert seen == [
        ("/v1/quota/reserve", first),
        ("/v1/quota/reserve", first),
        ("/v1/quota/settle", {"id": 7, "charges": charged,
                              "held": [{"id": 9, "model": "gpt-4o", "tokens": 50, "cost": "0.001"}]}),
        ("/v1/quota/reserve", {**first, "charges": charged}),
        ("/v1/quota/reserve", {"model": "gpt-4o", "tokens": 1, "cost": "0", "priced": False, "charges": [],
                               "held": []})]


def test_an_edited_output_undoes_what_completed_after_it_and_the_edit_is_applied_once() -> None:
    from flowkube_api.models import ForkFrom
    from flowkube_runner.engine.checkpoints import ForkRefused, fork
    from flowkube_runner.engine.state import PendingRequest, StateDocument

    doc = StateDocument(flow_id="origin", state={"id": "origin", "topic": "x"}, checkpoint=4, runtime={
        "completedMethods": ["draft", "research", "merge"],
        "methodOutputs": [{"method": "draft", "output": {"raw": "old", "pydantic": {"a": 1}}},
                          {"method": "research", "output": "facts"}, {"method": "merge", "output": "both"}],
        "methodExecutionCounts": {"draft": 1, "research": 1, "merge": 1},
        "methodCallCounts": {"draft": 1, "research": 1, "merge": 1},
        "firedOrListeners": ["merge"], "pendingEvents": {"publish": ["merge", "draft"]},
        "humanFeedbackHistory": [{"method_name": "merge", "feedback": "ok"}, {"method_name": "draft"}]},
        pending=PendingRequest(request_id="publish-1", context={"method_name": "publish", "flow_id": "origin"}),
        tasks={"merge|k|h|0": [{"raw": "t"}]})
    edited = fork(doc, ForkFrom(name="origin", checkpoint=4, outputs={"draft": "new"}, inputs={"topic": "y"}))
    rt = edited.runtime
    assert rt["methodOutputs"] == [{"method": "draft", "output": {"raw": "new"}}]
    assert rt["completedMethods"] == ["draft"]
    assert rt["methodExecutionCounts"] == rt["methodCallCounts"] == {"draft": 1}
    assert rt["firedOrListeners"] == [] and rt["pendingEvents"] == {"publish": ["draft"]}
    assert rt["humanFeedbackHistory"] == [{"method_name": "draft"}]
    assert edited.pending is None and edited.tasks == {}, "asked again, about the new output"
    assert edited.state["topic"] == "y" and edited.state["id"] == edited.flow_id != "origin"
    assert edited.forked == "/origin#4" and doc.runtime["completedMethods"] == ["draft", "research", "merge"]
    with pytest.raises(ForkRefused, match=r"spec\.forkFrom\.outputs\.publish"):
        fork(doc, ForkFrom(name="origin", checkpoint=4, outputs={"publish": "x"}))


def test_a_quota_request_waits_out_an_operator_that_does_not_know_the_pod_yet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator that has just started refuses a pod's token until its watches list the pod (401/403).
    A state read gives up after refused_for (30 s); a quota settle must not (a new leader would wait for
    the pod to say what it holds), nor a reserve (the call would fail): they wait as long as a restart."""
    clock = iter(range(0, 10_000, 10))  # every look at the clock is ten seconds later
    monkeypatch.setattr("flowkube_runner.store.time.monotonic", lambda: float(next(clock)))
    monkeypatch.setattr("flowkube_runner.store.time.sleep", lambda _s: None)
    answers = iter([httpx.Response(403, json={"message": "unknown pod"})] * 6 + [httpx.Response(204)]
                   + [httpx.Response(403, json={"message": "unknown pod"})] * 6 + [httpx.Response(200, json={"id": 9})])
    store = state_store(tmp_path, lambda request: next(answers), retry_for=300.0, refused_for=30.0)
    store.settle(7, None)  # 60 s of refusals, then taken: no StoreError
    assert store.reserve("m", 1, Decimal(0)) == 9
    refusals = iter([httpx.Response(403, json={"message": "unknown pod"})] * 10)
    reader = state_store(tmp_path, lambda request: next(refusals), retry_for=300.0, refused_for=30.0)
    with pytest.raises(StoreError, match="403"):
        reader.get(c.STATE_KEY)
