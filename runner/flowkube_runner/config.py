"""The runner's configuration: the environment the operator gives a runner pod."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel

from flowkube_api import constants as c
from flowkube_api.base import parse_money
from flowkube_api.prices import ModelPrice, prices_from_json
from flowkube_api.runspec import RunnerSpec, spec_error_text

ENV_TERMINATION_LOG = c.ENV_TERMINATION_LOG
ENV_STATE_DIR = c.ENV_STATE_DIR
DEFAULT_TERMINATION_LOG = Path("/dev/termination-log")


class ConfigError(Exception):
    """The pod's environment is unusable; ``reason`` says whose fault."""

    def __init__(self, reason: c.Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Camel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class Feedback(_Camel):
    """``FLOWKUBE_FEEDBACK``: the human's answer (or its timeout) a resume run consumes."""

    request_id: str | None = None
    text: str = ""
    timed_out: bool = False
    outcome: str | None = None


class Message(_Camel):
    """The conversation message a run answers (``FLOWKUBE_MESSAGE``)."""

    turn: int
    text: str
    sender: str | None = None


@dataclass(frozen=True)
class RunnerConfig:
    flow: str
    namespace: str
    pod: str
    trigger: c.Trigger
    spec: RunnerSpec  # FLOWKUBE_SPEC, read with the model the operator wrote it with
    feedback: Feedback | None = None
    message: Message | None = None
    prior_total_tokens: int = 0
    prior_cost: Decimal = Decimal(0)
    prices: dict[str, ModelPrice] = field(default_factory=dict)
    termination_log: Path = DEFAULT_TERMINATION_LOG
    state_dir: Path | None = None
    keep_warm_seconds: float = 0.0  # a conversation's pod waits this long for its next message
    feedback_keep_warm_seconds: float = 0.0  # a paused run's pod waits this long for the answer
    quotas: bool = False  # every model request is reserved at the quota desk (the state API) first
    quota_heartbeat_seconds: float = 0.0  # reminders of the reservations held while a call is in flight
    traceparent: str = ""  # the run span's W3C traceparent (tracing on), see flowkube_api.traces
    traces_endpoint: str = ""  # the OTLP/HTTP traces URL (tracing on)
    traces_content: bool = False  # message content kept in spans

    @staticmethod
    def termination_log_from_env(env: Mapping[str, str] | None = None) -> Path:
        env = os.environ if env is None else env
        return Path(env.get(ENV_TERMINATION_LOG, "").strip() or DEFAULT_TERMINATION_LOG)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RunnerConfig:
        env = os.environ if env is None else env

        def required(name: str) -> str:
            value = env.get(name, "").strip()
            if not value:
                raise ConfigError(c.Reason.INTERNAL_ERROR, f"environment variable {name} is not set")
            return value

        flow = required(c.ENV_FLOW_NAME)
        try:
            trigger = c.Trigger(required(c.ENV_TRIGGER))
        except ValueError as e:
            raise ConfigError(c.Reason.INTERNAL_ERROR, f"{c.ENV_TRIGGER}: {e}") from e
        try:
            spec = RunnerSpec.from_env(required(c.ENV_SPEC))
        except ValidationError as e:
            raise ConfigError(_spec_reason(e), f"{c.ENV_SPEC}: {spec_error_text(e)}") from e
        feedback = _optional_json(env, c.ENV_FEEDBACK, Feedback)
        message = _optional_json(env, c.ENV_MESSAGE, Message)
        try:
            prior = int(env.get(c.ENV_PRIOR_TOTAL_TOKENS, "0") or "0")
        except ValueError as e:
            raise ConfigError(c.Reason.INTERNAL_ERROR, f"{c.ENV_PRIOR_TOTAL_TOKENS}: {e}") from e
        try:
            prior_cost = parse_money(env.get(c.ENV_PRIOR_COST, ""))
        except ValueError as e:
            raise ConfigError(c.Reason.INTERNAL_ERROR, f"{c.ENV_PRIOR_COST}: {e}") from None
        try:
            prices = prices_from_json(env.get(c.ENV_PRICES, ""))
        except ValueError as e:
            raise ConfigError(c.Reason.INTERNAL_ERROR, f"{c.ENV_PRICES}: {e}") from e
        state_dir = env.get(ENV_STATE_DIR, "").strip()
        keep_warm = _seconds(env, c.ENV_KEEP_WARM_SECONDS)
        feedback_keep_warm = _seconds(env, c.ENV_FEEDBACK_KEEP_WARM_SECONDS)
        return cls(
            flow=flow,
            namespace=env.get(c.ENV_NAMESPACE, "").strip() or "default",
            pod=required(c.ENV_POD_NAME),
            trigger=trigger,
            spec=spec,
            feedback=feedback,
            message=message,
            prior_total_tokens=prior,
            prior_cost=prior_cost,
            prices=prices,
            termination_log=cls.termination_log_from_env(env),
            state_dir=Path(state_dir) if state_dir else None,
            keep_warm_seconds=keep_warm,
            feedback_keep_warm_seconds=feedback_keep_warm,
            quotas=env.get(c.ENV_QUOTAS, "").strip().lower() == "true",
            quota_heartbeat_seconds=_seconds(env, c.ENV_QUOTA_HEARTBEAT_SECONDS),
            traceparent=env.get(c.ENV_TRACEPARENT, "").strip(),
            traces_endpoint=env.get(c.ENV_TRACES_ENDPOINT, "").strip(),
            traces_content=env.get(c.ENV_TRACES_CONTENT, "").strip().lower() == "true",
        )


# A FLOWKUBE_SPEC the API would have refused fails the run as the field it got wrong; anything else
# (not JSON, no single source, the definition) is the definition's.
_SPEC_REASONS = {"flowRef": c.Reason.INVALID_FLOW_REF, "inputs": c.Reason.INVALID_INPUTS,
                 "budget": c.Reason.INVALID_SPEC}


def _spec_reason(error: ValidationError) -> c.Reason:
    loc = error.errors(include_url=False)[0]["loc"]
    return _SPEC_REASONS.get(str(loc[0]) if loc else "", c.Reason.INVALID_DEFINITION)


def _seconds(env: Mapping[str, str], name: str) -> float:
    try:
        return max(0.0, float(env.get(name, "0") or "0"))
    except ValueError as e:
        raise ConfigError(c.Reason.INTERNAL_ERROR, f"{name}: {e}") from e


M = TypeVar("M", bound=BaseModel)


def _optional_json(env: Mapping[str, str], name: str, model: type[M]) -> M | None:
    if not env.get(name, "").strip():
        return None
    try:
        return model.model_validate(json.loads(env[name]))
    except (ValueError, ValidationError) as e:
        raise ConfigError(c.Reason.INTERNAL_ERROR, f"{name}: {e}") from e
