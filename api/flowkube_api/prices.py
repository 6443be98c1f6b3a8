"""Price overrides: per-million-token prices (USD) by model name, for what the genai-prices table
cannot know (self-hosted or private models) or prices differently from what you pay (negotiated
discounts).

The operator setting ``FLOWKUBE_RUNNER_PRICES`` and the runner's ``FLOWKUBE_PRICES`` hold the same
JSON object; both sides validate it with ``parse_prices``, so a malformed override stops the operator
at start-up (naming the model) and never reaches a runner::

    {"my-llama": {"prompt": "0.20", "completion": "0.60", "cachedPrompt": "0.05", "cacheCreation": "0.25"}}

Prices are decimal strings. ``cachedPrompt`` and ``cacheCreation`` default to ``prompt``. A model is
named as ``status.usage.byModel`` names it (crewAI's model name, e.g. ``gpt-4o-mini`` or
``ollama/llama3``), and matched exactly.

Pydantic only: imported by both sides.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from decimal import Decimal
from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, ValidationError

from flowkube_api.base import Model, Money

PER_TOKENS = Decimal(1_000_000)  # override prices are per million tokens


class ModelPrice(Model):
    """What one model costs, in USD per million tokens of each kind."""

    model_config = ConfigDict(extra="forbid")

    prompt: Money
    completion: Money
    cached_prompt: Money | None = None
    cache_creation: Money | None = None

    def cost(self, *, prompt_tokens: int, completion_tokens: int, cached_prompt_tokens: int = 0,
             cache_creation_tokens: int = 0) -> Decimal:
        """One call's cost. ``prompt_tokens`` counts every prompt token (crewAI's count), cached reads
        and cache writes included; those two are priced at their own rates, the rest at ``prompt``."""
        cached = self.prompt if self.cached_prompt is None else self.cached_prompt
        creation = self.prompt if self.cache_creation is None else self.cache_creation
        plain = max(prompt_tokens - cached_prompt_tokens - cache_creation_tokens, 0)
        total = (plain * self.prompt + cached_prompt_tokens * cached + cache_creation_tokens * creation
                 + completion_tokens * self.completion)
        return total / PER_TOKENS


FIELDS = "prompt, completion, cachedPrompt, cacheCreation"


def _error_text(error: ValidationError) -> str:
    parts = []
    for e in error.errors():
        field = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            msg = f"unknown field (the fields are {FIELDS})"
        elif e["type"] == "missing":
            msg = "required"
        else:
            msg = f"{e['msg'].removeprefix('Value error, ')}, got {e['input']!r}"
        parts.append(f"{field}: {msg}" if field else msg)
    return "; ".join(parts)


def parse_prices(raw: Mapping[str, Any]) -> dict[str, ModelPrice]:
    """The overrides, validated; a bad entry raises ``ValueError`` naming the model and the field."""
    prices: dict[str, ModelPrice] = {}
    for model, price in raw.items():
        if not isinstance(model, str) or not model.strip():
            raise ValueError(f"price override for model {model!r}: a model name is a non-empty string")
        if not isinstance(price, Mapping):
            raise ValueError(f"price override for model {model!r}: expected an object such as "
                             '{"prompt": "0.20", "completion": "0.60"}')
        try:
            prices[model] = ModelPrice.model_validate(price)
        except ValidationError as e:
            raise ValueError(f"price override for model {model!r}: {_error_text(e)}") from None
    return prices


def prices_from_json(text: str) -> dict[str, ModelPrice]:
    """``FLOWKUBE_PRICES`` as the runner reads it ("" or "{}": no overrides)."""
    if not text.strip():
        return {}
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("expected a JSON object of model name -> prices")
    return parse_prices(raw)


def prices_json(raw: Mapping[str, Mapping[str, str]]) -> str:
    """The overrides as the operator hands them to a runner (compact, stable)."""
    return json.dumps(raw, separators=(",", ":"), sort_keys=True)


def _checked(raw: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    parse_prices(raw)
    return raw


# The operator's setting: kept as the JSON it was given (what runners receive), checked at start-up.
PriceOverrides = Annotated[dict[str, dict[str, str]], AfterValidator(_checked)]
