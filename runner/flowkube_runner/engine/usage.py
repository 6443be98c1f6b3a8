"""Model calls: what they cost (crewAI's ``LLMCallCompletedEvent``), and which may start (the token
budget, a stopping runner), through crewAI's model-call hooks."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from crewai.events.event_bus import crewai_event_bus
from crewai.events.types.llm_events import LLMCallCompletedEvent
from crewai.hooks.dispatch import HookAborted, InterceptionPoint, register, unregister
from crewai.types.usage_metrics import UsageMetrics

from flowkube_api.report import TokenUsage, Usage

log = logging.getLogger("flowkube_runner")

STOP_MESSAGE = "the runner is stopping: no new model call starts"


class UsageRecorder:
    """Per-run token totals from crewAI's ``LLMCallCompletedEvent``, the token budget, and the stop.

    The bus runs handlers on a worker pool, so every reading flushes it first: a handler still
    queued would otherwise drop its call's tokens from the report. ``on_call`` runs in the handler
    after each counted call (the run keeps an interim report current with it).

    ``stop``, once set (SIGTERM), refuses every model call that has not started yet; a call in
    flight is not touched, finishes, and is counted like any other. ``stopped`` then says a call
    was refused for it.
    """

    def __init__(
        self,
        *,
        prior_total_tokens: int = 0,
        max_total_tokens: int | None = None,
        on_call: Callable[[UsageRecorder], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self._prior = prior_total_tokens
        self._cap = max_total_tokens
        self._on_call = on_call
        self._stop = stop
        self._lock = threading.Lock()
        self._totals = UsageMetrics()
        self._by_model: dict[str, UsageMetrics] = {}
        self.exceeded = False
        self.stopped = False

    def _on_llm_call_completed(self, _source: Any, event: LLMCallCompletedEvent) -> None:
        metrics = UsageMetrics.from_provider_dict(event.usage)
        if metrics is None:
            return
        model = event.model or "unknown"
        with self._lock:
            self._totals.add_usage_metrics(metrics)
            self._by_model.setdefault(model, UsageMetrics()).add_usage_metrics(metrics)
            if self._cap is not None and self._prior + self._totals.total_tokens > self._cap:
                self.exceeded = True
        if self._on_call is not None:
            self._on_call(self)

    def _over(self, *, before_call: bool) -> bool:
        if self._cap is None:
            return False
        crewai_event_bus.flush()
        with self._lock:
            spent = self._prior + self._totals.total_tokens
        # Before a call, reaching the cap is enough: any call adds tokens and would cross it.
        return bool(spent >= self._cap if before_call else spent > self._cap)

    def budget_message(self) -> str:
        return (
            f"token budget exceeded: {self._prior} tokens from earlier runs + "
            f"{self.usage().total_tokens} in this run > maxTotalTokens {self._cap}"
        )

    def _check_before_call(self, _ctx: Any) -> None:
        if self._stop is not None and self._stop.is_set():
            if not self.stopped:
                log.warning("%s", STOP_MESSAGE)
            self.stopped = True
            raise HookAborted(STOP_MESSAGE, source="flowkube stop")
        if self._over(before_call=True):
            self.exceeded = True
            raise HookAborted(self.budget_message(), source="flowkube budget")

    def _check_after(self, _ctx: Any) -> None:
        if self._over(before_call=False):
            self.exceeded = True
            raise HookAborted(self.budget_message(), source="flowkube budget")

    def budget_already_spent(self) -> bool:
        return self._cap is not None and self._prior >= self._cap

    def _hooks(self) -> list[tuple[InterceptionPoint, Callable[[Any], None]]]:
        hooks: list[tuple[InterceptionPoint, Callable[[Any], None]]] = []
        if self._cap is not None or self._stop is not None:
            hooks.append((InterceptionPoint.PRE_MODEL_CALL, self._check_before_call))
        if self._cap is not None:
            hooks.append((InterceptionPoint.POST_MODEL_CALL, self._check_after))
            hooks.append((InterceptionPoint.POST_STEP, self._check_after))
        return hooks

    @contextmanager
    def recording(self) -> Iterator[UsageRecorder]:
        crewai_event_bus.on(LLMCallCompletedEvent)(self._on_llm_call_completed)
        hooks = self._hooks()
        for point, hook in hooks:
            register(point, hook)
        try:
            yield self
        finally:
            crewai_event_bus.flush()
            for point, hook in hooks:
                unregister(point, hook)
            crewai_event_bus.off(LLMCallCompletedEvent, self._on_llm_call_completed)

    def usage(self) -> Usage:
        crewai_event_bus.flush()
        usage = self.recorded()
        if self._cap is not None and self._prior + usage.total_tokens > self._cap:
            self.exceeded = True
        return usage

    def recorded(self) -> Usage:
        """What the handlers have counted so far, without flushing the bus: safe inside a handler,
        where a flush would wait for the very handler calling it."""
        with self._lock:
            totals = self._totals.model_copy()
            by_model = {m: u.model_copy() for m, u in self._by_model.items()}
        return Usage(**_tokens(totals).model_dump(), by_model={m: _tokens(u) for m, u in by_model.items()})


def _tokens(metrics: UsageMetrics) -> TokenUsage:
    return TokenUsage(
        total_tokens=metrics.total_tokens,
        prompt_tokens=metrics.prompt_tokens,
        completion_tokens=metrics.completion_tokens,
        cached_prompt_tokens=metrics.cached_prompt_tokens,
        reasoning_tokens=metrics.reasoning_tokens,
        cache_creation_tokens=metrics.cache_creation_tokens,
        successful_requests=metrics.successful_requests,
    )
