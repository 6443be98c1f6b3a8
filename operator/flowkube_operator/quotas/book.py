"""The spend of each quota limit, and the reservations that keep it from being overspent (issue 41).
Pure: no I/O, no clock of its own (every call says when it is).

A limit (a FlowQuota's ``limits[]`` entry) caps the tokens or the cost (USD) of the model calls of the
Flows it covers, optionally of one model, over a window (``flowkube_api.windows``). The book keeps,
per limit:

- what is **used**: the settled calls, by the quarter-hour bucket they were made in, so a window counts
  exactly the calls made within it (a bucket lies wholly inside or outside every calendar window);
- what is **reserved**: the worst case of each call in flight (its prompt as counted plus the
  ``max_tokens`` it may answer, priced), by reservation.

``reserve`` checks and takes in one step: a call is let go only if, for every limit that covers it,
used in the current window + reserved + its worst case stays within the limit. So however many calls
start at once, their sum never passes a limit, provided each answers within its worst case. ``settle``
then takes the run's charges so far (what its calls really used, by quarter hour) and frees the
reservation;
``release`` frees every reservation of a run that ended (its pod lost mid-call: the call's real
usage, if it was answered, comes with the run's report). Once the ended run is in its Flow's status,
the Flow's source (its runs' charges, ``status.runs[].charges``) replaces the run's, in one step. A
refusal names the quota, the limit, the use, what the call needed and when the window resets.
"""

from __future__ import annotations

import datetime as dt
import itertools
import secrets
from collections import OrderedDict, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from pydantic import ValidationError

from flowkube_api.base import money_text, parse_time
from flowkube_api.models.quota import FlowQuotaSpec
from flowkube_api.report import Charge, Usage
from flowkube_api.windows import Window, WindowSpec, bucket_of, resets_at, window_at


@dataclass(frozen=True)
class Spend:
    tokens: int = 0
    cost: Decimal = Decimal(0)

    def __add__(self, other: Spend) -> Spend:
        return Spend(self.tokens + other.tokens, self.cost + other.cost)

    def __sub__(self, other: Spend) -> Spend:
        return Spend(self.tokens - other.tokens, self.cost - other.cost)


def by_slot(charges: Charges) -> dict[tuple[dt.datetime, str], Spend]:
    """Charges summed by (quarter hour, model)."""
    out: dict[tuple[dt.datetime, str], Spend] = {}
    for at, model, spend in charges:
        slot = (bucket_of(at), model)
        out[slot] = out.get(slot, Spend()) + spend
    return out


@dataclass(frozen=True)
class Limit:
    """One limit of one quota: ``quota`` names it where messages and status show it
    (``FlowQuota team-a/monthly``), ``name`` is the limit's own."""

    quota: str
    name: str
    window: WindowSpec
    max_tokens: int | None = None
    max_cost: Decimal | None = None
    model: str | None = None  # only this model's calls count (None: every model's)

    @property
    def key(self) -> tuple[str, str]:
        return self.quota, self.name

    def covers(self, model: str) -> bool:
        return self.model is None or self.model == model

    def fits(self, spend: Spend) -> bool:
        return ((self.max_tokens is None or spend.tokens <= self.max_tokens)
                and (self.max_cost is None or spend.cost <= self.max_cost))

    def describe(self) -> str:
        caps = [f"maxTotalTokens={self.max_tokens}"] if self.max_tokens is not None else []
        caps += [f"maxCost=USD {money_text(self.max_cost)}"] if self.max_cost is not None else []
        scope = f" of model {self.model}" if self.model else ""
        if self.window.kind == "Lifetime":
            where = "lifetime"
        elif self.window.kind == "Rolling":
            where = f"rolling {self.window.hours} h"
        else:
            where = f"per {self.window.kind.lower()} in {self.window.time_zone}"
        return f"{self.quota}: limit {self.name} ({', '.join(caps)}{scope}, {where})"


def limits_of(quota: str, spec: FlowQuotaSpec) -> list[Limit]:
    """The book's limits of a FlowQuota's (or ClusterFlowQuota's) validated spec."""
    return [Limit(quota, lim.name, lim.window.spec(), max_tokens=lim.max_total_tokens, max_cost=lim.max_cost,
                  model=lim.model) for lim in spec.limits]


@dataclass(frozen=True)
class Refusal:
    limit: Limit
    used: Spend
    reserved: Spend
    needed: Spend
    resets: dt.datetime | None
    unpriced: str | None = None  # the model with no price a cost limit cannot bound
    reason: str | None = None  # refused for another reason than the limit's room

    def message(self) -> str:
        if self.reason is not None:
            return f"{self.limit.quota}: {self.reason}"
        if self.unpriced is not None:
            return (f"{self.limit.describe()}: model {self.unpriced} has no price, so this limit cannot bound "
                    "its calls (price it in the operator's FLOWKUBE_PRICES)")
        total = self.used + self.reserved + self.needed
        if self.limit.max_cost is not None and total.cost > self.limit.max_cost:
            what = (f"USD {money_text(self.used.cost)} used + USD {money_text(self.reserved.cost)} reserved by "
                    f"calls in flight, and this call may cost up to USD {money_text(self.needed.cost)}")
        else:
            what = (f"{self.used.tokens} tokens used + {self.reserved.tokens} reserved by calls in flight, and this "
                    f"call may use up to {self.needed.tokens}")
        if self.resets is not None:
            when = f"; the window resets at {self.resets.isoformat()}"
        elif self.limit.window.kind == "Rolling":
            when = "; charges leave the window as it rolls on"
        else:
            when = "; it never resets"
        return f"{self.limit.describe()}: {what}{when}"


@dataclass
class Reservation:
    id: int
    holder: str  # the run (its pod) that made it
    model: str
    spend: Spend
    limits: tuple[tuple[str, str], ...]
    quotas: tuple[str, ...]


@dataclass
class _Account:
    limit: Limit
    buckets: dict[dt.datetime, Spend] = field(default_factory=dict)
    reserved: Spend = Spend()
    # The window last asked about and its total, kept current as charges come and go: a reservation
    # costs O(1) per limit, and the buckets are added up again only when the window moves on (a
    # calendar window once per window, a rolling one once per quarter hour).
    window: Window | None = None
    total: Spend = Spend()


Charges = list[tuple[dt.datetime, str, Spend]]  # (when, model, spend)
FREED_KEPT = 65536  # freed reservation ids remembered (a held list is at most a few requests old)
HELD_PER_RUN = 64  # reservations one run holds at once (its parallel calls)


def parse_charges(entries: Any) -> Charges:
    """Charges as a status holds them (``[{at, model, totalTokens, cost}]``); an entry that is not one
    is left out."""
    out: Charges = []
    for c in entries if isinstance(entries, list) else []:
        try:
            charge = Charge.model_validate(c)
        except ValidationError:
            continue
        out.append((charge.at, charge.model, Spend(charge.total_tokens, charge.cost)))
    return out


def flow_charges(status: Mapping[str, Any]) -> Charges:
    """What a Flow's ended runs charged, from its status: each run's ``charges`` (by quarter hour and
    model), or, for a run without them (an older operator's, or a report that only reached the
    termination message), its usage by model at the time it ended. A run still going is not here:
    its pod's settled calls are (``QuotaBook.settle``)."""
    out: Charges = []
    for run in status.get("runs") or []:
        if not isinstance(run, dict) or not run.get("finishedAt"):
            continue
        charges = run.get("charges")
        if isinstance(charges, list) and charges:
            out += parse_charges(charges)
            continue
        usage = Usage.read(run.get("usage"))
        ended = parse_time(run.get("finishedAt"))
        if ended is None or not usage.total_tokens:
            continue
        models = usage.by_model or {"unknown": usage}
        out += [(ended, model, Spend(u.total_tokens, u.cost)) for model, u in models.items()]
    return out


class QuotaBook:
    """Every limit's account, fed by *sources*: a Flow (the charges of its ended runs, from its status;
    a deleted Flow's stay), and a running pod (the calls it settled, until its run is folded into
    its Flow's status). Each source says which quotas cover it."""

    def __init__(self) -> None:
        self._accounts: dict[tuple[str, str], _Account] = {}
        self._sources: dict[str, tuple[frozenset[str], Charges]] = {}
        self._reservations: dict[int, Reservation] = {}
        self._by_holder: dict[str, set[int]] = defaultdict(set)
        # Random ids: a settle a pod sends to a new leader names no reservation of another pod.
        self._ids = (secrets.randbits(52) + 1 for _ in itertools.count())  # exact in JSON numbers
        # Ids freed lately: a pod's request that overtook its own settle of one (its list of what it
        # holds was made before) must not take it again.
        self._freed: OrderedDict[int, None] = OrderedDict()

    # -- the limits ----------------------------------------------------------------------------------

    def set_limits(self, quota: str, limits: list[Limit]) -> None:
        """The quota's limits as its spec says now; a limit that stays keeps its charges and
        reservations, a new one counts every source already in the book."""
        keep = {lim.key for lim in limits}
        for key in [k for k in self._accounts if k[0] == quota and k not in keep]:
            del self._accounts[key]
        for lim in limits:
            account = self._accounts.get(lim.key)
            if account is not None and account.limit.model == lim.model:
                account.limit = lim
                continue
            account = self._accounts[lim.key] = _Account(lim)
            for quotas, charges in self._sources.values():
                if quota in quotas:
                    self._add(account, charges, 1)
            # Calls in flight count under the new account too (a limit remade, a quota made again);
            # one the remade limit no longer covers (another model now) is not its own any more.
            for r in self._reservations.values():
                if quota in r.quotas and lim.covers(r.model):
                    account.reserved = account.reserved + r.spend
                    r.limits = (*r.limits, lim.key) if lim.key not in r.limits else r.limits
                elif lim.key in r.limits:
                    r.limits = tuple(k for k in r.limits if k != lim.key)

    def limits(self, quota: str) -> list[Limit]:
        return [a.limit for k, a in self._accounts.items() if k[0] == quota]

    # -- what is used --------------------------------------------------------------------------------

    def set_source(self, source: str, quotas: list[str], charges: Charges) -> None:
        """What ``source`` has charged, all of it (it replaces what it said before). Under the same
        quotas only what changed is applied: a settle hands a run's charges so far (up to 1,024
        quarter hours and models), of which one or two are new, to every limit covering it."""
        scope, old = frozenset(quotas), self._sources.get(source)
        self._sources[source] = (scope, list(charges))
        if old is None or old[0] != scope:
            if old is not None:
                for account in self._covering(list(old[0])):
                    self._add(account, old[1], -1)
            for account in self._covering(list(scope)):
                self._add(account, charges, 1)
            return
        delta = by_slot(charges)
        for slot, spend in by_slot(old[1]).items():
            delta[slot] = delta.get(slot, Spend()) - spend
        changed = [(at, model, d) for (at, model), d in delta.items() if d != Spend()]
        if changed:
            for account in self._covering(list(scope)):
                self._add(account, changed, 1)

    def source_charges(self, source: str) -> Charges:
        return list(self._sources.get(source, (frozenset(), []))[1])

    def drop_source(self, source: str) -> None:
        old = self._sources.pop(source, None)
        if old is not None:
            for account in self._covering(list(old[0])):
                self._add(account, old[1], -1)

    def _add(self, account: _Account, charges: Charges, sign: int) -> None:
        for at, model, spend in charges:
            if not account.limit.covers(model):
                continue
            bucket = bucket_of(at)
            delta = spend if sign > 0 else Spend() - spend
            total = account.buckets.get(bucket, Spend()) + delta
            if total == Spend():
                account.buckets.pop(bucket, None)
            else:
                account.buckets[bucket] = total
            if account.window is not None and account.window.holds(bucket):
                account.total = account.total + delta

    def used(self, key: tuple[str, str], now: dt.datetime) -> Spend:
        account = self._accounts[key]
        window = window_at(account.limit.window, now)
        if window != account.window:
            account.window = window
            account.total = sum((s for b, s in account.buckets.items() if window.holds(b)), Spend())
        return account.total

    def reserved(self, key: tuple[str, str]) -> Spend:
        return self._accounts[key].reserved

    # -- calls in flight -----------------------------------------------------------------------------

    def reserve(self, quotas: list[str], holder: str, model: str, worst: Spend,
                now: dt.datetime, *, priced: bool = True) -> Reservation | Refusal:
        """Take ``worst`` from every limit of ``quotas`` covering ``model``, or nothing and say which
        limit it would pass. A call of a model with no price (``priced`` false: its cost is unknown,
        not zero) is refused under any limit with a cost cap."""
        accounts = [a for a in self._covering(quotas) if a.limit.covers(model)]
        if accounts and len(self._by_holder.get(holder, ())) >= HELD_PER_RUN:
            return Refusal(accounts[0].limit, Spend(), accounts[0].reserved, worst, None,
                           reason=f"a run holds at most {HELD_PER_RUN} reservations at once")
        for account in accounts:
            if not priced and account.limit.max_cost is not None:
                return Refusal(account.limit, Spend(), account.reserved, worst, None, unpriced=model)
        for account in accounts:
            used = self.used(account.limit.key, now)
            if not account.limit.fits(used + account.reserved + worst):
                return Refusal(account.limit, used, account.reserved, worst, resets_at(account.limit.window, now))
        reservation = Reservation(next(self._ids), holder, model, worst, tuple(a.limit.key for a in accounts),
                                  tuple(sorted(set(quotas))))
        for account in accounts:
            account.reserved = account.reserved + worst
        self._reservations[reservation.id] = reservation
        self._by_holder[holder].add(reservation.id)
        return reservation

    def settle(self, reservation_id: int, holder: str, charges: Charges,
               quotas: list[str] | tuple[str, ...] = ()) -> bool:
        """A call of ``holder``'s run answered: its reservation is freed, and ``charges`` (the run's, all
        of them so far: cumulative, so a settle lost or repeated changes nothing) become the run's source
        until the run is folded into its Flow. False when the reservation was not known (freed with
        its run already, or made with another leader); the charges count all the same, under
        ``quotas`` (the run's covering quotas) then."""
        reservation = self._free(reservation_id, holder)
        if reservation is None:
            self._forget(reservation_id)  # made with another leader: a held list older than this must not restore it
        self.run_charges(holder, list(reservation.quotas) if reservation is not None else list(quotas), charges)
        return reservation is not None

    def restore(self, reservation_id: int, holder: str, model: str, spend: Spend, quotas: list[str]) -> bool:
        """A reservation a pod says it holds that this book does not know (it was made with another
        leader): taken again as it was, without a check (its call is in flight already). False when
        it is known."""
        if (reservation_id in self._reservations or reservation_id in self._freed
                or len(self._by_holder.get(holder, ())) >= HELD_PER_RUN):
            return False
        accounts = [a for a in self._covering(quotas) if a.limit.covers(model)]
        for account in accounts:
            account.reserved = account.reserved + spend
        keys = tuple(a.limit.key for a in accounts)
        self._reservations[reservation_id] = Reservation(reservation_id, holder, model, spend, keys,
                                                         tuple(sorted(set(quotas))))
        self._by_holder[holder].add(reservation_id)
        return True

    def run_charges(self, holder: str, quotas: list[str], charges: Charges) -> None:
        """A running pod's charges so far (cumulative), unless the book has a later word from it
        already (more spent: a request that overtook this one)."""
        known = self._sources.get(f"run:{holder}")
        if known is not None and _total(known[1]) > _total(charges):
            return
        self.set_source(f"run:{holder}", quotas or (list(known[0]) if known is not None else []), charges)

    def free(self, reservation_id: int, holder: str) -> bool:
        """Free one reservation of ``holder`` (a late word of a run already counted); False when unknown."""
        found = self._free(reservation_id, holder) is not None
        self._forget(reservation_id)
        return found

    def release(self, holder: str) -> int:
        """Free every reservation of ``holder`` (its run ended); how many there were."""
        ids = self._by_holder.pop(holder, set())
        for reservation_id in ids:
            self._free(reservation_id)
        return len(ids)

    def _free(self, reservation_id: int, holder: str | None = None) -> Reservation | None:
        """Free a reservation (only ``holder``'s, when given: a pod frees no other pod's)."""
        reservation = self._reservations.get(reservation_id)
        if reservation is None or (holder is not None and reservation.holder != holder):
            return None
        del self._reservations[reservation_id]
        self._forget(reservation_id)
        self._by_holder.get(reservation.holder, set()).discard(reservation_id)
        for key in reservation.limits:
            account = self._accounts.get(key)
            if account is not None:
                left = account.reserved - reservation.spend
                account.reserved = Spend(max(0, left.tokens), max(Decimal(0), left.cost))
        return reservation

    def _forget(self, reservation_id: int) -> None:
        self._freed[reservation_id] = None
        while len(self._freed) > FREED_KEPT:
            self._freed.popitem(last=False)

    def _covering(self, quotas: list[str]) -> list[_Account]:
        wanted = set(quotas)
        return [a for k, a in self._accounts.items() if k[0] in wanted]


def _total(charges: Charges) -> tuple[int, Decimal]:
    return sum(s.tokens for _, _, s in charges), sum((s.cost for _, _, s in charges), Decimal(0))
