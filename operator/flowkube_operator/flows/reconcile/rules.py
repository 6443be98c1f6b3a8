"""The rules and arithmetic of runs: which failures are final, which are disruptions, the budget,
the time a flow ran, retry backoff. Pure functions of the status; the steps call them."""

from __future__ import annotations

import datetime as dt
from typing import Any

from flowkube_api.constants import Reason, RunResult, Trigger
from flowkube_api.models import (
    FlowSpec,
    Run,
)
from flowkube_api.report import Usage

Body = dict[str, Any]


# A run that failed for one of these reasons is not retried: running it again cannot help.
PERMANENT_REASONS = frozenset({
    Reason.INVALID_DEFINITION, Reason.INVALID_FLOW_REF, Reason.INVALID_INPUTS, Reason.INVALID_SPEC,
    Reason.INVALID_IMAGE_NAME,
    Reason.STATE_CORRUPT,
    Reason.STATE_TOO_LARGE, Reason.BUDGET_EXCEEDED, Reason.DEADLINE_EXCEEDED, Reason.QUOTA_EXHAUSTED,
})

# A run that ended for one of these reasons was taken away by Kubernetes or by someone else, not
# failed by the flow: it is replaced at once, counted against retries.disruptionLimit, not limit.
DISRUPTION_REASONS = frozenset({Reason.DISRUPTED, Reason.POD_DELETED})

# Run reports kept in the state ConfigMap: every REPORTS_KEPT-th run drops the reports of the
# REPORTS_KEPT runs before the last REPORTS_KEPT (their usage is in status.runs[]), so a long
# conversation, one run per message, stays under a ConfigMap's 1 MiB.
REPORTS_KEPT = 20

# Runs whose pod is created before the status write that records them: everything they carry is
# durable already (a resume or a turn takes an answer or a message out of an inbox: recorded first).
POD_FIRST_TRIGGERS = frozenset({Trigger.KICKOFF, Trigger.RETRY, Trigger.FORK})

# How long a pod stopped at the deadline gets to be gone before its run is ended anyway (a node that
# is down never confirms the deletion). Pods are deleted with their default 30 s grace period.
STOP_GRACE_SECONDS = 60.0


def _more(reported: Usage, counted: Usage) -> bool:
    """A run's reports are cumulative: is this one further along than what its entry counts?"""
    return (reported.successful_requests, reported.total_tokens) > (counted.successful_requests,
                                                                    counted.total_tokens)


def total_usage(runs: list[Run]) -> Usage:
    total = Usage()
    for r in runs:
        if r.usage is not None:
            total = total + r.usage
    return total


def budget_spent(spec: FlowSpec, usage: Usage) -> str | None:
    """Why no further run may start (the budget is used up), naming the figure; None while it is not."""
    budget = spec.budget  # one rule with the runner's (Budget.exceeded_by): once reached, no run starts
    if budget is None or (limit := budget.exceeded_by(usage.total_tokens, usage.cost)) is None:
        return None
    return budget.figure(limit, usage.total_tokens, usage.cost)


def running_seconds(runs: list[Run], now: dt.datetime) -> float:
    """Time runner pods existed: waiting for feedback, in retry backoff, or warm for a message does not count."""
    spent = 0.0
    for r in runs:
        start = r.started_at
        if start is not None:
            spent += ((r.finished_at or now) - start).total_seconds() - (r.warm_seconds or 0.0)
    return spent


def trailing_failures(runs: list[Run]) -> int:
    """Failed runs since the last one that did not fail; disruptions and runs a Queue quota stopped
    for room (the Flow waited, then went on) are not the flow's failures."""
    n = 0
    for r in reversed(runs):
        if r.result == RunResult.FAILED and r.reason in (*DISRUPTION_REASONS, Reason.QUOTA_EXHAUSTED):
            continue
        if r.result != RunResult.FAILED:
            break
        n += 1
    return n


def backoff_seconds(spec: FlowSpec, failures: int, cap: int) -> float:
    base = spec.retries.backoff_seconds if spec.retries else 10
    return float(min(cap, base * (2 ** max(failures - 1, 0))))
