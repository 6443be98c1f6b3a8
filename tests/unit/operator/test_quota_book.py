"""The quota book (issue 41): windows, reservations that never let a limit be overspent, settling."""

from __future__ import annotations

import datetime as dt
import random
from decimal import Decimal

from flowkube_api.windows import WindowSpec, bucket_of, window_at
from flowkube_operator.quotas.book import Limit, QuotaBook, Refusal, Reservation, Spend

T0 = dt.datetime(2026, 11, 30, 22, 50, tzinfo=dt.UTC)  # 23:50 in Berlin, the last day of the month
MONTH = WindowSpec("Month", "Europe/Berlin")
Q = "FlowQuota team-a/spend"


def book(*limits: Limit) -> QuotaBook:
    b = QuotaBook()
    b.set_limits(Q, list(limits))
    return b


def test_parallel_calls_never_reserve_past_the_limit_and_settling_charges_what_they_used() -> None:
    limit = Limit(Q, "monthly", MONTH, max_cost=Decimal("1.00"))
    b = book(limit)
    rng = random.Random(7)
    taken: list[Reservation] = []
    refused = 0
    for i in range(1000):  # calls starting at once, each with its own worst case
        worst = Spend(rng.randint(100, 5000), Decimal(rng.randint(1, 300)) / 10_000)
        r = b.reserve([Q], f"pod-{i % 100}", "gpt-4o-mini", worst, T0)
        if isinstance(r, Refusal):
            refused += 1
        else:
            taken.append(r)
    assert refused and taken
    assert b.reserved(limit.key).cost <= Decimal("1.00"), "the worst cases in flight never pass the limit"
    # Each call answers within its worst case (here: half of it): what is used never passes the limit.
    runs: dict[str, list[tuple[dt.datetime, str, Spend]]] = {}
    for r in taken:
        runs.setdefault(r.holder, []).append((T0, r.model, Spend(r.spend.tokens // 2, r.spend.cost / 2)))
        assert b.settle(r.id, r.holder, runs[r.holder])  # a run's charges so far, all of them
    assert b.reserved(limit.key) == Spend()
    used = b.used(limit.key, T0)
    assert used.cost == sum((r.spend.cost / 2 for r in taken), Decimal(0)) <= Decimal("1.00")
    last = taken[-1]
    assert not b.settle(last.id, last.holder, runs[last.holder]), "settled once; again changes nothing"
    assert b.used(limit.key, T0) == used


def test_a_refusal_names_the_quota_the_limit_the_use_and_the_reset() -> None:
    b = book(Limit(Q, "monthly", MONTH, max_cost=Decimal("2.50")), Limit(Q, "daily-tokens", WindowSpec("Day"),
                                                                          max_tokens=1000))
    b.set_source("flow:a", [Q], [(T0, "gpt-4o", Spend(400, Decimal("2.40")))])
    refusal = b.reserve([Q], "pod-0", "gpt-4o", Spend(300, Decimal("0.2")), T0)
    assert isinstance(refusal, Refusal)
    assert refusal.message() == (
        "FlowQuota team-a/spend: limit monthly (maxCost=USD 2.5, per month in Europe/Berlin): USD 2.4 used + "
        "USD 0 reserved by calls in flight, and this call may cost up to USD 0.2; the window resets at "
        "2026-11-30T23:00:00+00:00")
    # Ten minutes later it is December in Berlin: the month's spend is behind, the day's tokens are not.
    later = T0 + dt.timedelta(minutes=10)
    ok = b.reserve([Q], "pod-0", "gpt-4o", Spend(300, Decimal("0.2")), later)
    assert isinstance(ok, Reservation)
    tokens = b.reserve([Q], "pod-1", "gpt-4o", Spend(301, Decimal("0.01")), later)
    assert isinstance(tokens, Refusal) and tokens.limit.name == "daily-tokens"
    assert "400 tokens used + 300 reserved by calls in flight, and this call may use up to 301" in tokens.message()


def test_a_model_limit_counts_only_that_model_and_a_run_that_ended_frees_what_it_held() -> None:
    only = Limit(Q, "gpt4o", WindowSpec("Lifetime"), max_tokens=100, model="gpt-4o")
    b = book(only)
    assert isinstance(b.reserve([Q], "pod-0", "gpt-4o-mini", Spend(10_000), T0), Reservation)
    assert b.reserved(only.key) == Spend(), "another model's call is not this limit's"
    held = b.reserve([Q], "pod-1", "gpt-4o", Spend(100), T0)
    assert isinstance(held, Reservation)
    assert isinstance(b.reserve([Q], "pod-2", "gpt-4o", Spend(1), T0), Refusal)
    assert b.release("pod-1") == 1 and b.reserved(only.key) == Spend()
    assert isinstance(b.reserve([Q], "pod-2", "gpt-4o", Spend(1), T0), Reservation)
    assert not b.settle(held.id, "pod-1", []), "freed with its run: its report charges the call"
    # Quotas that do not cover the Flow are not asked.
    assert isinstance(b.reserve(["FlowQuota other/q"], "pod-3", "gpt-4o", Spend(10**9), T0), Reservation)


def test_sources_replace_what_they_said_and_a_run_settled_in_flight_becomes_its_flows_charges() -> None:
    rolling = Limit(Q, "hourly", WindowSpec("Rolling", hours=1), max_tokens=10)
    life = Limit(Q, "ever", WindowSpec("Lifetime"), max_tokens=1000)
    b = book(rolling, life)
    b.set_source("flow:a", [Q], [(T0, "m", Spend(10))])
    assert isinstance(b.reserve([Q], "p", "m", Spend(1), T0 + dt.timedelta(minutes=30)), Refusal)
    later = T0 + dt.timedelta(minutes=75)
    assert b.used(rolling.key, later) == Spend() and b.used(life.key, later) == Spend(10)
    # A run's calls settle as they answer; when the run is in its Flow's status, the Flow says it all.
    r = b.reserve([Q], "pod-1", "m", Spend(5), later)
    assert isinstance(r, Reservation) and b.settle(r.id, "pod-1", [(later, "m", Spend(3))])
    assert b.used(life.key, later) == Spend(13) and b.reserved(life.key) == Spend()
    b.set_source("flow:a", [Q], [(T0, "m", Spend(10)), (later, "m", Spend(3))])
    b.drop_source("run:pod-1")
    assert b.used(life.key, later) == Spend(13) and b.used(rolling.key, later) == Spend(3)
    # A quota made after the Flows counts what they charged; a limit taken out of the spec goes.
    b.set_limits("FlowQuota team-a/late", [Limit("FlowQuota team-a/late", "all", WindowSpec("Lifetime"),
                                                 max_tokens=5)])
    assert b.used(("FlowQuota team-a/late", "all"), later) == Spend(), "no source is covered by it"
    b.set_source("flow:b", ["FlowQuota team-a/late"], [(later, "m", Spend(4))])
    b.set_limits(Q, [life, Limit(Q, "new", WindowSpec("Lifetime"), max_tokens=99)])
    assert b.used((Q, "new"), later) == Spend(13), "a new limit counts what its quota's Flows charged before"
    b.set_limits(Q, [life])
    assert b.limits(Q) == [life] and b.used(life.key, later) == Spend(13)
    assert b.used(("FlowQuota team-a/late", "all"), later) == Spend(4)


def test_a_quota_spec_names_its_bad_field_and_becomes_the_books_limits() -> None:
    import pytest
    from pydantic import ValidationError

    from flowkube_api.models.quota import FlowQuotaSpec
    from flowkube_operator.quotas.book import limits_of

    spec = FlowQuotaSpec.model_validate({"limits": [
        {"name": "monthly", "maxCost": "200", "window": {"kind": "Month", "timeZone": "Europe/Berlin"}},
        {"name": "daily-4o", "maxTotalTokens": 5_000_000, "model": "gpt-4o", "window": {"kind": "Day"}},
        {"name": "burst", "maxTotalTokens": 100_000, "window": {"kind": "Rolling", "hours": 3}}]})
    limits = limits_of(Q, spec)
    assert [(lim.name, lim.max_cost, lim.max_tokens, lim.model, lim.window.kind) for lim in limits] == [
        ("monthly", Decimal("200"), None, None, "Month"), ("daily-4o", None, 5_000_000, "gpt-4o", "Day"),
        ("burst", None, 100_000, None, "Rolling")]
    for bad, field in [({"name": "x", "window": {"kind": "Day"}}, "maxTotalTokens, maxCost or both"),
                       ({"name": "x", "maxCost": "1", "window": {"kind": "Day", "timeZone": "Mars/Base"}},
                        "window.timeZone"),
                       ({"name": "x", "maxCost": "1", "window": {"kind": "Day", "hours": 2}}, "window.hours"),
                       ({"name": "x", "maxCost": "1", "window": {"kind": "Rolling"}}, "window.hours")]:
        with pytest.raises(ValidationError, match=field):
            FlowQuotaSpec.model_validate({"limits": [bad]})
    with pytest.raises(ValidationError, match=r"selector.matchExpressions\[0\].operator"):
        FlowQuotaSpec.model_validate({"limits": spec.model_dump(by_alias=True, mode="json")["limits"],
                                      "selector": {"matchExpressions": [{"key": "team", "operator": "Is"}]}})


def test_a_flows_charges_come_from_its_ended_runs_by_quarter_hour_or_by_model_when_they_ended() -> None:
    from flowkube_operator.quotas.book import flow_charges

    status = {"runs": [
        {"pod": "f-0", "finishedAt": "2026-11-28T07:20:00Z", "usage": {"totalTokens": 42, "cost": "0.5"},
         "charges": [{"at": "2026-11-28T07:00:00Z", "model": "gpt-4o", "totalTokens": 30, "cost": "0.4"},
                     {"at": "2026-11-28T07:15:00Z", "model": "gpt-4o", "totalTokens": 12, "cost": "0.1"}]},
        {"pod": "f-1", "finishedAt": "2026-11-28T09:00:00Z",  # no charges: its usage, when it ended
         "usage": {"totalTokens": 7, "cost": "0.01", "byModel": {"m": {"totalTokens": 7, "cost": "0.01"}}}},
        {"pod": "f-2", "startedAt": "2026-11-28T09:01:00Z", "usage": {"totalTokens": 99}},  # still going
    ]}
    at = dt.datetime(2026, 11, 28, 7, tzinfo=dt.UTC)
    assert flow_charges(status) == [
        (at, "gpt-4o", Spend(30, Decimal("0.4"))), (at + dt.timedelta(minutes=15), "gpt-4o", Spend(12, Decimal("0.1"))),
        (at + dt.timedelta(hours=2), "m", Spend(7, Decimal("0.01")))]
    assert flow_charges({}) == [] and flow_charges({"runs": ["junk", {"finishedAt": "2026-11-28T07:20:00Z"}]}) == []


def test_a_pod_frees_only_its_own_reservations_and_a_remade_limit_still_counts_calls_in_flight() -> None:
    limit = Limit(Q, "all", WindowSpec("Lifetime"), max_tokens=100)
    b = book(limit)
    mine = b.reserve([Q], "pod-a", "m", Spend(90), T0)
    assert isinstance(mine, Reservation)
    assert not b.settle(mine.id, "pod-b", []), "another pod's settle does not free it"
    assert b.reserved(limit.key) == Spend(90)
    # The quota is deleted and made again (or its spec was briefly invalid): the call is still in flight.
    b.set_limits(Q, [])
    b.set_limits(Q, [limit])
    assert b.reserved(limit.key) == Spend(90)
    assert isinstance(b.reserve([Q], "pod-b", "m", Spend(20), T0), Refusal), "90 held + 20 > 100"
    assert b.settle(mine.id, "pod-a", [(T0, "m", Spend(10))]) and b.reserved(limit.key) == Spend()


def test_a_call_of_a_model_with_no_price_is_refused_under_a_cost_limit_and_counted_under_a_token_one() -> None:
    cost = Limit(Q, "usd", WindowSpec("Lifetime"), max_cost=Decimal("5"))
    tokens = Limit("FlowQuota team-a/tokens", "all", WindowSpec("Lifetime"), max_tokens=1000)
    b = QuotaBook()
    b.set_limits(Q, [cost])
    b.set_limits(tokens.quota, [tokens])
    refused = b.reserve([Q, tokens.quota], "p", "ollama/llama3", Spend(10), T0, priced=False)
    assert isinstance(refused, Refusal) and "model ollama/llama3 has no price" in refused.message()
    assert isinstance(b.reserve([tokens.quota], "p", "ollama/llama3", Spend(10), T0, priced=False), Reservation)


def test_the_kept_window_totals_equal_adding_the_buckets_up_whatever_comes_and_goes() -> None:
    limits = [Limit(Q, "day", WindowSpec("Day", "Europe/Berlin"), max_tokens=10**9),
              Limit(Q, "roll", WindowSpec("Rolling", hours=2), max_tokens=10**9),
              Limit(Q, "life", WindowSpec("Lifetime"), max_tokens=10**9)]
    b = book(*limits)
    rng = random.Random(11)
    now = T0
    sources: dict[str, list[tuple[dt.datetime, str, Spend]]] = {}
    for step in range(400):
        now += dt.timedelta(minutes=rng.choice([0, 1, 7, 29]))
        name = f"flow:{rng.randint(0, 9)}"
        if rng.random() < 0.2:
            b.drop_source(name)
            sources.pop(name, None)
        else:
            made = now - dt.timedelta(minutes=rng.randint(0, 300))
            charges = [*sources.get(name, []), (made, "m", Spend(rng.randint(1, 50)))]
            b.set_source(name, [Q], charges)
            sources[name] = charges
        if step % 7 == 0:
            for limit in limits:
                w = window_at(limit.window, now)
                naive = sum((s for cs in sources.values() for at, _, s in cs if w.holds(bucket_of(at))), Spend())
                assert b.used(limit.key, now) == naive, (step, limit.name)




def test_a_held_list_older_than_a_settle_does_not_take_the_settled_reservation_again() -> None:
    """Two calls of one pod settle at once: the first's request lists the second as held (it was made
    before the second settled), and reaches the book after the second's settle. The settled
    reservation must stay freed, or the book would hold it until the run ends."""
    import datetime as dt

    from flowkube_api.windows import WindowSpec
    from flowkube_operator.quotas.book import Limit, QuotaBook, Reservation, Spend

    q = "FlowQuota ns/q"
    now = dt.datetime(2026, 11, 28, 8, tzinfo=dt.UTC)
    book = QuotaBook()
    book.set_limits(q, [Limit(q, "all", WindowSpec("Lifetime"), max_tokens=100)])
    one, two = (book.reserve([q], "ns/p-0", "m", Spend(40), now) for _ in range(2))
    assert isinstance(one, Reservation) and isinstance(two, Reservation)
    assert book.settle(two.id, "ns/p-0", [(now, "m", Spend(40))])
    assert book.restore(two.id, "ns/p-0", "m", Spend(40), [q]) is False, "freed: not taken again"
    assert book.settle(one.id, "ns/p-0", [(now, "m", Spend(80))])
    assert book.reserved((q, "all")) == Spend() and book.used((q, "all"), now) == Spend(80)
    # A reservation this book never saw (made with an earlier leader) is taken again.
    assert book.restore(12345, "ns/p-0", "m", Spend(20), [q]) is True
    assert book.reserved((q, "all")) == Spend(20)
