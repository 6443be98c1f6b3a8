"""The suite's time budget (tests/budget.py) fails a test that goes over it and prints the slowest modules."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

SLOW_AND_FAST = """
import time
import pytest

def test_fast():
    pass

def test_slow():
    time.sleep(0.6)  # the workload whose time is measured

@pytest.mark.budget(5)
def test_slow_with_its_own_budget():
    time.sleep(0.6)

@pytest.fixture(scope="module")
def stack():
    time.sleep(0.6)  # a shared stack: not charged to the test that happens to start it
    return 1

def test_uses_the_shared_stack(stack):
    assert stack == 1
"""


def test_a_test_over_its_budget_fails_and_the_slowest_modules_are_printed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_sample=SLOW_AND_FAST)
    table = pytester.path / "modules.md"
    result = pytester.runpytest("-p", "tests.budget", "--test-budget=0.4", f"--module-table={table}")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 4 and outcomes.get("errors") == 1, result.stdout.str()
    result.stdout.fnmatch_lines(["*test_slow took *s, over its budget of 0.4s*", "*suite wall time*slowest modules*",
                                 "*4 tests  test_sample.py*"])
    assert "| `test_sample.py` | 4 |" in table.read_text()

