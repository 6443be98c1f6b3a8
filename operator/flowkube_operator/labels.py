"""The bound on tenant-chosen label values: every metric whose labels carry a name a tenant picks
(a definition, a template, a CronFlow, a model) takes its values through a `LabelBudget`, so the
operator's series stay bounded whatever names a tenant makes up."""

from __future__ import annotations

DEFAULT_LABEL_VALUES = 20  # values of each kind a namespace may use (the chart's metrics.labelValues)
OTHER = "other"  # the value that every label value past its namespace's budget is folded into
LABEL_VALUE_LIMIT = 256  # characters of a tenant-chosen label value; a longer one is folded into OTHER


def escape_value(v: str) -> str:
    """A label value as Prometheus' text format writes it between its quotes."""
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class LabelBudget:
    """The tenant-chosen label values each namespace may use: the first ``limit`` of each kind
    (``group``: a (definition, template, cronflow) combination; ``model``), in the order the Flows are
    folded in (on a restart, the cache's first list, which the API server returns by name). A value
    once admitted stays for the life of the process, so a series never changes its labels."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: dict[tuple[str, str], set[str]] = {}

    def value(self, namespace: str, kind: str, value: str, *parts: str) -> str:
        """``value`` if it is (or now becomes) one of the namespace's ``kind``, else ``OTHER``; a
        combination passes its ``parts``, each of which must be within ``LABEL_VALUE_LIMIT``."""
        seen = self._seen.setdefault((namespace, kind), set())
        if value in seen:
            return value
        if len(seen) >= self.limit or max(len(part) for part in parts or (value,)) > LABEL_VALUE_LIMIT:
            return OTHER
        seen.add(value)
        return value
