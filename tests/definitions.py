"""Flow definitions more than one test module runs, and crewAI's environment for running them."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def quiet_crewai_env(home: Path) -> dict[str, str]:
    """No telemetry, no tracing prompt, and crewAI's own storage kept inside the test dir."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        "HOME": str(home),
        "XDG_DATA_HOME": str(home / "data"),
        "CREWAI_STORAGE_DIR": "flowkube-test",
        "CREWAI_DISABLE_TELEMETRY": "true",
        "CREWAI_TRACING_ENABLED": "false",
        "OTEL_SDK_DISABLED": "true",
        "OPENAI_API_KEY": "stub",
        "PYTHONUNBUFFERED": "1",
    }


@contextmanager
def crewai_in_process(base_url: str) -> Iterator[Path]:
    """crewAI in this process pointed at the stub model at ``base_url``, with a scratch HOME (yielded);
    the process's environment is put back afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**quiet_crewai_env(Path(tmp)), "OPENAI_BASE_URL": base_url}
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield Path(tmp)
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def crew_definition(writer: dict[str, Any], parts: int = 4) -> dict[str, Any]:
    """One method that runs a crew of ``parts`` tasks, each one model call whose prompt names its part
    (``PART<i> of``), then a method that returns the crew's output."""
    tasks = [{"name": f"part_{i}", "description": f"PART{i} of the report about {{topic}}",
              "expected_output": "a paragraph", "agent": "writer"} for i in range(1, parts + 1)]
    return {
        "schema": "crewai.flow/v1",
        "name": "Report",
        "state": {"type": "dict", "default": {"topic": "operators"}},
        "methods": {
            "report": {"start": True, "do": {"call": "crew", "with": {"name": "report", "agents": {"writer": writer},
                                                                       "tasks": tasks},
                                               "inputs": {"topic": "${state.topic}"}}},
            "done": {"listen": "report", "do": {"call": "expression", "expr": "outputs.report.raw"}},
        },
    }


def parts_of(ledger: list[dict[str, Any]]) -> list[str]:
    """Which part each model call of ``crew_definition``'s crew wrote ("?" for another call)."""
    return [next((f"PART{i}" for i in range(1, 9) if f"PART{i} of" in e["lastUser"]), "?") for e in ledger]


def part_rules(parts: int = 4) -> list[dict[str, Any]]:
    """A reply per part, each naming a fact a later task must read."""
    return [{"contains": f"PART{i} of", "reply": f"Part {i} says: fact-{i}."} for i in range(1, parts + 1)]
