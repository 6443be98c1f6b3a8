"""The Grafana dashboard, generated as code with grafana-foundation-sdk into the Helm chart.

`./dev generate` writes it to charts/flowkube/dashboards/flowkube.json (`./dev test` fails when
the committed JSON is stale); an integration test runs every PromQL
expression of the dashboard against a real Prometheus scraping the operator.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import bargauge, dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

OUT = Path(__file__).resolve().parents[2] / "charts" / "flowkube" / "dashboards" / "flowkube.json"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
NS = 'namespace=~"$namespace"'


def _q(expr: str, legend: str = "", instant: bool = False) -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).legend_format(legend or "__auto").datasource(DS).ref_id("A")
    return q.instant() if instant else q.range()


def _ts(title: str, unit: str, *queries: prometheus.Dataquery, w: int = 12) -> timeseries.Panel:
    p = timeseries.Panel().title(title).unit(unit).height(8).span(w).datasource(DS)
    for ref, q in zip("ABCDEFGH", queries, strict=False):
        p = p.with_target(q.ref_id(ref))
    return p


def _stat(title: str, unit: str, query: prometheus.Dataquery, description: str = "") -> stat.Panel:
    p = stat.Panel().title(title).unit(unit).height(4).span(6).datasource(DS).with_target(query)
    return p.description(description) if description else p


def _quantiles(title: str, histogram: str) -> timeseries.Panel:
    """p50 and p95 of a histogram in seconds, by definition."""
    return _ts(title, "s", *(
        _q(f"histogram_quantile({q}, sum by (le, definition) "
           f"(rate({histogram}_bucket{{{NS}}}[$__rate_interval])))", f"p{round(q * 100)} {{{{definition}}}}")
        for q in (0.5, 0.95)))


def build() -> dict[str, Any]:
    d = (
        dashboard.Dashboard("flowkube")
        .uid("flowkube")
        .tags(["flowkube", "crewai", "llm"])
        .description("crewAI Flows run by flowkube: LLM token usage and spend, flows, feedback, operator health.")
        .refresh("1m")
        .time("now-6h", "now")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            dashboard.QueryVariable("namespace").label("Namespace").datasource(DS)
            .query("label_values(flowkube_flows, namespace)").multi(True).include_all(True)
            .all_value(".*").refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        )
        .with_row(dashboard.Row("Token usage"))
        .with_panel(_stat("Tokens (all time)", "short",
                          _q(f"sum(flowkube_flow_tokens_total{{{NS}}})", "tokens", instant=True)))
        .with_panel(_stat("LLM requests (all time)", "short",
                          _q(f"sum(flowkube_flow_llm_requests_total{{{NS}}})", "requests", instant=True)))
        .with_panel(_stat("Runs (all time)", "short",
                          _q(f"sum by (trigger) (flowkube_flow_runs_total{{{NS}}})", "{{trigger}}", instant=True)))
        .with_panel(_stat("Flows awaiting feedback", "short",
                          _q(f'sum(flowkube_flows{{{NS},phase="AwaitingFeedback"}})', "awaiting", instant=True)))
        .with_panel(_ts("Tokens per second by namespace and definition", "short",
                        _q(f"sum by (namespace, definition) (rate(flowkube_flow_tokens_total{{{NS}}}"
                           "[$__rate_interval]))", "{{namespace}}/{{definition}}")))
        .with_panel(_ts("Tokens per second by model and type", "short",
                        _q(f"sum by (model, type) (rate(flowkube_flow_tokens_total{{{NS}}}[$__rate_interval]))",
                           "{{model}} {{type}}")))
        .with_panel(bargauge.Panel().title("Top flows by tokens").unit("short").height(8).span(12).datasource(DS)
                    .with_target(_q(f"topk(10, sum by (namespace, flow, definition) "
                                    f"(flowkube_flow_tokens_total{{{NS}}}))", "{{namespace}}/{{flow}}",
                                    instant=True)))
        .with_panel(_ts("LLM requests per second by definition and model", "reqps",
                        _q(f"sum by (definition, model) (rate(flowkube_flow_llm_requests_total{{{NS}}}"
                           "[$__rate_interval]))", "{{definition}} {{model}}")))
        .with_row(dashboard.Row("Spend"))
        .with_panel(_stat("Spend, USD (all time)", "currencyUSD",
                          _q(f"sum(flowkube_namespace_cost_usd_total{{{NS}}})", "USD", instant=True)))
        .with_panel(_stat("Unpriced tokens (all time)", "short",
                          _q(f"sum(flowkube_flow_unpriced_tokens_total{{{NS}}})", "tokens", instant=True),
                          "Tokens of calls whose model has no price in the table or the overrides "
                          "(runner.prices): their cost is unknown, not zero."))
        .with_panel(bargauge.Panel().title("Top flows by spend, USD").unit("currencyUSD").height(8).span(12)
                    .datasource(DS)
                    .with_target(_q(f"topk(10, sum by (namespace, flow, definition) "
                                    f"(flowkube_flow_cost_usd_total{{{NS}}}))", "{{namespace}}/{{flow}}",
                                    instant=True)))
        .with_panel(_ts("Spend per hour by namespace and definition, USD", "currencyUSD",
                        _q(f"sum by (namespace, definition) (increase(flowkube_namespace_cost_usd_total{{{NS}}}"
                           "[1h]))", "{{namespace}}/{{definition}}")))
        .with_panel(_ts("Spend per hour by model, USD", "currencyUSD",
                        _q(f"sum by (model) (increase(flowkube_namespace_cost_usd_total{{{NS}}}[1h]))",
                           "{{model}}")))
        .with_panel(_ts("Spend per day by template, USD", "currencyUSD",
                        _q(f'sum by (namespace, template) (increase(flowkube_namespace_cost_usd_total{{{NS},'
                           'template!=""}[1d]))', "{{namespace}}/{{template}}")))
        .with_panel(_ts("Spend per day by CronFlow, USD", "currencyUSD",
                        _q(f'sum by (namespace, cronflow) (increase(flowkube_namespace_cost_usd_total{{{NS},'
                           'cronflow!=""}[1d]))', "{{namespace}}/{{cronflow}}")))
        .with_row(dashboard.Row("Flows and feedback"))
        .with_panel(_ts("Flows by phase", "short",
                        _q(f"sum by (phase) (flowkube_flows{{{NS}}})", "{{phase}}")))
        .with_panel(_ts("Runs started per second by trigger", "short",
                        _q(f"sum by (trigger) (rate(flowkube_flow_runs_total{{{NS}}}[$__rate_interval]))",
                           "{{trigger}}")))
        .with_panel(_quantiles("Feedback wait (p50, p95) by definition", "flowkube_feedback_wait_seconds"))
        .with_panel(table.Panel().title("Flows not succeeded").height(8).span(12).datasource(DS)
                    .with_target(_q(f'flowkube_flow_phase{{{NS},phase!="Succeeded"}} == 1', "", instant=True)))
        .with_row(dashboard.Row("Conversations"))
        .with_panel(_ts("Messages answered per second by definition", "short",
                        _q(f"sum by (definition) (rate(flowkube_flow_turns_total{{{NS}}}[$__rate_interval]))",
                           "{{definition}}")))
        .with_panel(_quantiles("Message to reply (p50, p95) by definition", "flowkube_conversation_turn_seconds"))
        .with_row(dashboard.Row("Quotas"))
        .with_panel(_ts("FlowQuota use by limit, % of the limit", "percent",
                        _q(f"100 * flowkube_quota_used{{{NS}}} / flowkube_quota_limit{{{NS}}}",
                           "{{namespace}}/{{quota}} {{limit}} ({{unit}})")))
        .with_panel(_ts("FlowQuota reserved by calls in flight, % of the limit", "percent",
                        _q(f"100 * flowkube_quota_reserved{{{NS}}} / flowkube_quota_limit{{{NS}}}",
                           "{{namespace}}/{{quota}} {{limit}} ({{unit}})")))
        .with_row(dashboard.Row("Operator"))
        .with_panel(_ts("Reconcile duration p99", "s",
                        _q("histogram_quantile(0.99, sum by (le) "
                           "(rate(flowkube_operator_reconcile_duration_seconds_bucket[$__rate_interval])))",
                           "p99")))
        .with_panel(_ts("Reconcile errors per second by reason", "short",
                        _q("sum by (reason) (rate(flowkube_operator_reconcile_errors_total[$__rate_interval]))",
                           "{{reason}}")))
        .with_panel(_ts("API request latency p99 by verb", "s",
                        _q("histogram_quantile(0.99, sum by (le, verb) "
                           "(rate(flowkube_operator_api_request_duration_seconds_bucket[$__rate_interval])))",
                           "{{verb}}")))
        .with_panel(_ts("Work queue", "short",
                        _q("sum(flowkube_operator_workqueue_depth)", "queued"),
                        _q("sum(flowkube_operator_reconciles_in_flight)", "in flight"),
                        _q("sum(flowkube_operator_workqueue_delayed)", "scheduled")))
        .with_panel(_ts("Runner state API requests per second by status", "reqps",
                        _q("sum by (method, code) (rate(flowkube_operator_state_requests_total[$__rate_interval]))",
                           "{{method}} {{code}}")))
    )
    result: dict[str, Any] = json.loads(json.dumps(d.build(), cls=JSONEncoder))
    return result


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def expressions(doc: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of the dashboard."""
    doc = doc or build()
    return [(p.get("title", ""), t["expr"]) for p in doc.get("panels", []) for t in p.get("targets") or []
            if "expr" in t]
