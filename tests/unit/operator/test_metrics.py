"""Per-flow metrics are a pure function of Flow status: same status, same numbers; gone flow, gone series."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import pytest

from flowkube_operator.metrics import FlowMetrics


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
    b = body("nightly-29000000")
    b["metadata"]["labels"] = {"flowkube.io/cronflow": "nightly"}
    m.update(("team-a", "nightly-29000000"), b)
    assert ('flowkube_flow_llm_requests_total{namespace="team-a",flow="nightly-29000000",definition="research",'
            'cronflow="nightly",model="gpt-4o"} 2') in m.render()
