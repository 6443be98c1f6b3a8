"""Which FlowQuotas cover which Flows, the book they are kept in, and each quota's status (issue 41).
Pure: the caches hand it bodies (a quota's, a Flow's) as their watches see them; it does no I/O and
keeps only a bounded projection of each: a quota's parsed limits and selector (at most
``QUOTAS_PER_NAMESPACE_LIMIT`` used per namespace, the rest only named), a Flow's uid, the labels
quota selectors name and the charges of its ended runs.

A Flow's ended runs are its source in the book (``flow:<uid>``); a running pod's settled calls are
the pod's (``run:<namespace>/<pod>``) until the Flow's status shows the run ended, and then the
Flow's source, which now holds them, replaces the pod's in the same step.

Coverage is sticky against a Flow's labels: a Flow stays under every quota that covered it while it
exists, so relabelling a Flow moves none of its spend out of a quota (it can only add a quota). A
quota's own spec, changed, decides its coverage afresh: that is its owner's act.
"""

from __future__ import annotations

import datetime as dt
from collections import OrderedDict
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pydantic import ValidationError

from flowkube_api import constants as c
from flowkube_api import selectors
from flowkube_api.base import money_text
from flowkube_api.models.quota import (
    RETIRED_LIMIT,
    ClusterFlowQuotaSpec,
    FlowQuotaSpec,
    LimitStatus,
    QuotaCondition,
)
from flowkube_api.report import SpentSoFar
from flowkube_api.windows import bucket_of, resets_at, window_at
from flowkube_operator.quotas.book import (
    Charges,
    Limit,
    QuotaBook,
    Refusal,
    Reservation,
    Spend,
    by_slot,
    flow_charges,
    limits_of,
    parse_charges,
)

Body = dict[str, Any]
DEFAULT_WARN_AT = 80
ENDED_KEPT = 4096  # pods whose runs ended lately: a late word from one charges nothing twice
SHORT_KEPT = 4096  # Flows whose last call a Queue quota refused for room: each waits for that much


@dataclass(frozen=True)
class _Quota:
    name: str  # "FlowQuota <namespace>/<name>", or "ClusterFlowQuota <name>"
    namespace: str  # "" for a ClusterFlowQuota
    selector: selectors.Selector
    warn_at: tuple[int, ...]
    created: str  # creationTimestamp: a namespace's first QUOTAS_PER_NAMESPACE_LIMIT are used
    action: str = "Refuse"  # a new Flow while a limit is exhausted: Refuse (at apply) or Queue
    short: str = ""  # its metadata.name
    namespaces: selectors.Selector | None = None  # a ClusterFlowQuota's namespaceSelector

    def covers(self, namespace: str, flow_labels: dict[str, str], namespace_labels: dict[str, str]) -> bool:
        if self.namespaces is None:
            return self.namespace == namespace and self.selector.matches(flow_labels)
        return self.namespaces.matches(namespace_labels) and self.selector.matches(flow_labels)


@dataclass
class _Flow:
    uid: str
    labels: dict[str, str]  # only the keys some quota's selector names
    quotas: frozenset[str]  # every quota that has covered it (sticky: see the module's docstring)


def _holder(namespace: str, pod: str, flow_uid: str) -> str:
    return f"{namespace}/{pod}/{flow_uid}"


def quota_name(namespace: str, name: str) -> str:
    """How messages and the book name a quota: a FlowQuota by namespace and name, a ClusterFlowQuota
    (namespace "") by name."""
    return f"FlowQuota {namespace}/{name}" if namespace else f"ClusterFlowQuota {name}"


class QuotaTracker:
    def __init__(self) -> None:
        self.book = QuotaBook()
        self._quotas: dict[str, _Quota] = {}
        self._waiting: dict[str, tuple[str, str]] = {}  # over a namespace's limit: key -> (created, name)
        self._flows: dict[tuple[str, str], _Flow] = {}
        self._running: dict[str, str] = {}  # "<namespace>/<pod>" -> flow uid: pods whose settled calls are theirs
        self._ended: OrderedDict[str, None] = OrderedDict()  # holders whose runs are in their Flow's status
        self._active: dict[tuple[str, str], str] = {}  # a covered Flow -> the pod of its run going on
        self._namespace_labels: dict[str, dict[str, str]] = {}  # only the keys namespaceSelectors name
        # Per quota, what its deleted Flows had charged (status.retired): (quarter hour, model) -> spend.
        self._retired: dict[str, dict[tuple[dt.datetime, str], Spend]] = {}
        # A Flow whose call an ``action: Queue`` quota refused for lack of room: (limit, that call's
        # worst case). Its next run waits until the limit has that much room (the used-up check alone
        # would start it again at once, to be refused at the same call).
        self._short: OrderedDict[tuple[str, str], tuple[tuple[str, str], Spend]] = OrderedDict()

    # -- what the watches see ------------------------------------------------------------------------

    def label_keys(self) -> frozenset[str]:
        """The label keys any quota selector names."""
        return frozenset(r.key for q in self._quotas.values() for r in q.selector.requirements)

    def label_keys_for(self, namespace: str) -> frozenset[str]:
        """The label keys of a Flow in ``namespace`` anything keeps: those its namespace's quotas and the
        ClusterFlowQuotas name (at most twice QUOTA_LABEL_KEYS_LIMIT)."""
        return frozenset(r.key for q in self._quotas.values() if q.namespace in (namespace, "")
                         for r in q.selector.requirements)

    def namespace_keys(self) -> frozenset[str]:
        """The label keys ClusterFlowQuota namespaceSelectors name: the only labels of a namespace kept."""
        return frozenset(r.key for q in self._quotas.values() if q.namespaces is not None
                         for r in q.namespaces.requirements)

    def namespace_event(self, namespace: str, labels: dict[str, str] | None) -> None:
        """A namespace seen (or gone: None): its labels decide which ClusterFlowQuotas cover its Flows."""
        keys = self.namespace_keys()
        kept = {k: v for k, v in (labels or {}).items() if k in keys}
        if labels is None:
            self._namespace_labels.pop(namespace, None)
        elif self._namespace_labels.get(namespace) != kept:
            self._namespace_labels[namespace] = kept
        else:
            return
        cluster = [q for q in self._quotas.values() if q.namespaces is not None]
        for (ns, _flow), f in self._flows.items():
            if ns == namespace and cluster:  # decided afresh: a namespace's labels are its admins'
                self._cover(f, {k for k in f.quotas if k not in {q.name for q in cluster}}
                            | {q.name for q in cluster if q.covers(ns, f.labels, kept)})

    def quota_event(self, body: Body | None, namespace: str, name: str) -> str | None:
        """A FlowQuota seen (or gone: None). Returns why it is not used (None: it is)."""
        key = quota_name(namespace, name)
        if body is None:
            self._waiting.pop(key, None)
            self._drop(key)
            self._retired.pop(key, None)
            self.book.drop_source(f"retired:{key}")
            return None
        # What its deleted Flows charged, as its status says: a floor, on every event. A restart reads it
        # back; a follower takes what the leader added (a Flow deleted mid-run: its pods' settled calls
        # are only in the leader's book), so after a failover it writes no less.
        self._floor_retired(key, parse_charges((body.get("status") or {}).get("retired")))
        created = str((body.get("metadata") or {}).get("creationTimestamp") or "")
        cluster = not namespace
        try:
            spec: FlowQuotaSpec = (ClusterFlowQuotaSpec if cluster else FlowQuotaSpec).model_validate(
                body.get("spec") or {})
            selector = selectors.parse(spec.selector, "spec.selector")
            namespaces = selectors.parse(getattr(spec, "namespace_selector", None),
                                         "spec.namespaceSelector") if cluster else None
        except (ValidationError, selectors.SelectorError) as e:
            self._drop(key)
            return str(e)
        old = self._quotas.get(key)
        if old is None and self._full(namespace) and not self._displaces(namespace, created, name):
            self._waiting[key] = (created, name)
            where = "the cluster has" if cluster else f"namespace {namespace} has"
            return (f"{where} {self._room(namespace)} {'ClusterFlowQuotas' if cluster else 'FlowQuotas'} "
                    "already: this one is used once an older one is deleted")
        why = self._keys_problem(key, namespace, selector, namespaces)
        if why is not None:
            if old is not None:
                return why + "; the quota's earlier spec stays in force"
            self._waiting.pop(key, None)
            return why
        self._waiting.pop(key, None)
        quota = self._quotas[key] = _Quota(key, namespace, selector, tuple(spec.warn_at or (DEFAULT_WARN_AT,)),
                                           created, spec.action, name, namespaces)
        self.book.set_limits(key, limits_of(key, spec))
        if old is not None and old.selector == selector and old.namespaces == namespaces:
            return None  # the same coverage (its own status written, a relist, a limit changed): nothing to redo
        for (ns, _flow), f in self._flows.items():
            if cluster or ns == namespace:  # the quota's selector changed: its coverage decided afresh
                covered = quota.covers(ns, f.labels, self._namespace_labels.get(ns, {}))
                self._cover(f, (f.quotas - {key}) | ({key} if covered else set()))
        return None

    def _displaces(self, namespace: str, created: str, name: str) -> bool:
        """A quota older than the youngest in use in a full scope takes its place (the youngest waits):
        which quotas are used does not depend on the order a list delivers them in."""
        youngest = max((q for q in self._quotas.values() if q.namespace == namespace),
                       key=lambda q: (q.created, q.short))
        if (created, name) >= (youngest.created, youngest.short):
            return False
        self._drop(youngest.name)
        self._waiting[youngest.name] = (youngest.created, youngest.short)
        return True

    def _keys_problem(self, key: str, namespace: str, selector: selectors.Selector,
                      namespaces: selectors.Selector | None) -> str | None:
        """Why a quota's selectors would name too many label keys (its scope's, with the others')."""
        others = [q for q in self._quotas.values() if q.namespace == namespace and q.name != key]
        keys = {r.key for q in others for r in q.selector.requirements} | {r.key for r in selector.requirements}
        spaces = ({r.key for q in others if q.namespaces is not None for r in q.namespaces.requirements}
                  | {r.key for r in namespaces.requirements}) if namespaces is not None else set()
        if len(keys) <= c.QUOTA_LABEL_KEYS_LIMIT and len(spaces) <= c.QUOTA_LABEL_KEYS_LIMIT:
            return None
        where = "the ClusterFlowQuotas" if not namespace else f"namespace {namespace}'s quotas"
        return (f"spec.selector: {where} may name at most {c.QUOTA_LABEL_KEYS_LIMIT} label keys together "
                f"({'of Flows, and of namespaces' if not namespace else 'of Flows'}), and this one would make more")

    def _room(self, namespace: str) -> int:
        return c.CLUSTER_QUOTAS_LIMIT if not namespace else c.QUOTAS_PER_NAMESPACE_LIMIT

    def _full(self, namespace: str) -> bool:
        return sum(q.namespace == namespace for q in self._quotas.values()) >= self._room(namespace)

    def next_waiting(self, namespace: str) -> str | None:
        """The name of the oldest FlowQuota of ``namespace`` waiting for a free place, if one is free."""
        if self._full(namespace):
            return None
        prefix = quota_name(namespace, "")
        waiting = sorted(v for k, v in self._waiting.items() if k.startswith(prefix))
        return waiting[0][1] if waiting else None

    def _drop(self, key: str) -> None:
        if self._quotas.pop(key, None) is None:
            return
        self.book.set_limits(key, [])
        for f in self._flows.values():
            if key in f.quotas:
                self._cover(f, f.quotas - {key})

    def flow_event(self, namespace: str, name: str, body: Body | None) -> None:
        """A Flow seen (or gone: None; a deleted Flow's charges stay in the book: they were spent)."""
        if body is None:
            gone = self._flows.pop((namespace, name), None)
            self._active.pop((namespace, name), None)
            self._short.pop((namespace, name), None)
            if gone is not None:
                self._retire(gone)
            return
        meta = body.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        keys = self.label_keys_for(namespace)
        labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items() if k in keys}
        known = self._flows.get((namespace, name))
        sticky = known.quotas if known is not None and known.uid == uid else frozenset()
        spaces = self._namespace_labels.get(namespace, {})
        matched = {q.name for q in self._quotas.values() if q.covers(namespace, labels, spaces)}
        f = self._flows[(namespace, name)] = _Flow(uid, labels, sticky | matched)
        status = body.get("status") or {}
        self.book.set_source(f"flow:{uid}", sorted(f.quotas), flow_charges(status))
        self._active.pop((namespace, name), None)
        for run in status.get("runs") or []:
            if not isinstance(run, dict) or not run.get("pod"):
                continue
            holder = _holder(namespace, str(run["pod"]), uid)
            if not run.get("finishedAt"):
                if f.quotas:
                    self._active[(namespace, name)] = str(run["pod"])
                continue
            if holder in self._ended:
                continue
            self._ended[holder] = None  # a word from its pod after this is late: counted from the status
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
            if self._running.pop(holder, None) is not None:
                self.book.drop_source(f"run:{holder}")  # its calls are in the Flow's source now
                self.book.release(holder)

    def _retire(self, f: _Flow) -> None:
        """A deleted Flow: what it charged (its ended runs, and the calls its pods settled) moves into
        each covering quota's retired charges, which its status keeps, in one step; its pods'
        reservations are freed (the pods go with it)."""
        source = f"flow:{f.uid}"
        charges = self.book.source_charges(source)
        self.book.drop_source(source)
        for holder in [h for h, uid in self._running.items() if uid == f.uid]:
            charges += self.book.source_charges(f"run:{holder}")
            self.book.drop_source(f"run:{holder}")
            self.book.release(holder)
            del self._running[holder]
        for quota in f.quotas & self._quotas.keys():
            self._add_retired(quota, charges)

    def _floor_retired(self, quota: str, charges: Charges) -> None:
        """Each (quarter hour, model) of ``charges`` (a status.retired) at least as ``charges`` says:
        the larger of the two per figure, so a status seen again (the leader's own write, echoed)
        counts nothing twice. (A slot the leader merged into a later one past RETIRED_LIMIT may then
        count in both: spend counted twice, never missed.)"""
        kept = self._retired.setdefault(quota, {})
        raised = {}
        for slot, spend in by_slot(charges).items():
            have = kept.get(slot, Spend())
            top = Spend(max(spend.tokens, have.tokens), max(spend.cost, have.cost))
            if top != have:
                raised[slot] = top
        if raised:
            kept.update(raised)
            self._add_retired(quota, [])

    def _add_retired(self, quota: str, charges: Charges) -> None:
        kept = self._retired.setdefault(quota, {})
        for at, model, spend in charges:
            slot = (bucket_of(at), model)
            kept[slot] = kept.get(slot, Spend()) + spend
        while len(kept) > RETIRED_LIMIT:  # a model's oldest quarter hour into its next: counted later, never early
            by_model: dict[str, list[dt.datetime]] = {}
            for at, model in kept:
                by_model.setdefault(model, []).append(at)
            model, times = max(by_model.items(), key=lambda kv: len(kv[1]))
            if len(times) < 2:
                break
            first, second = sorted(times)[:2]
            kept[(second, model)] = kept[(second, model)] + kept.pop((first, model))
        self.book.set_source(f"retired:{quota}", [quota], [(at, m, sp) for (at, m), sp in kept.items()])

    def retired(self, quota: str) -> list[Body]:
        """A quota's status.retired: its deleted Flows' charges, oldest first."""
        return [{"at": at.isoformat().replace("+00:00", "Z"), "model": model, "totalTokens": spend.tokens,
                 "cost": money_text(spend.cost)}
                for (at, model), spend in sorted(self._retired.get(quota, {}).items()) if spend != Spend()]

    def _cover(self, f: _Flow, quotas: frozenset[str] | set[str]) -> None:
        """A Flow whose covering quotas changed: its source again, under them."""
        f.quotas = frozenset(quotas)
        source = f"flow:{f.uid}"
        self.book.set_source(source, sorted(f.quotas), self.book.source_charges(source))

    # -- the desk ------------------------------------------------------------------------------------

    def covering(self, namespace: str, flow: str) -> list[str]:
        """The quotas that cover a Flow (its namespace's whose selector matches it, or once did)."""
        f = self._flows.get((namespace, flow))
        return sorted(f.quotas & self._quotas.keys()) if f is not None else []

    def _run_holder(self, namespace: str, flow: str, pod: str) -> str:
        """How the book names a run: its pod, of this Flow (a Flow made again under the same name has
        pods of the same names, and other runs)."""
        f = self._flows.get((namespace, flow))
        return _holder(namespace, pod, f.uid if f is not None else "")

    def reserve(self, namespace: str, flow: str, pod: str, model: str, worst: Spend,
                now: dt.datetime, *, priced: bool = True) -> Reservation | Refusal | None:
        """A reservation (None: no quota covers the Flow, nothing to reserve)."""
        quotas = self.covering(namespace, flow)
        if not quotas:
            return None
        holder = self._run_holder(namespace, flow, pod)
        f = self._flows.get((namespace, flow))
        self._running.setdefault(holder, f.uid if f is not None else "")
        outcome = self.book.reserve(quotas, holder, model, worst, now, priced=priced)
        if not isinstance(outcome, Refusal):
            self._short.pop((namespace, flow), None)
        elif outcome.reason is None and outcome.unpriced is None and (
                (q := self._quotas.get(outcome.limit.quota)) is not None and q.action == "Queue"):
            self._short[(namespace, flow)] = (outcome.limit.key, outcome.needed)
            self._short.move_to_end((namespace, flow))
            while len(self._short) > SHORT_KEPT:
                self._short.popitem(last=False)
        return outcome

    def settle(self, namespace: str, flow: str, pod: str, reservation: int, charges: Charges) -> bool:
        holder = self._run_holder(namespace, flow, pod)
        if holder in self._ended:  # late: its run's calls are counted from its Flow's status already
            return self.book.free(reservation, holder)
        quotas = self.covering(namespace, flow)
        if not quotas and holder not in self._running:
            # Nothing of this Flow is in the book: no source for a pod no quota covers; its id is
            # remembered as freed all the same (an older held list must not take it again).
            return self.book.free(reservation, holder)
        return self.book.settle(reservation, holder, charges, quotas)

    def adopt(self, namespace: str, flow: str, pod: str, charges: Charges | None,
              held: list[tuple[int, str, Spend]]) -> int:
        """What a running pod says it has: its charges so far and the reservations it holds (each
        ``(id, model, worst)``); a reservation this book does not know (made with another leader) is
        taken again. How many were."""
        holder = self._run_holder(namespace, flow, pod)
        quotas = self.covering(namespace, flow)
        if holder in self._ended or not quotas:
            return 0
        f = self._flows.get((namespace, flow))
        self._running.setdefault(holder, f.uid if f is not None else "")
        if charges is not None:
            self.book.run_charges(holder, quotas, charges)
        return sum(self.book.restore(rid, holder, model, spend, quotas) for rid, model, spend in held)

    def flow_uid(self, namespace: str, flow: str) -> str:
        f = self._flows.get((namespace, flow))
        return f.uid if f is not None else ""

    def active(self) -> list[tuple[str, str, str]]:
        """(namespace, flow, pod) of each covered Flow's run going on."""
        return [(ns, flow, pod) for (ns, flow), pod in self._active.items()]

    def exhausted(self, namespace: str, flow: str, now: dt.datetime) -> str | None:
        """Why the Flow may start no run now: a limit of a quota covering it is used up, or an
        ``action: Queue`` quota refused its last call and has not the room for it yet (None: neither)."""
        used_up = self._used_up(self.covering(namespace, flow), now)
        if used_up is not None or (short := self._short.get((namespace, flow))) is None:
            return used_up
        key, needed = short
        limit = next((lim for lim in self.book.limits(key[0]) if lim.key == key), None)
        if limit is None:  # the limit is gone (or changed): nothing to wait for
            self._short.pop((namespace, flow), None)
            return None
        used, reserved = self.book.used(key, now), self.book.reserved(key)
        if limit.fits(used + reserved + needed):
            return None
        waiting = Refusal(limit, used, reserved, needed, resets_at(limit.window, now)).message()
        return f"{waiting}: the Flow waits for that room (spec.action: Queue)"

    def refuses(self, namespace: str, labels: dict[str, str], now: dt.datetime) -> str | None:
        """Why a new Flow with these labels is refused at apply: a quota that would cover it, with
        ``action: Refuse``, has a limit used up (None: it is admitted; a ``Queue`` quota holds it)."""
        spaces = self._namespace_labels.get(namespace, {})
        quotas = sorted(q.name for q in self._quotas.values()
                        if q.action == "Refuse" and q.covers(namespace, labels, spaces))
        why = self._used_up(quotas, now)
        return f"{why}; it refuses new Flows until then (spec.action: Refuse)" if why else None

    def _used_up(self, quotas: list[str], now: dt.datetime) -> str | None:
        for quota in quotas:
            for limit in self.book.limits(quota):
                used = self.book.used(limit.key, now)
                if _share(limit, used) >= 100:
                    return exhausted_message(limit, used, now)
        return None

    # -- status --------------------------------------------------------------------------------------

    def quotas(self) -> list[tuple[str, str]]:
        """(namespace, name) of every quota in use."""
        return [(q.namespace, q.short) for q in self._quotas.values()]

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

    def summary(self, namespace: str, name: str, now: dt.datetime) -> str:
        """Each limit's share used ("daily 42%, monthly 7%"), for the printer column."""
        key = quota_name(namespace, name)
        limits = self.book.limits(key)
        return ", ".join(f"{lim.name} {_share(lim, self.book.used(lim.key, now)):.0f}%" for lim in limits)


def _share(limit: Limit, used: Spend) -> float:
    """How much of the limit is used, in percent (the larger of its token and cost shares)."""
    shares = []
    if limit.max_tokens:
        shares.append(100.0 * used.tokens / limit.max_tokens)
    if limit.max_cost:
        shares.append(float(Decimal(100) * used.cost / limit.max_cost))
    return max(shares, default=0.0)


def exhausted_message(limit: Limit, used: Spend, now: dt.datetime) -> str:
    """A used-up limit, named with its use and when it resets (the Flow's message and the refusal at apply)."""
    what = (f"USD {money_text(used.cost)} used of {money_text(limit.max_cost)}" if limit.max_cost is not None
            and used.cost >= limit.max_cost else f"{used.tokens} tokens used of {limit.max_tokens}")
    resets = resets_at(limit.window, now)
    if resets is not None:
        when = f"; the window resets at {resets.isoformat()}"
    elif limit.window.kind == "Rolling":
        when = "; charges leave the window as it rolls on"
    else:
        when = "; it never resets (raise the limit to go on)"
    return f"{limit.describe()} is exhausted: {what}{when}"
