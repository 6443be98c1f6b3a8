"""``FLOWKUBE_SPEC``: the part of a Flow's spec its runner pods read, one model for both sides.

The operator writes it from the validated ``FlowSpec`` (``runner_spec_env``), the admission webhook
sizes exactly that text against the environment bound (``limits.spec_problem``), and the runner
reads it back with the same model (``RunnerSpec.from_env``): the fields are ``FlowSpec``'s own
(``definition``, ``flowRef``, ``inputs``, ``budget``, ``retries``, ``checkpoints``,
``forkFrom``), with the same models and bounds, so a value
the API refuses the runner refuses too, naming the same field.

On the wire it is one compact JSON object, camelCase keys sorted, unset fields left out:
``{"budget":{"maxTotalTokens":5},"flowRef":"pkg.flows:Research","inputs":{"topic":"AI"}}``.
"""

from __future__ import annotations

import json
from typing import Any, Self

from pydantic import ValidationError, model_validator

from flowkube_api.base import Model
from flowkube_api.models import (
    Budget,
    CheckpointsSpec,
    FlowDefinitionSpec,
    FlowRef,
    FlowSpec,
    ForkFrom,
    FreeObject,
    Retries,
)

EXACTLY_ONE_SOURCE = "exactly one of spec.definition or spec.flowRef must be set"  # as the CRD's CEL rule says it


class RunnerSpec(Model):
    """What a run needs of its Flow's spec. Each field is declared as in ``FlowSpec`` (a unit test
    holds the two to the same schema); the CRD's rule that exactly one source is set is checked here
    in Python, since no API server stands between the runner and its environment."""

    definition: FlowDefinitionSpec | None = None
    flow_ref: FlowRef | None = None
    inputs: FreeObject | None = None
    budget: Budget | None = None
    retries: Retries | None = None  # only with keepTasks false, which the runner reads; the rest is the operator's
    checkpoints: CheckpointsSpec | None = None  # only with keep 0: the runner then takes none
    fork_from: ForkFrom | None = None  # a fork's edits, applied once to the checkpoint it copied

    @model_validator(mode="after")
    def _exactly_one_source(self) -> Self:
        if (self.definition is None) == (self.flow_ref is None):
            raise ValueError(EXACTLY_ONE_SOURCE)
        return self

    @classmethod
    def of(cls, spec: FlowSpec) -> RunnerSpec:
        """The runner's part of a validated Flow spec; ``ValidationError`` when it has no single source."""
        retries = spec.retries if spec.retries is not None and not spec.retries.keep_tasks else None
        checkpoints = spec.checkpoints if spec.checkpoints is not None and spec.checkpoints.keep == 0 else None
        return cls(definition=spec.definition, flow_ref=spec.flow_ref, inputs=spec.inputs, budget=spec.budget,
                   retries=retries, checkpoints=checkpoints, fork_from=spec.fork_from)

    @classmethod
    def from_env(cls, text: str) -> RunnerSpec:
        """``FLOWKUBE_SPEC`` as the runner reads it; ``ValidationError`` (``spec_error_text`` names the field)."""
        return cls.model_validate_json(text)

    def env(self) -> str:
        """The value of ``FLOWKUBE_SPEC``: what the pod gets, and what the size bound measures."""
        return json.dumps(self.dump(), separators=(",", ":"), sort_keys=True)

    def definition_document(self) -> dict[str, Any] | None:
        """The inline definition as written, for crewAI's own ``FlowDefinition`` model."""
        return self.definition.model_dump(mode="json", by_alias=True) if self.definition is not None else None


def runner_spec_env(spec: FlowSpec) -> str:
    """``FLOWKUBE_SPEC`` of the runner pods of a Flow with this (validated) spec."""
    return RunnerSpec.of(spec).env()


def spec_error_text(error: ValidationError) -> str:
    """A spec's validation errors, each naming its field as the API does (``spec.budget.maxTotalTokens: ...``)."""
    parts = []
    for e in error.errors(include_url=False):
        field = ".".join(["spec", *(str(p) for p in e["loc"])])
        msg = "required" if e["type"] == "missing" else e["msg"].removeprefix("Value error, ")
        parts.append(f"{field}: {msg}")
    return "; ".join(parts)


__all__ = ["EXACTLY_ONE_SOURCE", "RunnerSpec", "runner_spec_env", "spec_error_text"]
