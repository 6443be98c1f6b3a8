"""Spend quotas at the model call (issue 41): before a call is sent, its worst case is reserved at the
quota desk (the operator's state API); after it answered, the run's charges settle it. A call whose
worst case does not fit a quota is not sent: the run ends ``QuotaExhausted``, with the desk's message.

The worst case of a call, without a tokenizer (none ships with crewAI 1.15.30, and none can be
downloaded in a pod without network): its prompt's UTF-8 bytes, a true upper bound on its tokens
(a BPE or byte-fallback tokenizer never makes more tokens than bytes), plus the answer's bound, the
model's ``max_tokens`` (``max_completion_tokens``) or ``DEFAULT_ANSWER_TOKENS`` when it sets none,
priced as the call would be. The desk is the state API (``StateApiStore.reserve``/``settle``); not
wired into a run yet: a run has a desk only in tests.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from decimal import Decimal
from typing import Any, Protocol

from crewai.events.event_bus import crewai_event_bus
from crewai.hooks.dispatch import HookAborted

from flowkube_api.report import Charge

from ..store import QuotaRefused
from .pricing import CallTokens, Pricer

log = logging.getLogger("flowkube_runner")

DEFAULT_ANSWER_TOKENS = 16384  # an answer's bound when the model sets no max_tokens


class QuotaDesk(Protocol):
    def reserve(self, model: str, tokens: int, cost: Decimal | None) -> int:
        """A reservation of this worst case (its id; ``cost`` None: the model has no price); raises
        ``QuotaRefused``."""
        ...

    def settle(self, reservation: int, charges: list[Charge] | None) -> None:
        """The call answered: free the reservation; ``charges`` are the run's, all of them so far."""
        ...


def worst_case(llm: Any, messages: Any, pricer: Pricer) -> tuple[str, int, Decimal | None]:
    """(model, tokens, cost) a call may use at most; the cost is None for a model with no price."""
    model = str(getattr(llm, "model", None) or "unknown")
    prompt = len(json.dumps(messages, default=str, ensure_ascii=False).encode("utf-8"))
    answer = getattr(llm, "max_tokens", None) or getattr(llm, "max_completion_tokens", None) or DEFAULT_ANSWER_TOKENS
    answer = int(answer) if isinstance(answer, int | float | str) and str(answer).isdigit() else DEFAULT_ANSWER_TOKENS
    price = pricer.price(model, CallTokens(prompt=prompt, completion=answer))
    return model, prompt + answer, price.cost if price is not None else None


class QuotaGate:
    """The model-call hooks of a run with a quota desk: reserve before, settle after (per thread: a
    call's hooks run on its thread, and parallel branches each hold their own)."""

    def __init__(self, desk: QuotaDesk, pricer: Pricer, charges: Callable[[], list[Charge] | None]) -> None:
        self._desk, self._pricer, self._charges = desk, pricer, charges
        self._held = threading.local()
        self.refused: str | None = None  # why a call was refused: the run ends with it

    def before(self, ctx: Any) -> None:
        model = "unknown"
        try:
            model, tokens, cost = worst_case(getattr(ctx, "llm", None), getattr(ctx, "messages", None), self._pricer)
            reservation = self._desk.reserve(model, tokens, cost)
        except Exception as e:
            # Fail closed: crewAI sends the call when a hook raises anything but HookAborted, so a desk
            # that cannot be reached (or any error here) must stop the call, not let it go unreserved.
            why = str(e) if isinstance(e, QuotaRefused) else (
                f"the quota desk could not reserve the call ({type(e).__name__}: {e}); it was not sent")
            self.refused = why
            log.error("quota: the call to %s was not sent: %s", model, why)
            raise HookAborted(why, source="flowkube quota") from e
        stack: list[int] = getattr(self._held, "stack", [])
        self._held.stack = [*stack, reservation]

    def after(self, _ctx: Any) -> None:
        stack: list[int] = getattr(self._held, "stack", [])
        if not stack:
            return
        self._held.stack = stack[:-1]
        crewai_event_bus.flush()  # the call is counted before the run's charges are read
        self._desk.settle(stack[-1], self._charges())
