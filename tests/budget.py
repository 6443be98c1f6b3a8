"""The suite's time budget, seen as it is spent (a pytest plugin, loaded by tests/conftest.py).

- Every test has a budget: its setup, call and teardown together may take at most ``--test-budget``
  seconds (pyproject's addopts). A test over it fails with the figure, so growth is seen in the change
  that makes it rather than as a slower CI. A test whose scenario really needs more says so with
  ``@pytest.mark.budget(seconds)`` and a reason in its docstring. Fixtures shared by several tests (the
  local cluster, a module's operator) are not charged to the test that happens to set them up.
- At the end the run prints its wall time, each xdist worker's, and the ten slowest modules (a
  module's tests' setup, call and teardown summed, module-scoped stacks included); ``--module-table
  PATH`` writes every module's figures as a Markdown table (docs/development.md holds one).

Why pytest-timeout is not enough: it kills a test that hangs (300 s), which says nothing about a
test that quietly went from 20 s to 200 s.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.lanes import lane_of

SHARED_SCOPES = ("session", "package", "module", "class")


@dataclass
class Spent:
    started: float = field(default_factory=time.time)
    module_seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    module_tests: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    worker_wall: dict[str, list[float]] = field(default_factory=dict)  # xdist worker -> [first start, last end]
    worker_lanes: defaultdict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    shared_setup: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))  # by test
    current: str = ""  # the test being run now


SPENT = pytest.StashKey[Spent]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("budget", "the suite's time budget")
    group.addoption("--test-budget", type=float, default=0.0,
                    help="seconds a test (setup + call + teardown, shared fixtures excepted) may take; 0: no check")
    group.addoption("--module-table", default="", help="write each module's wall time as a Markdown table here")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "budget(seconds): this test's own time budget (say why in its docstring)")
    config.stash[SPENT] = Spent()
    config.pluginmanager.register(Reports(config.stash[SPENT]), "flowkube-budget-reports")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    item.config.stash[SPENT].current = item.nodeid
    yield


class Reports:
    """Each phase's report, in the process that prints the summary (with xdist: the controller,
    from every worker's reports): the modules' wall time and test counts."""

    def __init__(self, spent: Spent) -> None:
        self.spent = spent

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = report.nodeid.split("::", 1)[0]
        # A module's time: its tests' setup, call and teardown summed (module-scoped stacks included),
        # so a module whose tests ran in two workers is not charged the time between them.
        self.spent.module_seconds[module] += report.duration
        worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "")
        span = self.spent.worker_wall.setdefault(worker, [report.start, report.stop])
        span[0], span[1] = min(span[0], report.start), max(span[1], report.stop)
        if lane := lane_of(report.nodeid):
            self.spent.worker_lanes[worker].add(lane)
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.spent.module_tests[module] += 1


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Any:
    start = time.monotonic()
    yield
    if fixturedef.scope in SHARED_SCOPES:
        spent = request.config.stash[SPENT]
        spent.shared_setup[spent.current] += time.monotonic() - start


def budget_of(item: pytest.Item, default: float) -> float:
    marker = item.get_closest_marker("budget")
    return float(marker.args[0]) if marker is not None and marker.args else default


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    phases: dict[str, float] = item.__dict__.setdefault("_budget_phases", {})
    phases[call.when] = call.duration
    if call.when != "teardown" or report.failed:
        return
    budget = budget_of(item, float(item.config.getoption("--test-budget") or 0.0))
    took = sum(phases.values()) - item.config.stash[SPENT].shared_setup.get(item.nodeid, 0.0)
    if budget > 0 and took > budget:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {took:.1f}s, over its budget of {budget:g}s "
                           "(tests/budget.py: make it faster, or give it @pytest.mark.budget(seconds) and say why)")


def module_rows(spent: Spent) -> list[tuple[str, int, float]]:
    """(module, tests, wall seconds), slowest first."""
    rows = [(m, spent.module_tests[m], seconds) for m, seconds in spent.module_seconds.items()]
    return sorted(rows, key=lambda r: r[2], reverse=True)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    spent = config.stash[SPENT]
    rows = module_rows(spent)
    if not rows:
        return
    total = time.time() - spent.started
    terminalreporter.write_sep("=", f"suite wall time {total / 60:.1f} min; the ten slowest modules")
    workers = sorted(spent.worker_wall.items())
    if len(workers) > 1:  # xdist: what each worker ran, and for how long
        terminalreporter.write_line("workers: " + ", ".join(
            f"{w} {(end - start) / 60:.1f} min ({', '.join(sorted(spent.worker_lanes[w])) or 'no stack'})"
            for w, (start, end) in workers))
    for module, tests, seconds in rows[:10]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {tests:4d} tests  {module}")
    path = config.getoption("--module-table")
    if path:
        lines = ["| module | tests | wall (s) |", "|---|---:|---:|"]
        lines += [f"| `{m}` | {n} | {s:.0f} |" for m, n, s in rows]
        lines.append(f"| **whole run** | {sum(n for _, n, _ in rows)} | {total:.0f} |")
        Path(path).write_text("\n".join(lines) + "\n")
