"""Flow definitions more than one test module runs."""

from __future__ import annotations

from typing import Any


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
