"""What one model call costs, priced when it is made (crewAI-free).

Overrides first (``FLOWKUBE_PRICES``, see ``flowkube_api.prices``: the model's name matched exactly),
then the price table bundled with the pinned ``genai-prices`` package at the call's time. The table is
only ever the bundled one: its network update (``UpdatePrices``) is never started, so a run is priced
with the snapshot of the genai-prices version in the runner image, and a later price change never
rewrites what a finished run cost.

A call is priced by its parts, each at its own rate where the table (or the override) has one:
prompt tokens not read from or written to a cache, cached prompt tokens (cache reads), cache-creation
tokens (cache writes) and completion tokens (reasoning tokens are part of them, and billed as
output). crewAI's prompt count includes the cached and cache-creation tokens, which is what
genai-prices' ``input_tokens`` means too. A tiered price (by prompt size) is chosen per call.

A model with no price anywhere gets ``None``: the caller counts its tokens as unpriced, never as free;
it is logged once per model.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from flowkube_api.prices import ModelPrice

log = logging.getLogger("flowkube_runner")

# genai-prices resolves "<provider>/<model>" refs (litellm's, and crewAI's for providers it reaches
# through litellm) to that provider when the table knows it, and a bare model name by the
# providers' model patterns; a provider the table does not know ("ollama/llama3") stays unpriced.
_PROVIDER_HINT = "litellm"


@dataclass(frozen=True)
class CallTokens:
    """One call's tokens as crewAI counts them (``prompt`` includes ``cached_prompt`` and
    ``cache_creation``)."""

    prompt: int
    completion: int
    cached_prompt: int = 0
    cache_creation: int = 0


@dataclass(frozen=True)
class Price:
    """A call's cost in USD, and what priced it (``override`` or ``genai-prices <provider>/<model>``)."""

    cost: Decimal
    source: str


class Pricer:
    """Prices calls: overrides, else the bundled genai-prices table; ``None`` when neither knows the model."""

    def __init__(self, overrides: Mapping[str, ModelPrice] | None = None) -> None:
        self._overrides = dict(overrides or {})
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def load(self) -> None:
        """Load the table now, before the first call needs it (0.3 to 0.8 s in a bare process, about
        0.06 s once crewAI is loaded, which imports most of what it needs)."""
        from genai_prices import data_snapshot

        data_snapshot.get_snapshot()

    def price(self, model: str, tokens: CallTokens, at: datetime | None = None) -> Price | None:
        override = self._overrides.get(model)
        if override is not None:
            cost = override.cost(prompt_tokens=tokens.prompt, completion_tokens=tokens.completion,
                                 cached_prompt_tokens=tokens.cached_prompt,
                                 cache_creation_tokens=tokens.cache_creation)
            return Price(cost, "override")
        try:
            return _table_price(model, tokens, at or datetime.now(UTC))
        except LookupError:
            self._unpriced(model, "neither FLOWKUBE_PRICES nor the genai-prices table has a price for it")
        except ValueError as e:  # usage the table refuses (it should not happen with crewAI's counts)
            self._unpriced(model, f"genai-prices could not price the call: {e}")
        return None

    def _unpriced(self, model: str, why: str) -> None:
        with self._lock:
            if model in self._warned:
                return
            self._warned.add(model)
        log.warning("model %r is unpriced: %s; its tokens are counted as unpriced tokens, not as free. "
                    "The operator setting FLOWKUBE_RUNNER_PRICES can price it", model, why)


def _table_price(model: str, tokens: CallTokens, at: datetime) -> Price:
    from genai_prices import Usage, calc_price

    cached, creation = tokens.cached_prompt, tokens.cache_creation
    usage = Usage(
        # Never fewer prompt tokens than its cached parts (genai-prices refuses that).
        input_tokens=max(tokens.prompt, cached + creation),
        output_tokens=tokens.completion,
        cache_read_tokens=cached,
        cache_write_tokens=creation,
    )
    at = at if at.tzinfo is not None else at.replace(tzinfo=UTC)
    calc = calc_price(usage, model, provider_id=_PROVIDER_HINT, genai_request_timestamp=at)
    return Price(calc.total_price, f"genai-prices {calc.provider.id}/{calc.model.id}")
