"""Benchmark: what the quota book adds to a model call (issue 41), before its state API hop. Prints figures.

    .venv/bin/python -m tests.benchmarks.bench_quota_book [--days 365] [--flows 1000] [--calls 2000]

A namespace's quota with three limits (a Berlin calendar month of cost, a rolling 24 h of tokens,
a lifetime of tokens) over ``--flows`` Flows whose ended runs charged every quarter hour of the last
``--days`` days. Then ``--calls`` reserve-and-settle pairs, each settle handing the running pod's
charges so far, as a runner's would. Peer, in the same run: the same pairs with the buckets added up
at every reservation, as the book did before it kept each window's total (``--naive``'s figures).
The issue's target is 5 ms p50 added per call, the state API's hop included (``bench_state``: p50
5.5 ms per PUT); the book's share is printed here.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time
from decimal import Decimal

from flowkube_api.windows import WindowSpec
from flowkube_operator.quotas.book import Limit, QuotaBook, Reservation, Spend

Q = "FlowQuota team/spend"


def book(days: int, flows: int) -> QuotaBook:
    b = QuotaBook()
    b.set_limits(Q, [Limit(Q, "month", WindowSpec("Month", "Europe/Berlin"), max_cost=Decimal(10**6)),
                     Limit(Q, "day", WindowSpec("Rolling", hours=24), max_tokens=10**12),
                     Limit(Q, "ever", WindowSpec("Lifetime"), max_tokens=10**15)])
    now = dt.datetime.now(dt.UTC)
    quarters = days * 96
    for f in range(flows):
        # one charge a day each, at its own quarter hour: together, every quarter hour of the days
        charges = [(now - dt.timedelta(minutes=15 * q), "m", Spend(100, Decimal("0.001")))
                   for q in range(f % 96, quarters, 96)]
        b.set_source(f"flow:{f}", [Q], charges)
    return b


def pairs(b: QuotaBook, calls: int, naive: bool) -> list[float]:
    took: list[float] = []
    mine: list[tuple[dt.datetime, str, Spend]] = []
    for _ in range(calls):
        now = dt.datetime.now(dt.UTC)
        started = time.perf_counter()
        if naive:
            for account in b._accounts.values():
                account.window = None
        r = b.reserve([Q], "pod-0", "m", Spend(2000, Decimal("0.01")), now)
        assert isinstance(r, Reservation)
        mine.append((now, "m", Spend(300, Decimal("0.002"))))
        b.settle(r.id, "pod-0", mine[-50:])
        took.append(time.perf_counter() - started)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--flows", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    started = time.perf_counter()
    b = book(args.days, args.flows)
    buckets = max(len(a.buckets) for a in b._accounts.values())
    print(f"{args.flows} Flows, {args.days} days of quarter hours ({buckets} buckets per limit), three limits; "
          f"built in {time.perf_counter() - started:.1f} s")
    for naive, label in ((False, "kept window totals"), (True, "naive (peer)")):
        took = sorted(pairs(b, args.calls if not naive else max(args.calls // 10, 20), naive))
        p50, p99 = statistics.median(took), took[int(len(took) * 0.99) - 1]
        print(f"  {label:20} reserve+settle p50 {p50 * 1000:.3f} ms, p99 {p99 * 1000:.3f} ms ({len(took)} pairs)")


if __name__ == "__main__":
    main()
