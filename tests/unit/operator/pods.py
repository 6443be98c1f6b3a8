"""A runner pod built from a Flow body, as the controller builds it from the plan's resolved spec."""

from __future__ import annotations

from typing import Any

from flowkube_api.models import FlowSpec
from flowkube_operator.flows.resources import runner_pod


def pod_of(flow: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    return runner_pod(flow, FlowSpec.model_validate(flow.get("spec") or {}), **kwargs)
