"""The suite's lanes (a pytest plugin, loaded by tests/conftest.py).

pyproject's addopts run pytest with ``-n 2 --dist loadgroup``. A test on a local stack (it takes the
``cluster`` fixture, directly or through another fixture) joins one of two xdist groups: ``stack-2``
for the modules in ``SECOND_STACK``, ``stack`` for the others. A group runs in one worker, in
collection order, on that worker's own cluster (each worker is its own pytest session, with its own
session-scoped ``cluster``, in its own network namespace). xdist hands the two groups, the largest
units of work, one to each worker first; each worker then takes the remaining tests (the unit tests,
the kind and launcher tests, which start clusters of their own) one at a time as it frees up.

``SECOND_STACK`` balances the two workers: the modules whose time (docs/development.md) makes the
second stack plus the tests that need no stack about as long as the first stack. The stack's tests
mostly wait on pods, timers and the API server, the others mostly compute, so they share this
machine's two cores. ``-n 0`` runs the whole suite in one process on one cluster, as before.
"""

from __future__ import annotations

import pytest

STACK_LANE = "stack"
SECOND_STACK_LANE = "stack-2"
STACK_FIXTURE = "cluster"
# Modules on the second worker's stack: the real runner's end-to-end modules and two of the scripted
# ones (about 5.5 of the 19 minutes the stack's modules take in one lane).
SECOND_STACK = frozenset({
    "tests/integration/test_console.py",
    "tests/integration/test_conversation.py",
    "tests/integration/test_e2e_runner.py",
    "tests/integration/test_examples.py",
    "tests/integration/test_fuzz.py",
    "tests/integration/test_notifications.py",
    "tests/integration/test_prometheus.py",
    "tests/integration/test_template_snapshots.py",
})


def lane_of(nodeid: str) -> str:
    """The xdist group a test's node id carries ("" for none), by xdist's own rule (the last ``@``
    after any parameter brackets)."""
    return nodeid.rsplit("@", 1)[1] if nodeid.rfind("@") > nodeid.rfind("]") else ""


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the groups into node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if STACK_FIXTURE in getattr(item, "fixturenames", ()):
            module = item.nodeid.split("::", 1)[0]
            item.add_marker(pytest.mark.xdist_group(SECOND_STACK_LANE if module in SECOND_STACK else STACK_LANE))
