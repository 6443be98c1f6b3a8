"""Per-flow Prometheus metrics, derived from Flow status alone.

Every number here is a function of the Flow objects the operator caches, so a restarted operator
exports exactly the same values (no reset, no double count) and a deleted Flow's series vanish.
Each Flow's series are rendered to text when its status changes; a scrape only concatenates,
so `/metrics` stays fast with tens of thousands of Flows, and it does so off the event loop, from a
``snapshot`` taken on it (see app.py).

Label values a tenant chooses (definition, template and cronflow names, model names) are capped per
namespace by a ``LabelBudget``: the first ``limit`` (definition, template, cronflow) combinations and
the first ``limit`` models seen in a namespace keep their names, the rest are folded into ``other``.
So the number of series per namespace is bounded whatever names a tenant makes up, and a deleted
Flow's spend, which the namespace's counters keep, stays in one of those bounded series.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

from flowkube_api.base import parse_time
from flowkube_api.constants import CRONFLOW_KIND, GROUP, LABEL_CRONFLOW, Phase, Trigger
from flowkube_api.report import Usage
from flowkube_operator.flows.resources import definition_name
from flowkube_operator.labels import DEFAULT_LABEL_VALUES, OTHER, LabelBudget, escape_value

Body = dict[str, Any]
Key = tuple[str, str]
Labels = tuple[tuple[str, str], ...]

TOKEN_TYPES = {  # the `type` label's values, and the `Usage` fields they count
    "prompt": "prompt_tokens",
    "completion": "completion_tokens",
    "cached_prompt": "cached_prompt_tokens",
    "reasoning": "reasoning_tokens",
    "cache_creation": "cache_creation_tokens",
}
WAIT_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)

FAMILIES: dict[str, tuple[str, str]] = {
    "flowkube_flow_tokens_total": ("counter", "LLM tokens used by a flow over all its runs, by model and type."),
    "flowkube_flow_llm_requests_total": ("counter", "Successful LLM requests of a flow over all its runs."),
    "flowkube_flow_cost_usd_total": ("counter", "USD a flow's LLM calls cost over all its runs, by model "
                                     "(priced by the runner at the time of each call)."),
    "flowkube_flow_unpriced_tokens_total": ("counter", "Tokens of a flow's LLM calls whose model has no price."),
    "flowkube_namespace_cost_usd_total": ("counter", "USD spent by the flows of a namespace, by definition, template "
                                          "and model; a deleted Flow's spend stays."),
    "flowkube_flow_runs_total": ("counter", "Runner pods started for a flow, by trigger."),
    "flowkube_flow_turns_total": ("counter", "Messages a conversation answered."),
    "flowkube_flow_phase": ("gauge", "1 for the flow's current phase, 0 for the others."),
    "flowkube_flows": ("gauge", "Flows by namespace and phase."),
    "flowkube_feedback_wait_seconds": ("histogram", "Time feedback requests waited for an answer or timeout."),
}
PER_FLOW = ("flowkube_flow_tokens_total", "flowkube_flow_llm_requests_total", "flowkube_flow_runs_total",
            "flowkube_flow_phase", "flowkube_flow_cost_usd_total", "flowkube_flow_unpriced_tokens_total",
            "flowkube_flow_turns_total")


# In rollup mode (no `flow` label) these sum over Flows; a deleted Flow's part stays, so the
# counters never decrease while the operator runs (a restart is a counter reset, as usual).
ROLLUP_COUNTERS = frozenset({"flowkube_flow_tokens_total", "flowkube_flow_llm_requests_total",
                             "flowkube_flow_runs_total", "flowkube_flow_cost_usd_total",
                             "flowkube_flow_unpriced_tokens_total", "flowkube_namespace_cost_usd_total",
                             "flowkube_flow_turns_total"})


@functools.lru_cache(maxsize=4096)
def _label(k: str, v: str) -> str:
    return f'{k}="{escape_value(v)}"'


def _fmt_labels(labels: Labels) -> str:
    return ",".join(_label(k, v) for k, v in labels)


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _definition(body: Body) -> str:
    st = body.get("status") or {}
    return str(st.get("definition") or definition_name(body.get("spec") or {}))


_PHASES = tuple(p.value for p in Phase)
_TRIGGERS = tuple(t.value for t in Trigger)


def cronflow_of(meta: Body) -> str:
    """The CronFlow that started this Flow: its ``flowkube.io/cronflow`` label only when a CronFlow of
    that name controls it (a tenant may write the label on any Flow; the CronFlow controller sets the
    owner, and the garbage collector deletes a Flow whose owner does not exist)."""
    name = str((meta.get("labels") or {}).get(LABEL_CRONFLOW) or "")
    if name and any(ref.get("kind") == CRONFLOW_KIND and ref.get("name") == name and ref.get("controller")
                    and str(ref.get("apiVersion") or "").startswith(f"{GROUP}/")
                    for ref in meta.get("ownerReferences") or ()):
        return name
    return ""


def _names(body: Body, budget: LabelBudget) -> tuple[str, Labels]:
    """The Flow's definition label and its template/cronflow labels, within the namespace's budget."""
    meta = body.get("metadata") or {}
    definition = _definition(body)
    # A Flow of a template, or started by a CronFlow, carries its name: spend and usage sum by either.
    template = str(((body.get("spec") or {}).get("templateRef") or {}).get("name") or "")
    cronflow = cronflow_of(meta)
    group = f"{definition}\0{template}\0{cronflow}"
    if budget.value(meta.get("namespace", ""), "group", group, definition, template, cronflow) == OTHER:
        definition, template, cronflow = OTHER, template and OTHER, cronflow and OTHER
    of_template: Labels = ((("template", template),) if template else ()) + (
        (("cronflow", cronflow),) if cronflow else ())
    return definition, of_template


def _usage(out: dict[tuple[str, Labels], float], ns: str, base: Labels, of_definition: Labels, usage: Usage,
           budget: LabelBudget) -> None:
    """The usage families, by model; models past the namespace's budget are summed under ``other``."""
    for name, u in sorted(usage.by_model.items()):
        model = budget.value(ns, "model", name)
        cost = float(u.cost)
        values: list[tuple[tuple[str, Labels], float]] = [
            (("flowkube_flow_tokens_total", (*base, ("model", model), ("type", tname))), getattr(u, field))
            for tname, field in TOKEN_TYPES.items()]
        values += [(("flowkube_flow_llm_requests_total", (*base, ("model", model))), u.successful_requests),
                   (("flowkube_flow_cost_usd_total", (*base, ("model", model))), cost),
                   (("flowkube_flow_unpriced_tokens_total", (*base, ("model", model))), u.unpriced_tokens),
                   (("flowkube_namespace_cost_usd_total", (*of_definition, ("model", model))), cost)]
        for sample, v in values:
            out[sample] = out.get(sample, 0) + v


def contributions(body: Body, budget: LabelBudget) -> dict[tuple[str, Labels], float]:
    """Every sample one Flow adds, with the full label set (flow included)."""
    meta, st = body.get("metadata") or {}, body.get("status") or {}
    ns, name = meta.get("namespace", ""), meta.get("name", "")
    definition, of_template = _names(body, budget)
    base = (("namespace", ns), ("flow", name), ("definition", definition), *of_template)
    out: dict[tuple[str, Labels], float] = {}
    usage = Usage.read(st.get("usage"))
    _usage(out, ns, base, (("namespace", ns), ("definition", definition), *of_template), usage, budget)
    counts = dict.fromkeys(_TRIGGERS, 0)
    for r in st.get("runs") or []:
        counts[r.get("trigger", "kickoff")] = counts.get(r.get("trigger", "kickoff"), 0) + 1
    for trig, n in counts.items():
        out[("flowkube_flow_runs_total", (*base, ("trigger", trig)))] = n
    conversation = st.get("conversation") or {}
    if conversation.get("sessionId"):
        out[("flowkube_flow_turns_total", base)] = conversation.get("turns", 0)
    phase = st.get("phase") or Phase.PENDING.value
    for p in _PHASES:
        out[("flowkube_flow_phase", (*base, ("phase", p)))] = 1 if p == phase else 0
    out[("flowkube_flows", (("namespace", ns), ("phase", phase)))] = 1
    hist: Labels = (("namespace", ns), ("definition", definition))
    for h in (st.get("feedback") or {}).get("history") or []:
        asked, answered = parse_time(h.get("requestedAt")), parse_time(h.get("respondedAt"))
        if asked is None or answered is None:
            continue
        wait = max((answered - asked).total_seconds(), 0.0)
        for le in (*(_num(b) for b in WAIT_BUCKETS), "+Inf"):
            bucket: tuple[str, Labels] = ("flowkube_feedback_wait_seconds_bucket", (*hist, ("le", le)))
            out[bucket] = out.get(bucket, 0) + (1 if le == "+Inf" or wait <= float(le) else 0)
        for suffix, v in (("_sum", wait), ("_count", 1.0)):
            total: tuple[str, Labels] = (f"flowkube_feedback_wait_seconds{suffix}", hist)
            out[total] = out.get(total, 0) + v
    return out


def _family_of(sample: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if sample.startswith("flowkube_feedback_wait_seconds") and sample.endswith(suffix):
            return "flowkube_feedback_wait_seconds"
    return sample


_WAIT_SAMPLES = len(WAIT_BUCKETS) + 3  # the buckets, +Inf, _sum and _count


def flow_series_budget(label_values: int) -> int:
    """Most series one Flow adds with per-flow metrics: 8 per model (five token types, requests, cost,
    unpriced tokens) for at most ``label_values`` + 1 models (``other``), 5 triggers, 7 phases, turns."""
    return 8 * (label_values + 1) + len(_TRIGGERS) + len(_PHASES) + 1


def namespace_series_budget(label_values: int, per_flow: bool) -> int:
    """Most series a namespace adds besides its Flows' own, however many Flows it made and deleted:
    ``flowkube_namespace_cost_usd_total`` per (group, model), ``flowkube_flows`` per phase and the
    feedback histogram per definition; in rollup mode also the per-flow families without ``flow``."""
    groups = models = label_values + 1
    total = groups * models + len(_PHASES) + _WAIT_SAMPLES * groups
    if not per_flow:
        total += 8 * groups * models + (len(_TRIGGERS) + len(_PHASES) + 1) * groups
    return total



class FlowMetrics:
    def __init__(self, per_flow: bool = True, label_values: int = DEFAULT_LABEL_VALUES) -> None:
        self.per_flow = per_flow
        self.budget = LabelBudget(label_values)
        self._contrib: dict[Key, dict[tuple[str, Labels], float]] = {}
        self._chunks: dict[Key, dict[str, str]] = {}
        self._agg: dict[tuple[str, Labels], float] = defaultdict(float)
        self._refs: dict[tuple[str, Labels], int] = defaultdict(int)  # Flows contributing to each sample

    def __len__(self) -> int:
        return len(self._contrib)

    def update(self, key: Key, body: Body | None) -> None:
        new = contributions(body, self.budget) if body is not None else {}
        # Only the small aggregated part is kept as numbers; per-flow series are kept as text.
        agg = {k: v for k, v in new.items() if not self.per_flow or k[0] not in PER_FLOW}
        old = self._contrib.pop(key, {})
        if agg != old:
            for sample, v in old.items():
                k = self._rollup(sample)
                if body is None and sample[0] in ROLLUP_COUNTERS:
                    continue  # a rollup counter keeps a deleted Flow's tokens: it must never go down
                self._agg[k] -= v
                self._refs[k] -= 1
                if self._refs[k] <= 0:
                    del self._agg[k], self._refs[k]  # no Flow contributes: not exported, as after a restart
            for sample, v in agg.items():
                k = self._rollup(sample)
                self._agg[k] += v
                self._refs[k] += 1
        if body is None:
            self._chunks.pop(key, None)
            return
        self._contrib[key] = agg
        if self.per_flow:
            chunks: dict[str, list[str]] = defaultdict(list)
            for (name, labels), v in new.items():
                if name in PER_FLOW:
                    chunks[name].append(f"{name}{{{_fmt_labels(labels)}}} {_num(v)}\n")
            self._chunks[key] = {fam: "".join(lines) for fam, lines in chunks.items()}

    def _rollup(self, sample: tuple[str, Labels]) -> tuple[str, Labels]:
        name, labels = sample
        if name in PER_FLOW:
            labels = tuple(kv for kv in labels if kv[0] != "flow")
        return name, labels

    def snapshot(self) -> MetricsSnapshot:
        """What ``render`` needs, copied on the event loop that updates it, to render in a thread: the
        aggregates (a few hundred numbers per namespace) and the per-flow text, whose chunks ``update``
        replaces and never changes in place, so a shallow copy is enough."""
        return MetricsSnapshot(self.per_flow, dict(self._agg), list(self._chunks.values()) if self.per_flow else [])

    def render(self) -> str:
        return self.snapshot().render()

    def series(self) -> int:
        """How many series (samples) ``render`` exports: what the budget in docs/api.md bounds."""
        flows = sum(ch.count("\n") for chunks in self._chunks.values() for ch in chunks.values())
        namespaces = {dict(labels)["namespace"] for name, labels in self._agg if name == "flowkube_flows"}
        phases = {(name, labels) for name, labels in self._agg if name == "flowkube_flows"}
        return flows + len(self._agg) - len(phases) + len(namespaces) * len(_PHASES)


class MetricsSnapshot:
    """The samples of a ``FlowMetrics`` at one moment; ``render`` touches nothing else."""

    def __init__(self, per_flow: bool, agg: dict[tuple[str, Labels], float], chunks: list[dict[str, str]]) -> None:
        self.per_flow, self._agg, self._chunks = per_flow, agg, chunks

    def render(self) -> str:
        by_family: dict[str, list[str]] = defaultdict(list)
        samples = dict(self._agg)
        # Every phase of a namespace that has Flows, zeros included, so "0 Running" is a value.
        for ns in {dict(labels)["namespace"] for name, labels in self._agg if name == "flowkube_flows"}:
            for ph in Phase:
                samples.setdefault(("flowkube_flows", (("namespace", ns), ("phase", ph.value))), 0)
        for (sample, labels), v in sorted(samples.items()):
            by_family[_family_of(sample)].append(f"{sample}{{{_fmt_labels(labels)}}} {_num(v)}\n")
        parts: list[str] = []
        for fam, (mtype, help_text) in FAMILIES.items():
            parts.append(f"# HELP {fam} {help_text}\n# TYPE {fam} {mtype}\n")
            if self.per_flow and fam in PER_FLOW:
                parts.extend(ch.get(fam, "") for ch in self._chunks)
            parts.extend(by_family.get(fam, ()))
        return "".join(parts)
