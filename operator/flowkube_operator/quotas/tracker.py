"""Which FlowQuotas cover which Flows, the book they are kept in, and each quota's status (issue 41).
Pure: the caches hand it bodies (a quota's, a Flow's) as their watches see them; it does no I/O and
keeps only a bounded projection of each: a quota's parsed limits and selector, a Flow's labels and
the charges of its ended runs.

A Flow's ended runs are its source in the book (``flow:<uid>``); a running pod's settled calls are
the pod's (``run:<pod>``) until the Flow's status shows the run ended, and then the Flow's source,
which now holds them, replaces the pod's in the same step.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pydantic import ValidationError

from flowkube_api import selectors
from flowkube_api.models.quota import FlowQuotaSpec, LimitStatus, QuotaCondition
from flowkube_api.report import SpentSoFar
from flowkube_api.windows import resets_at, window_at
from flowkube_operator.quotas.book import Limit, QuotaBook, Refusal, Reservation, Spend, flow_charges, limits_of

Body = dict[str, Any]
DEFAULT_WARN_AT = 80


@dataclass(frozen=True)
class _Quota:
    name: str  # "FlowQuota <namespace>/<name>"
    namespace: str
    selector: selectors.Selector
    warn_at: tuple[int, ...]


def quota_name(namespace: str, name: str) -> str:
    return f"FlowQuota {namespace}/{name}"


class QuotaTracker:
    def __init__(self) -> None:
        self.book = QuotaBook()
        self._quotas: dict[str, _Quota] = {}
        self._flows: dict[tuple[str, str], tuple[str, dict[str, str]]] = {}  # (ns, name) -> (uid, labels)
        self._running: dict[str, str] = {}  # pod -> flow uid: pods whose settled calls are their own source

    # -- what the watches see ------------------------------------------------------------------------

    def quota_event(self, body: Body | None, namespace: str, name: str) -> str | None:
        """A FlowQuota seen (or gone: None). Returns why its spec cannot be used (None: it can)."""
        key = quota_name(namespace, name)
        if body is None:
            self._quotas.pop(key, None)
            self.book.set_limits(key, [])
            return None
        try:
            spec = FlowQuotaSpec.model_validate(body.get("spec") or {})
            selector = selectors.parse(spec.selector, "spec.selector")
        except (ValidationError, selectors.SelectorError) as e:
            self._quotas.pop(key, None)
            self.book.set_limits(key, [])
            return str(e)
        self._quotas[key] = _Quota(key, namespace, selector, tuple(spec.warn_at or (DEFAULT_WARN_AT,)))
        self.book.set_limits(key, limits_of(key, spec))
        for (ns, flow), (uid, _labels) in self._flows.items():
            if ns == namespace:
                self._cover_again(uid, self.covering(ns, flow))
        return None

    def flow_event(self, namespace: str, name: str, body: Body | None) -> None:
        """A Flow seen (or gone: None; a deleted Flow's charges stay in the book: they were spent)."""
        if body is None:
            self._flows.pop((namespace, name), None)
            return
        meta = body.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
        self._flows[(namespace, name)] = (uid, labels)
        status = body.get("status") or {}
        quotas = self.covering(namespace, name)
        self.book.set_source(f"flow:{uid}", quotas, flow_charges(status))
        for run in status.get("runs") or []:
            if isinstance(run, dict) and run.get("finishedAt") and run.get("pod") in self._running:
                pod = str(run["pod"])
                del self._running[pod]
                self.book.drop_source(f"run:{pod}")  # its calls are in the Flow's source now
                self.book.release(pod)

    def _cover_again(self, uid: str, quotas: list[str]) -> None:
        """A Flow whose covering quotas changed: its source again, under them."""
        source = f"flow:{uid}"
        charges = self.book.source_charges(source)
        self.book.set_source(source, quotas, charges)

    # -- the desk ------------------------------------------------------------------------------------

    def covering(self, namespace: str, flow: str) -> list[str]:
        """The quotas that cover a Flow: its namespace's whose selector matches its labels."""
        labels = self._flows.get((namespace, flow), ("", {}))[1]
        return sorted(q.name for q in self._quotas.values() if q.namespace == namespace and q.selector.matches(labels))

    def reserve(self, namespace: str, flow: str, pod: str, model: str, worst: Spend,
                now: dt.datetime, *, priced: bool = True) -> Reservation | Refusal:
        self._running.setdefault(pod, self._flows.get((namespace, flow), ("", {}))[0])
        return self.book.reserve(self.covering(namespace, flow), pod, model, worst, now, priced=priced)

    def settle(self, pod: str, reservation: int, charges: list[tuple[dt.datetime, str, Spend]]) -> bool:
        return self.book.settle(reservation, pod, charges)

    # -- status --------------------------------------------------------------------------------------

    def status(self, namespace: str, name: str, now: dt.datetime) -> tuple[list[LimitStatus], list[QuotaCondition]]:
        """The quota's ``status.limits`` and conditions as of ``now``."""
        key = quota_name(namespace, name)
        quota = self._quotas.get(key)
        out, exhausted, warned = [], [], []
        for limit in self.book.limits(key):
            used, reserved = self.book.used(limit.key, now), self.book.reserved(limit.key)
            window = window_at(limit.window, now)
            out.append(LimitStatus(name=limit.name, used=SpentSoFar(total_tokens=used.tokens, cost=used.cost),
                                   reserved=SpentSoFar(total_tokens=reserved.tokens, cost=reserved.cost),
                                   window_start=window.start, resets_at=resets_at(limit.window, now)))
            share = _share(limit, used)
            if share >= 100:
                exhausted.append(f"{limit.name} at {share:.0f}%")
            elif quota is not None and share >= min(quota.warn_at):
                warned.append(f"{limit.name} at {share:.0f}%")
        conditions = [
            QuotaCondition(type="Exhausted", status="True" if exhausted else "False",
                           reason="LimitReached" if exhausted else "WithinLimits",
                           message="; ".join(exhausted), last_transition_time=now),
            QuotaCondition(type="Warning", status="True" if warned else "False",
                           reason="NearLimit" if warned else "WithinLimits",
                           message="; ".join(warned), last_transition_time=now),
        ]
        return out, conditions


def _share(limit: Limit, used: Spend) -> float:
    """How much of the limit is used, in percent (the larger of its token and cost shares)."""
    shares = []
    if limit.max_tokens:
        shares.append(100.0 * used.tokens / limit.max_tokens)
    if limit.max_cost:
        shares.append(float(Decimal(100) * used.cost / limit.max_cost))
    return max(shares, default=0.0)

