"""The suite's two lanes (a pytest plugin, loaded by tests/conftest.py).

pyproject's addopts run pytest with ``-n 2 --dist loadgroup``. Every test on the local stack (it takes
the ``cluster`` fixture, directly or through another fixture) joins one xdist group, so one worker runs
all of them, in collection order, on one cluster; every other test runs in the second worker beside
them. The stack's tests mostly wait on pods, timers and the API server, the others mostly compute, so
the two lanes share this machine's two cores (docs/development.md has the figures). ``-n 0`` runs the
whole suite in one process, as before.
"""

from __future__ import annotations

import pytest

STACK_LANE = "stack"
STACK_FIXTURE = "cluster"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the groups into node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if STACK_FIXTURE in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group(STACK_LANE))
