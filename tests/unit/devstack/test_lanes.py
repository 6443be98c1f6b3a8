"""The suite's lanes (tests/lanes.py): each stack's tests in one worker, in order, on its own cluster."""

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
    return "a stack"

@pytest.fixture(scope="module")
def operator(cluster):
    return cluster

@pytest.fixture(autouse=True)
def where(request):
    with open("ran", "a") as f:
        f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {request.node.name}\\n")
"""

FIRST = """
def test_stack_1(cluster): pass
def test_compute_1(): pass
def test_stack_2(operator): pass
def test_stack_3(cluster): pass
"""

SECOND = """
def test_second_1(operator): pass
def test_compute_2(): pass
def test_second_2(cluster): pass
"""


def test_each_stacks_tests_run_in_one_worker_in_order_on_its_own_cluster(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    pytester.makeconftest(CONFTEST)
    (pytester.path / "tests" / "integration").mkdir(parents=True)
    (pytester.path / "tests" / "integration" / "test_lifecycle.py").write_text(FIRST)
    (pytester.path / "tests" / "integration" / "test_console.py").write_text(SECOND)  # in SECOND_STACK
    pytester.makepyfile(test_compute="\n".join(f"def test_compute_{i}(): pass" for i in range(3, 9)))
    result = pytester.runpytest_subprocess("-p", "tests.lanes", "-p", "tests.budget", "-n", "2",
                                           "--dist", "loadgroup")
    assert result.parseoutcomes().get("passed") == 13, result.stdout.str()
    ran = [line.split() for line in (pytester.path / "ran").read_text().splitlines()]
    first = [(worker, name) for worker, name in ran if name.startswith("test_stack")]
    second = [(worker, name) for worker, name in ran if name.startswith("test_second")]
    assert [name for _, name in first] == ["test_stack_1", "test_stack_2", "test_stack_3"]
    assert [name for _, name in second] == ["test_second_1", "test_second_2"]
    assert len({w for w, _ in first}) == 1 and len({w for w, _ in second}) == 1, ran
    assert {w for w, _ in first} != {w for w, _ in second}, ran  # one stack per worker
    starts = (pytester.path / "cluster-starts").read_text().split()
    assert sorted(starts) == ["gw0", "gw1"]  # each worker's own cluster, started once
    result.stdout.fnmatch_lines(["*workers: gw0 * min (stack*), gw1 * min (stack*)*"])
