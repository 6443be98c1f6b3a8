"""The real-runner tests' shared fixtures: the stub model with the article rules, and a harness
running the runner's processes against it (a module may define its own ``stub``: the nearer wins)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from flowkube_devstack.stubmodel import Rules, StubModel
from tests.unit.runner.test_runner_flows import RULES, Harness


@pytest.fixture
def stub() -> Iterator[StubModel]:
    with StubModel(Rules.from_json(RULES)) as model:
        yield model


@pytest.fixture
def harness(tmp_path: Path, stub: StubModel) -> Harness:
    return Harness(tmp_path, stub)
