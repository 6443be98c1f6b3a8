"""A real Prometheus (Debian's package) scrapes the operator; every dashboard query is executed.

Flows pause and resume, fail and retry; the numbers Prometheus sees must equal the tokens the runs
reported, survive an operator restart unchanged, and disappear with a deleted Flow.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flowkube_devstack import dashboard, procs
from flowkube_devstack.cluster import LocalCluster, free_port, http_ok, wait_for
from flowkube_devstack.operator import ChartOperator
from tests.integration.conftest import Flows

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("operator")

REVIEW = {"id": "r1", "method": "review", "message": "ok?", "emit": ["approved", "rejected"]}


class Prometheus:
    def __init__(self, root: Path, target: str, token: str = "") -> None:
        self.port = free_port()
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        auth = ""
        if token:  # as a Prometheus in the cluster presents its ServiceAccount token
            (root / "token").write_text(token)
            auth = f"    authorization: {{credentials_file: '{root / 'token'}'}}\n"
        (root / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"scrape_configs:\n  - job_name: flowkube\n    static_configs: [{{targets: ['{target}']}}]\n{auth}")
        binary = shutil.which("prometheus")
        assert binary, "Debian's prometheus package is required (./dev installs it)"
        self.proc = procs.spawn("prometheus", [
            binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"], root=root)
        wait_for(self._ready, 60, "prometheus /-/ready")

    def _ready(self) -> bool:
        return http_ok(f"http://127.0.0.1:{self.port}/-/ready")

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def value(self, expr: str) -> float | None:
        res = self.query(expr)
        return float(res[0]["value"][1]) if res else None

    def stop(self) -> None:
        procs.terminate(self.proc)


@pytest.fixture(scope="module")
def prom(operator: ChartOperator, cluster: LocalCluster) -> Iterator[Prometheus]:
    p = Prometheus(cluster.root / "prometheus", operator.metrics_target, operator.metrics_token())
    yield p
    p.stop()


def flowkube_lines(text: str, namespace: str) -> list[str]:
    return sorted(line for line in text.splitlines()
                  if line.startswith("flowkube_flow") and f'namespace="{namespace}"' in line)


def test_dashboard_queries_on_a_real_prometheus(flows: Flows, prom: Prometheus, operator: ChartOperator) -> None:
    ns = flows.ns
    flows.apply("paused", {"flowRef": "m:Review", "inputs": {"plan": [
        {"result": "Paused", "feedback": REVIEW, "tokens": 2, "cost": "0.02"}, {"tokens": 3, "cost": "0.03"}]}})
    flows.apply("flaky", {"flowRef": "m:Flaky", "retries": {"limit": 1, "backoffSeconds": 0},
                          "inputs": {"plan": [{"result": "Failed", "exit": 3, "tokens": 1}, {"tokens": 4}]}})
    flows.apply("simple", {"definition": {"name": "simple-def", "methods": {}},
                           "inputs": {"plan": [{"tokens": 7, "cost": "0.0725", "unpriced": 4}]}})
    flows.wait_phase("paused", "AwaitingFeedback")
    assert flows.patch_status("paused", {"status": {"feedback": {"response": {"text": "approved"}}}})[0] == 0
    for name in ("paused", "flaky", "simple"):
        flows.wait_phase(name, "Succeeded", timeout=90)
    reported = sum(flows.status(n)["usage"]["totalTokens"] for n in ("paused", "flaky", "simple"))
    assert reported == 2 + 3 + 1 + 4 + 7  # every run's tokens, each once

    sel = f'namespace="{ns}"'
    wait_for(lambda: prom.value(f"sum(flowkube_flow_tokens_total{{{sel},type=~'prompt|completion'}})")
             == reported and prom.value(f'sum(flowkube_flows{{{sel},phase="Succeeded"}})') == 3,
             60, "Prometheus to scrape the final numbers")

    rate = f"sum by (definition) (rate(flowkube_flow_tokens_total{{{sel}}}[1m]))"
    wait_for(lambda: len(prom.query(rate)) == 3, 60, "two samples of every series, so rate() has an answer")

    # Every expression of the shipped dashboard runs, and the ones with known answers give them.
    answers: dict[str, list[dict[str, Any]]] = {}
    for title, expr in dashboard.expressions():
        concrete = expr.replace("$namespace", ns).replace("$__rate_interval", "1m")
        answers.setdefault(title, []).extend(prom.query(concrete))
    assert float(answers["Tokens (all time)"][0]["value"][1]) == reported
    assert float(answers["LLM requests (all time)"][0]["value"][1]) == 5
    runs = {r["metric"]["trigger"]: float(r["value"][1]) for r in answers["Runs (all time)"]}
    assert runs == {"kickoff": 3, "resume": 1, "retry": 1, "turn": 0, "fork": 0}
    top = {r["metric"]["flow"]: float(r["value"][1]) for r in answers["Top flows by tokens"]}
    assert top == {"paused": 5, "flaky": 5, "simple": 7}
    assert {r["metric"]["definition"] for r in answers["Tokens per second by namespace and definition"]} \
        == {"Review", "Flaky", "simple-def"}
    assert answers["Flows awaiting feedback"][0]["value"][1] == "0"
    assert float(answers["Spend, USD (all time)"][0]["value"][1]) == pytest.approx(0.1225)
    spend = {r["metric"]["flow"]: float(r["value"][1]) for r in answers["Top flows by spend, USD"]}
    assert spend == pytest.approx({"paused": 0.05, "flaky": 0.0, "simple": 0.0725})
    assert float(answers["Unpriced tokens (all time)"][0]["value"][1]) == 4
    assert flows.status("paused")["usage"]["cost"] == "0.05"
    assert answers["Reconcile duration p99"], "operator self-metrics are scraped"

    # promtool accepts a real scrape.
    scrape = operator.metrics()
    check = subprocess.run(["promtool", "check", "metrics"], input=scrape, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    # An operator restart exports exactly the same per-flow numbers: no reset, no double count.
    before = flowkube_lines(scrape, ns)
    operator.kill()
    operator.start()
    after: list[str] = []

    def same() -> bool:
        after[:] = flowkube_lines(operator.metrics(), ns)
        return after == before

    try:
        wait_for(same, 30, "the same series after restart")
    except Exception as e:
        gone, new = sorted(set(before) - set(after)), sorted(set(after) - set(before))
        raise AssertionError(f"{e}\nonly before: {gone[:10]}\nonly after: {new[:10]}") from e

    # A deleted Flow's series disappear.
    flows.cluster.kubectl("delete", "flow", "simple", "-n", ns)
    wait_for(lambda: 'flow="simple"' not in operator.metrics(), 30, "the deleted flow's series to go")


def test_metrics_answer_only_a_user_allowed_to_get_them(operator: ChartOperator, cluster: LocalCluster,
                                                        prom: Prometheus) -> None:
    """The series name every namespace, Flow, model and their spend: a TokenReview and a
    SubjectAccessReview (the chart's metrics-reader ClusterRole) stand before them."""
    url = f"http://{operator.metrics_target}/metrics"

    def status(token: str | None) -> int:
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)

    ns = operator.namespace
    if cluster.kubectl("get", "serviceaccount", "nosy", "-n", ns, check=False).returncode != 0:
        cluster.kubectl("create", "serviceaccount", "nosy", "-n", ns)
    nosy = cluster.kubectl("create", "token", "nosy", "-n", ns, "--duration=10m").stdout.strip()
    assert status(None) == 401
    assert status("not-a-token") == 401
    assert status(nosy) == 403  # a real user, without `get /metrics`
    assert status(operator.metrics_token()) == 200
    # Prometheus, with the scraper's token, sees the target up.
    wait_for(lambda: prom.value('up{job="flowkube"}') == 1.0, 30, "Prometheus scraping with the token")


def test_the_quota_alerts_example_is_a_valid_rule_file_on_the_operators_metrics(tmp_path: Path) -> None:
    """examples/quotas/quota-alerts.yaml's PrometheusRule: its groups pass `promtool check rules`, and
    each alert's expression names only the quota families the operator exports."""
    import yaml

    rule = yaml.safe_load((REPO / "examples" / "quotas" / "quota-alerts.yaml").read_text())
    assert rule["kind"] == "PrometheusRule"
    groups = tmp_path / "rules.yaml"
    groups.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    check = subprocess.run(["promtool", "check", "rules", str(groups)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    alerts = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {"FlowQuotaNearLimit", "FlowQuotaExhausted"}
    from flowkube_operator.quotas.service import QUOTA_FAMILIES

    exported = {name for name, _ in QUOTA_FAMILIES}
    for expr in alerts.values():
        assert set(re.findall(r"flowkube_\w+", expr)) <= exported, expr
    # And what the operator exports for them is valid exposition text (a quota with a token and a cost cap).
    import datetime as dt

    from flowkube_operator.quotas.service import Quotas

    quotas = Quotas(lambda: None, lambda: True, clock=lambda: dt.datetime(2026, 11, 28, 8, tzinfo=dt.UTC))
    quotas.quota_event("ADDED", {"metadata": {"name": "team", "namespace": "lab", "uid": "u", "generation": 1},
                                 "spec": {"limits": [{"name": "daily", "maxTotalTokens": 100, "maxCost": "2.5",
                                                      "window": {"kind": "Day"}}]}})
    text = quotas.metrics_text()
    assert 'flowkube_quota_limit{namespace="lab",quota="team",limit="daily",unit="usd"} 2.5' in text
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
