"""The suite's two lanes (tests/lanes.py): every test on the local stack in one worker, once set up."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[3]

CONFTEST = """
import os
import pytest

@pytest.fixture(scope="session")
def cluster():
    with open("cluster-starts", "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
    return "the stack"

@pytest.fixture(scope="module")
def operator(cluster):
    return cluster

@pytest.fixture(autouse=True)
def where(request):
    with open("ran", "a") as f:
        f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {request.node.name}\\n")
"""

TESTS = """
def test_stack_1(cluster): pass
def test_compute_1(): pass
def test_stack_2(operator): pass
def test_compute_2(): pass
def test_stack_3(cluster): pass
def test_compute_3(): pass
"""


def test_the_stacks_tests_run_in_one_worker_in_order_on_one_cluster(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_sample=TESTS)
    result = pytester.runpytest_subprocess("-p", "tests.lanes", "-p", "tests.budget", "-n", "2",
                                           "--dist", "loadgroup")
    assert result.parseoutcomes().get("passed") == 6, result.stdout.str()
    assert len((pytester.path / "cluster-starts").read_text().split()) == 1  # one cluster for the lane
    ran = [line.split() for line in (pytester.path / "ran").read_text().splitlines()]
    stack = [(worker, name) for worker, name in ran if name.startswith("test_stack")]
    assert [name for _, name in stack] == ["test_stack_1", "test_stack_2", "test_stack_3"]
    assert len({worker for worker, _ in stack}) == 1, ran
    result.stdout.fnmatch_lines(["*lanes: the other tests * min, stack * min*"])
