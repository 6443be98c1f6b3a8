"""A Flow's ``status.usage`` (or a run's) read with the standard library alone, for the kubectl
plugin, which may not import pydantic. The operator and the console read it with `report.Usage`; a
unit test holds this reader to that model's wire names."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class UsageCounts:
    total_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    successful_requests: int = 0
    by_model: dict[str, UsageCounts] = field(default_factory=dict)


def _count(raw: Mapping[str, Any], name: str) -> int:
    value = raw.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def usage_counts(raw: Any) -> UsageCounts:
    """The counts of ``raw``; what is not a count reads as 0."""
    if not isinstance(raw, Mapping):
        return UsageCounts()
    models = raw.get("byModel")
    return UsageCounts(
        total_tokens=_count(raw, "totalTokens"), prompt_tokens=_count(raw, "promptTokens"),
        completion_tokens=_count(raw, "completionTokens"), successful_requests=_count(raw, "successfulRequests"),
        by_model={str(k): usage_counts(v) for k, v in models.items()} if isinstance(models, Mapping) else {})
