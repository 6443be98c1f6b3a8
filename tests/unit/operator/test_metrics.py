"""Per-flow metrics are a pure function of Flow status: same status, same numbers; gone flow, gone series."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import pytest

from flowkube_operator.flows.metrics import FlowMetrics


def body(name: str, phase: str = "Succeeded", tokens: tuple[int, int] = (10, 5), model: str = "gpt-4o",
         history: list[dict[str, Any]] | None = None, ns: str = "team-a") -> dict[str, Any]:
    p, comp = tokens
    u = {"promptTokens": p, "completionTokens": comp, "totalTokens": p + comp, "cachedPromptTokens": 1,
         "reasoningTokens": 0, "cacheCreationTokens": 0, "successfulRequests": 2}
    return {
        "metadata": {"namespace": ns, "name": name},
        "spec": {"definition": {"name": "research"}},
        "status": {"phase": phase, "definition": "research", "usage": {**u, "byModel": {model: u}},
                   "runs": [{"pod": f"{name}-0", "trigger": "kickoff"}, {"pod": f"{name}-1", "trigger": "resume"}],
                   "feedback": {"history": history or []}},
    }


def of_cronflow(b: dict[str, Any], cronflow: str) -> dict[str, Any]:
    """``b`` as the CronFlow controller makes it: its label and its controller reference."""
    b["metadata"]["labels"] = {"flowkube.io/cronflow": cronflow}
    b["metadata"]["ownerReferences"] = [{"apiVersion": "flowkube.io/v1alpha1", "kind": "CronFlow", "name": cronflow,
                                         "uid": f"uid-{cronflow}", "controller": True}]
    return b


def samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def test_tokens_requests_runs_and_phase_per_flow() -> None:
    m = FlowMetrics()
    m.update(("team-a", "f1"), body("f1"))
    s = samples(m.render())
    base = 'namespace="team-a",flow="f1",definition="research"'
    assert s[f'flowkube_flow_tokens_total{{{base},model="gpt-4o",type="prompt"}}'] == 10
    assert s[f'flowkube_flow_tokens_total{{{base},model="gpt-4o",type="completion"}}'] == 5
    assert s[f'flowkube_flow_tokens_total{{{base},model="gpt-4o",type="cached_prompt"}}'] == 1
    assert s[f'flowkube_flow_llm_requests_total{{{base},model="gpt-4o"}}'] == 2
    assert s[f'flowkube_flow_runs_total{{{base},trigger="resume"}}'] == 1
    assert s[f'flowkube_flow_runs_total{{{base},trigger="retry"}}'] == 0
    assert s[f'flowkube_flow_phase{{{base},phase="Succeeded"}}'] == 1
    assert s[f'flowkube_flow_phase{{{base},phase="Running"}}'] == 0
    assert s['flowkube_flows{namespace="team-a",phase="Succeeded"}'] == 1


def test_same_status_after_restart_gives_identical_output_and_deletion_removes_series() -> None:
    a, b = FlowMetrics(), FlowMetrics()
    a.update(("team-a", "f1"), body("f1", phase="Pending"))  # a has seen the history, b only the end
    a.update(("team-a", "f1"), body("f1", phase="Running"))
    for m in (a, b):
        m.update(("team-a", "f1"), body("f1"))
        m.update(("team-a", "f2"), body("f2", phase="Running"))
    a.update(("team-a", "f1"), body("f1"))  # the same event delivered twice changes nothing
    assert a.render() == b.render()
    a.update(("team-a", "f1"), None)
    text = a.render()
    assert 'flow="f1"' not in text and 'flow="f2"' in text
    assert samples(text)['flowkube_flows{namespace="team-a",phase="Succeeded"}'] == 0


def test_feedback_wait_histogram() -> None:
    m = FlowMetrics()
    hist = [{"requestId": "r", "requestedAt": "2026-01-01T00:00:00Z", "respondedAt": "2026-01-01T00:00:20Z"}]
    m.update(("team-a", "f1"), body("f1", history=hist))
    s = samples(m.render())
    lab = 'namespace="team-a",definition="research"'
    assert s[f'flowkube_feedback_wait_seconds_bucket{{{lab},le="15"}}'] == 0
    assert s[f'flowkube_feedback_wait_seconds_bucket{{{lab},le="30"}}'] == 1
    assert s[f'flowkube_feedback_wait_seconds_bucket{{{lab},le="+Inf"}}'] == 1
    assert s[f"flowkube_feedback_wait_seconds_sum{{{lab}}}"] == 20
    assert s[f"flowkube_feedback_wait_seconds_count{{{lab}}}"] == 1


def test_rollup_mode_drops_the_flow_label_and_sums() -> None:
    m = FlowMetrics(per_flow=False)
    m.update(("team-a", "f1"), body("f1"))
    m.update(("team-a", "f2"), body("f2", tokens=(1, 1)))
    s = samples(m.render())
    assert 'flow="' not in m.render()
    lab = 'namespace="team-a",definition="research",model="gpt-4o"'
    assert s[f'flowkube_flow_tokens_total{{{lab},type="prompt"}}'] == 11
    m.update(("team-a", "f2"), body("f2", tokens=(2, 1)))  # a later run of f2: the sum follows
    assert samples(m.render())[f'flowkube_flow_tokens_total{{{lab},type="prompt"}}'] == 12


def test_label_values_are_escaped() -> None:
    m = FlowMetrics()
    m.update(("team-a", "f1"), body("f1", model='we"ird\\model'))
    assert 'model="we\\"ird\\\\model"' in m.render()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (./dev installs it)")
def test_promtool_accepts_the_exposition() -> None:
    m = FlowMetrics()
    m.update(("team-a", "f1"), body("f1", history=[{"requestedAt": "2026-01-01T00:00:00Z",
                                                    "respondedAt": "2026-01-01T00:01:00Z"}]))
    out = subprocess.run(["promtool", "check", "metrics"], input=m.render(), capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_histogram_buckets_stay_whole_when_one_of_two_flows_goes() -> None:
    m = FlowMetrics()
    slow = [{"requestedAt": "2026-01-01T00:00:00Z", "respondedAt": "2026-01-01T01:00:00Z"}]
    fast = [{"requestedAt": "2026-01-01T00:00:00Z", "respondedAt": "2026-01-01T00:00:01Z"}]
    m.update(("team-a", "f1"), body("f1", history=slow))
    m.update(("team-a", "f2"), body("f2", history=fast))
    m.update(("team-a", "f2"), None)
    s = samples(m.render())
    lab = 'namespace="team-a",definition="research"'
    assert s[f'flowkube_feedback_wait_seconds_bucket{{{lab},le="1"}}'] == 0  # still exported, as zero
    assert s[f'flowkube_feedback_wait_seconds_bucket{{{lab},le="+Inf"}}'] == 1


def test_rollup_counters_never_decrease_when_flows_are_deleted() -> None:
    m = FlowMetrics(per_flow=False)
    m.update(("team-a", "f1"), body("f1", tokens=(3, 2)))
    m.update(("team-a", "f1"), None)
    lab = 'namespace="team-a",definition="research",model="gpt-4o"'
    assert samples(m.render())[f'flowkube_flow_tokens_total{{{lab},type="prompt"}}'] == 3


def test_spend_per_flow_and_model_and_a_namespace_rollup_that_keeps_deleted_flows() -> None:
    m = FlowMetrics()
    for name, cost, unpriced in (("f1", "0.0125", 0), ("f2", "0.5", 40)):
        b = body(name)
        b["status"]["usage"]["byModel"]["gpt-4o"] = {**b["status"]["usage"]["byModel"]["gpt-4o"], "cost": cost,
                                                     "unpricedTokens": unpriced}
        m.update(("team-a", name), b)
    s = samples(m.render())
    base = 'namespace="team-a",flow="f1",definition="research"'
    assert s[f'flowkube_flow_cost_usd_total{{{base},model="gpt-4o"}}'] == 0.0125
    assert s['flowkube_flow_unpriced_tokens_total{namespace="team-a",flow="f2",definition="research",model="gpt-4o"}'] \
        == 40
    rollup = 'flowkube_namespace_cost_usd_total{namespace="team-a",definition="research",model="gpt-4o"}'
    assert s[rollup] == 0.5125
    m.update(("team-a", "f2"), None)  # deleted: its series go, its spend stays in the namespace's counter
    s = samples(m.render())
    assert not any('flow="f2"' in k for k in s) and s[rollup] == 0.5125


def test_flows_of_a_template_carry_its_name_and_spend_sums_by_template() -> None:
    m = FlowMetrics(per_flow=False)
    for name in ("night-1", "night-2"):
        b = body(name)
        b["spec"] = {"templateRef": {"name": "nightly"}}
        m.update(("team-a", name), b)
    m.update(("team-a", "adhoc"), body("adhoc"))
    text = m.render()
    assert ('flowkube_flow_llm_requests_total{namespace="team-a",definition="research",template="nightly",'
            'model="gpt-4o"} 4') in text
    assert 'flowkube_flow_llm_requests_total{namespace="team-a",definition="research",model="gpt-4o"} 2' in text
    assert 'flowkube_namespace_cost_usd_total{namespace="team-a",definition="research",template="nightly",' in text


def test_flows_of_a_cronflow_carry_its_name() -> None:
    m = FlowMetrics(per_flow=True)
    m.update(("team-a", "nightly-29000000"), of_cronflow(body("nightly-29000000"), "nightly"))
    assert ('flowkube_flow_llm_requests_total{namespace="team-a",flow="nightly-29000000",definition="research",'
            'cronflow="nightly",model="gpt-4o"} 2') in m.render()


def test_a_cronflow_label_on_a_flow_no_cronflow_owns_is_not_a_label_value() -> None:
    """Anyone who may write a Flow may write the label; only a CronFlow's own Flows carry its name."""
    m = FlowMetrics(per_flow=True)
    forged = body("forged")
    forged["metadata"]["labels"] = {"flowkube.io/cronflow": "nightly"}
    other_owner = of_cronflow(body("other-owner"), "nightly")
    other_owner["metadata"]["ownerReferences"][0]["name"] = "weekly"  # owned, but by another CronFlow
    m.update(("team-a", "forged"), forged)
    m.update(("team-a", "other-owner"), other_owner)
    text = m.render()
    assert "cronflow=" not in text
    assert 'flowkube_flow_llm_requests_total{namespace="team-a",flow="forged",definition="research",' \
        'model="gpt-4o"} 2' in text


@pytest.mark.parametrize("per_flow", [True, False])
def test_thousands_of_names_created_and_deleted_leave_at_most_the_documented_series(per_flow: bool) -> None:
    """A tenant making up definition, cronflow and model names by the thousand, with Flows it then
    deletes, moves its own namespace's series into ``other``; the spend stays counted, once."""
    from flowkube_operator.flows.metrics import flow_series_budget, namespace_series_budget
    from flowkube_operator.labels import OTHER

    m = FlowMetrics(per_flow=per_flow, label_values=20)
    m.update(("team-b", "steady"), body("steady", ns="team-b"))
    steady = m.series()
    for i in range(3000):
        b = of_cronflow(body(f"f{i}", model=f"model-{i}"), f"cron-{i}")
        b["status"]["definition"] = f"def-{i}"
        b["status"]["usage"]["byModel"][f"model-{i}"]["cost"] = "0.25"
        b["status"]["feedback"]["history"] = [{"requestedAt": "2026-11-22T00:00:00Z", "respondedAt":
                                               "2026-11-22T00:00:09Z"}]
        m.update(("team-a", f"f{i}"), b)
        assert m.series() <= steady + namespace_series_budget(20, per_flow) + (i + 1) * flow_series_budget(20)
    for i in range(3000):
        m.update(("team-a", f"f{i}"), None)
    # The namespace's series: at most its budget, 763 (per-flow) or 4564 (rollup) at 20 names (docs/api.md).
    assert namespace_series_budget(20, per_flow) == (763 if per_flow else 4564)
    assert m.series() - steady <= namespace_series_budget(20, per_flow)
    text = m.render()
    s = samples(text)
    assert len(s) == m.series()
    spend = {k: v for k, v in s.items() if k.startswith('flowkube_namespace_cost_usd_total{namespace="team-a"')}
    assert sum(spend.values()) == pytest.approx(0.25 * 3000)  # every deleted Flow's spend, counted once
    other = f'namespace="team-a",definition="{OTHER}",cronflow="{OTHER}",model="{OTHER}"'
    assert spend[f"flowkube_namespace_cost_usd_total{{{other}}}"] == pytest.approx(0.25 * 2980)
    assert len({k for k in spend if 'definition="def-' in k}) == 20  # the first 20 names seen keep theirs
    # Another namespace's names are its own: untouched by team-a's.
    assert 'flowkube_namespace_cost_usd_total{namespace="team-b",definition="research",model="gpt-4o"}' in text


def test_a_label_value_longer_than_the_limit_is_folded() -> None:
    m = FlowMetrics(per_flow=True)
    b = body("long", model="m" * 300)
    b["status"]["definition"] = "d" * 300
    m.update(("team-a", "long"), b)
    text = m.render()
    assert "m" * 300 not in text and "d" * 300 not in text
    assert 'flow="long",definition="other",model="other"' in text
    b = body("long-template")
    b["spec"] = {"templateRef": {"name": "t" * 253}}
    b["status"]["definition"] = "d" * 256  # each within the limit, together longer: both kept
    m.update(("team-a", "long-template"), b)
    assert f'flow="long-template",definition="{"d" * 256}",template="{"t" * 253}",model="gpt-4o"' in m.render()


def test_render_time_at_10000_flows() -> None:
    """Not a timed assertion: prints the figures (`pytest -s`) for docs and bench_scale. The render
    runs in a thread (app.py); on the event loop only the snapshot is taken."""
    import gc
    import time

    for per_flow in (True, False):
        m = FlowMetrics(per_flow=per_flow)
        for i in range(10_000):
            ns = f"team-{i % 20}"
            m.update((ns, f"f{i}"), body(f"f{i}", ns=ns))
        gc.collect()  # a collection can fall in any allocation on the loop: not the snapshot's own time
        started = time.perf_counter()
        snap = m.snapshot()
        taken = time.perf_counter()
        text = snap.render()
        done = time.perf_counter()
        print(f"\n10,000 Flows, per_flow={per_flow}: snapshot {1000 * (taken - started):.2f} ms on the loop, "
              f"render {1000 * (done - taken):.1f} ms in a thread, {len(text)} bytes, {m.series()} series")
        assert text.count("\n") - 2 * 10 == m.series()  # every sample but the HELP and TYPE lines


def test_the_turn_latency_histogram_caps_definitions_per_namespace() -> None:
    """Its series outlive the Flows: made-up definition names go to ``other`` past the namespace's cap."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from flowkube_operator.selfmetrics import TURN_SECONDS, _ByDefinition

    registry = CollectorRegistry()
    turns = _ByDefinition(Histogram("turn_seconds", "", ["namespace", "definition"], registry=registry), limit=3)
    for i in range(1000):
        turns.labels("team-a", f"def-{i}").observe(1.0)
    turns.labels("team-b", "chat").observe(1.0)
    counts = samples(generate_latest(registry).decode())
    assert {k: v for k, v in counts.items() if k.startswith("turn_seconds_count")} == {
        'turn_seconds_count{definition="def-0",namespace="team-a"}': 1.0,
        'turn_seconds_count{definition="def-1",namespace="team-a"}': 1.0,
        'turn_seconds_count{definition="def-2",namespace="team-a"}': 1.0,
        'turn_seconds_count{definition="other",namespace="team-a"}': 997.0,
        'turn_seconds_count{definition="chat",namespace="team-b"}': 1.0}
    assert isinstance(TURN_SECONDS, _ByDefinition)  # the operator's own is capped the same way


def test_metrics_are_rendered_off_the_event_loop_from_a_snapshot(tmp_path: Any, monkeypatch: Any) -> None:
    """The loop that renews the Lease only takes the snapshot; the text is made in another thread."""
    import asyncio
    import threading

    from aiohttp.test_utils import TestClient, TestServer

    from flowkube_operator.app import App
    from flowkube_operator.flows.metrics import MetricsSnapshot
    from flowkube_operator.kube import tls
    from flowkube_operator.settings import Settings

    app = App(Settings(webhook_enabled=False, leader_election=False),
              tls.issue(tls.ca_from_dir(str(tmp_path)), str(tmp_path), ["127.0.0.1"], ""))
    app.controller.cache.flow_event("ADDED", {"metadata": {"name": "f", "namespace": "ns", "uid": "u1",
                                                     "resourceVersion": "3"},
                                        "spec": {"flowRef": "a:B"}, "status": {"phase": "Running"}})
    app.controller.shell.leading = True  # only the leader exports the per-flow series
    rendered_on: list[threading.Thread] = []
    render = MetricsSnapshot.render

    def spy(self: MetricsSnapshot) -> str:
        rendered_on.append(threading.current_thread())
        return render(self)

    monkeypatch.setattr(MetricsSnapshot, "render", spy)

    async def scrape() -> tuple[str, threading.Thread]:
        async with TestClient(TestServer(app._metrics_app())) as client:
            return await (await client.get("/metrics")).text(), threading.current_thread()

    text, loop_thread = asyncio.run(scrape())
    assert 'flowkube_flow_phase{namespace="ns",flow="f",definition="' in text
    assert "flowkube_operator_leader" in text
    assert rendered_on and all(t is not loop_thread for t in rendered_on)
