"""Model calls: what they cost (crewAI's ``LLMCallCompletedEvent``, priced by ``pricing`` when each
completes), and which may start (the token and money budgets, a stopping runner), through crewAI's
model-call hooks."""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from decimal import Decimal
from typing import Any

import httpx
from crewai.events.event_bus import crewai_event_bus
from crewai.events.types.llm_events import LLMCallCompletedEvent, LLMCallFailedEvent
from crewai.hooks.dispatch import HookAborted, InterceptionPoint, register, unregister
from crewai.llms.base_llm import _current_call_id
from crewai.types.usage_metrics import UsageMetrics

from flowkube_api.base import money_text
from flowkube_api.models import Budget, BudgetLimit
from flowkube_api.report import CHARGES_LIMIT, Charge, TokenUsage, Usage
from flowkube_api.windows import bucket_of

from .pricing import CallTokens, Price, Pricer
from .quotagate import QuotaDesk, QuotaGate

log = logging.getLogger("flowkube_runner")

STOP_MESSAGE = "the runner is stopping: no new model call starts"


class UsageRecorder:
    """Per-run token totals and spend from crewAI's ``LLMCallCompletedEvent``, the budgets, and the stop.

    Each call is priced when its event is handled, at the time the call completed (``Pricer``); a
    call whose model has no price adds its tokens to that model's ``unpriced_tokens`` and no cost.
    The budgets (``maxTotalTokens``, ``maxCost``) count earlier runs (``prior_*``) too: a call that
    crosses one is counted and ends the run, and once one is reached no further call starts (the
    rule is ``Budget.exceeded_by``, the same the operator applies before it starts a run).

    The bus runs handlers on a worker pool, so every reading flushes it first: a handler still
    queued would otherwise drop its call's tokens from the report. ``on_call`` runs in the handler
    after each counted call (the run keeps an interim report current with it).

    A call the provider answered but crewAI then failed (a structured answer it could not parse, as
    a conversational router's can be) gets no completed event, only a failed one, without usage; the
    provider billed it all the same. So while recording, every model HTTP answer's ``usage`` is kept
    under crewAI's call id (``answered``), and a failed event whose call was answered counts it.

    ``stop``, once set (SIGTERM), refuses every model call that has not started yet; a call in
    flight is not touched, finishes, and is counted like any other. ``stopped`` then says a call
    was refused for it.
    """

    def __init__(  # noqa: PLR0913 - keyword-only, each a part of the run the recorder answers to
        self,
        *,
        prior_total_tokens: int = 0,
        prior_cost: Decimal = Decimal(0),
        budget: Budget | None = None,
        pricer: Pricer | None = None,
        on_call: Callable[[UsageRecorder], None] | None = None,
        stop: threading.Event | None = None,
        quota: QuotaDesk | None = None,
        quota_heartbeat: float = 0.0,
        on_counted: Callable[[str, UsageMetrics, Decimal | None], None] | None = None,
    ) -> None:
        self._prior = prior_total_tokens
        self._prior_cost = prior_cost
        self._budget = budget or Budget()
        self._pricer = pricer or Pricer()
        self._on_call = on_call
        self._on_counted = on_counted  # each call as counted (its crewAI call id): the trace's figures
        self._stop = stop
        self._lock = threading.Lock()
        self._totals = UsageMetrics()
        self._by_model: dict[str, UsageMetrics] = {}
        self._cost = Decimal(0)
        self._cost_by_model: dict[str, Decimal] = {}
        self._unpriced_by_model: dict[str, int] = {}
        # (quarter hour, model) -> (tokens, cost) of the calls made then: what quota windows charge
        self._charges: dict[tuple[dt.datetime, str], tuple[int, Decimal]] = {}
        self._crossed: BudgetLimit | None = None  # which budget ended the run
        self._answered: dict[str, dict[str, Any]] = {}  # crewAI call id -> the provider's usage of its answer
        self.exceeded = False
        self.stopped = False
        # Spend quotas: each call's worst case reserved before it is sent, settled after (quotagate.py).
        self.quota = QuotaGate(quota, self._pricer, self.charges, heartbeat=quota_heartbeat) if quota is not None \
            else None

    def _price(self, model: str, metrics: UsageMetrics, event: Any) -> Price | None:
        tokens = CallTokens(prompt=metrics.prompt_tokens, completion=metrics.completion_tokens,
                            cached_prompt=metrics.cached_prompt_tokens,
                            cache_creation=metrics.cache_creation_tokens)
        try:
            return self._pricer.price(model, tokens, getattr(event, "timestamp", None))
        except Exception:  # pricing must never lose a call's tokens: unpriced, and said loudly
            log.exception("could not price a call of model %r; its tokens count as unpriced", model)
            return None

    def _on_llm_call_completed(self, _source: Any, event: LLMCallCompletedEvent) -> None:
        with self._lock:
            self._answered.pop(getattr(event, "call_id", ""), None)
        self._count(event.model, event.usage, event)
        self._settle_call(event)

    def _on_llm_call_failed(self, _source: Any, event: LLMCallFailedEvent) -> None:
        with self._lock:
            usage = self._answered.pop(event.call_id, None)
        if usage is not None:  # answered (and billed), then failed inside crewAI
            log.warning("model %s answered a call crewAI then failed (%s); its tokens count", event.model,
                        event.error[:200])
            self._count(event.model, usage, event)
        self._settle_call(event)

    def _settle_call(self, event: Any) -> None:
        """The call's quota reservations settle once it is counted (or failed unbilled)."""
        if self.quota is not None:
            self.quota.counted(str(getattr(event, "call_id", "")))

    def note_answer(self, usage: dict[str, Any]) -> None:
        """The provider answered the model call in progress on this thread (with this usage, in
        the provider's own shape: OpenAI's nests reasoning tokens, which crewAI reads flat)."""
        call_id = _current_call_id.get()
        if call_id is None:
            return
        details = usage.get("completion_tokens_details")
        if isinstance(details, dict) and "reasoning_tokens" not in usage:
            usage = {**usage, "reasoning_tokens": details.get("reasoning_tokens") or 0}
        with self._lock:
            self._answered[call_id] = usage

    def _count(self, model_name: str | None, usage: dict[str, Any] | None, event: Any) -> None:
        metrics = UsageMetrics.from_provider_dict(usage)
        if metrics is None:
            return
        model = model_name or "unknown"
        price = self._price(model, metrics, event)
        with self._lock:
            self._totals.add_usage_metrics(metrics)
            self._by_model.setdefault(model, UsageMetrics()).add_usage_metrics(metrics)
            if price is None:
                self._unpriced_by_model[model] = self._unpriced_by_model.get(model, 0) + metrics.total_tokens
            else:
                self._cost += price.cost
                self._cost_by_model[model] = self._cost_by_model.get(model, Decimal(0)) + price.cost
            slot = (bucket_of(_when(event)), model)
            tokens, cost = self._charges.get(slot, (0, Decimal(0)))
            self._charges[slot] = (tokens + metrics.total_tokens, cost + (price.cost if price is not None else 0))
            self._bound_charges_locked()
            self._check_locked(before_call=False)
        if self._on_counted is not None:
            self._on_counted(str(getattr(event, "call_id", "") or ""), metrics,
                             price.cost if price is not None else None)
        if self._on_call is not None:
            self._on_call(self)

    def _budgeted(self) -> bool:
        return self._budget.max_total_tokens is not None or self._budget.max_cost is not None

    def _check_locked(self, *, before_call: bool) -> bool:
        """Whether a budget is crossed (after a call) or reached (before one: any call adds to it);
        marks the run exceeded and remembers which. The caller holds the lock."""
        tokens, cost = self._prior + self._totals.total_tokens, self._prior_cost + self._cost
        crossed = self._budget.exceeded_by(tokens, cost, starting=before_call)
        if crossed is not None:
            self.exceeded = True
            self._crossed = self._crossed or crossed
        return crossed is not None

    def _over(self, *, before_call: bool) -> bool:
        if not self._budgeted():
            return False
        crewai_event_bus.flush()
        with self._lock:
            return self._check_locked(before_call=before_call)

    def budget_message(self) -> str:
        usage = self.usage()
        limit = self._crossed or ("maxTotalTokens" if self._budget.max_total_tokens is not None else "maxCost")
        figure = self._budget.figure(limit, self._prior + usage.total_tokens, self._prior_cost + usage.cost)
        if limit == "maxCost":
            return (f"money budget exceeded: {figure} (USD {money_text(self._prior_cost)} in earlier runs + "
                    f"{money_text(usage.cost)} in this run)")
        return f"token budget exceeded: {figure} ({self._prior} in earlier runs + {usage.total_tokens} in this run)"

    def _check_before_call(self, _ctx: Any) -> None:
        if self._stop is not None and self._stop.is_set():
            if not self.stopped:
                log.warning("%s", STOP_MESSAGE)
            self.stopped = True
            raise HookAborted(STOP_MESSAGE, source="flowkube stop")
        if self._over(before_call=True):
            raise HookAborted(self.budget_message(), source="flowkube budget")

    def _check_after(self, _ctx: Any) -> None:
        if self._over(before_call=False):
            raise HookAborted(self.budget_message(), source="flowkube budget")

    def budget_already_spent(self) -> bool:
        """Earlier runs reached a budget: this run may make no call at all."""
        with self._lock:
            return self._check_locked(before_call=True)

    def _hooks(self) -> list[tuple[InterceptionPoint, Callable[[Any], None]]]:
        hooks: list[tuple[InterceptionPoint, Callable[[Any], None]]] = []
        if self._budgeted() or self._stop is not None:
            hooks.append((InterceptionPoint.PRE_MODEL_CALL, self._check_before_call))
        if self.quota is not None:  # after the budget's check; the reservations are made at the request
            hooks.append((InterceptionPoint.PRE_MODEL_CALL, self.quota.before))
        if self._budgeted():
            hooks.append((InterceptionPoint.POST_MODEL_CALL, self._check_after))
            hooks.append((InterceptionPoint.POST_STEP, self._check_after))
        return hooks

    @contextmanager
    def recording(self) -> Iterator[UsageRecorder]:
        self._pricer.load()  # the price table, before the first call needs it
        crewai_event_bus.on(LLMCallCompletedEvent)(self._on_llm_call_completed)
        crewai_event_bus.on(LLMCallFailedEvent)(self._on_llm_call_failed)
        hooks = self._hooks()
        for point, hook in hooks:
            register(point, hook)
        try:
            with _answers_noted(self):
                yield self
        finally:
            crewai_event_bus.flush()
            if self.quota is not None:
                self.quota.settle_all()
            for point, hook in hooks:
                unregister(point, hook)
            crewai_event_bus.off(LLMCallCompletedEvent, self._on_llm_call_completed)
            crewai_event_bus.off(LLMCallFailedEvent, self._on_llm_call_failed)

    def usage(self) -> Usage:
        crewai_event_bus.flush()
        with self._lock:
            self._check_locked(before_call=False)
        return self.recorded()

    def counted(self) -> tuple[Usage, list[Charge] | None]:
        """``usage()`` (the bus flushed, the budget checked) with its charges, read at one moment."""
        self.usage()
        return self.recorded_with_charges()

    def charges(self) -> list[Charge] | None:
        """The calls counted so far by quarter hour and model, oldest first (None: no call; or, past
        ``CHARGES_LIMIT`` entries that cannot be merged, none: the quotas then charge the run's usage
        at its end)."""
        return self.recorded_with_charges()[1]

    def recorded_with_charges(self) -> tuple[Usage, list[Charge] | None]:
        """``recorded()`` and ``charges()`` read at one moment, so they add up (a call counted between
        two readings would make the operator refuse the charges)."""
        with self._lock:
            usage = self._recorded_locked()
            entries = sorted(self._charges.items())
        if len(entries) > CHARGES_LIMIT:
            return usage, None
        return usage, [Charge(at=at, model=model, total_tokens=tokens, cost=cost)
                       for (at, model), (tokens, cost) in entries] or None

    def _bound_charges_locked(self) -> None:
        """Past ``CHARGES_LIMIT`` entries (a run of days), a model's oldest quarter hour is merged into
        its next one: those calls then count a little later than they were made."""
        if len(self._charges) <= CHARGES_LIMIT:
            return
        by_model: dict[str, list[dt.datetime]] = {}
        for at, model in self._charges:
            by_model.setdefault(model, []).append(at)
        model, times = max(by_model.items(), key=lambda kv: len(kv[1]))
        if len(times) >= 2:
            first, second = sorted(times)[:2]
            t1, c1 = self._charges.pop((first, model))
            t2, c2 = self._charges[(second, model)]
            self._charges[(second, model)] = (t1 + t2, c1 + c2)

    def recorded(self) -> Usage:
        """What the handlers have counted so far, without flushing the bus: safe inside a handler,
        where a flush would wait for the very handler calling it."""
        with self._lock:
            return self._recorded_locked()

    def _recorded_locked(self) -> Usage:
        totals = _tokens(self._totals, self._cost, sum(self._unpriced_by_model.values()))
        by_model = {m: _tokens(u, self._cost_by_model.get(m, Decimal(0)), self._unpriced_by_model.get(m, 0))
                    for m, u in self._by_model.items()}
        return Usage(**totals.model_dump(), by_model=by_model)


def _when(event: Any) -> dt.datetime:
    """When a call completed: its event's time (crewAI's, naive local or aware), else now."""
    stamp = getattr(event, "timestamp", None)
    if isinstance(stamp, dt.datetime):
        return stamp if stamp.tzinfo is not None else stamp.astimezone(dt.UTC)
    return dt.datetime.now(dt.UTC)


@contextmanager
def _answers_noted(recorder: UsageRecorder) -> Iterator[None]:
    """Hand the ``usage`` of every non-streamed JSON answer of an HTTP call made inside a model call
    to ``recorder.note_answer`` (the provider SDKs crewAI drives send through httpx's ``Client.send``),
    and pass every request through the run's quota gate, if it has one (``AsyncClient.send`` too)."""
    original, original_async = httpx.Client.send, httpx.AsyncClient.send
    gate = recorder.quota

    def send(client: httpx.Client, request: httpx.Request, *args: Any, **kwargs: Any) -> httpx.Response:
        response = (original(client, request, *args, **kwargs) if gate is None
                    else gate.send(original, client, request, *args, **kwargs))
        if (_current_call_id.get() is not None and not kwargs.get("stream")
                and "json" in response.headers.get("content-type", "")):
            try:
                usage = response.json().get("usage")
            except Exception:  # not ours to judge: the SDK reads the answer itself
                usage = None
            if isinstance(usage, dict):
                recorder.note_answer(usage)
        return response

    async def send_async(client: httpx.AsyncClient, request: httpx.Request, *args: Any,
                         **kwargs: Any) -> httpx.Response:
        assert gate is not None
        return await gate.send_async(original_async, client, request, *args, **kwargs)

    httpx.Client.send = send  # type: ignore[method-assign,assignment]
    if gate is not None:
        httpx.AsyncClient.send = send_async  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        httpx.Client.send = original  # type: ignore[method-assign]
        httpx.AsyncClient.send = original_async  # type: ignore[method-assign]


def _tokens(metrics: UsageMetrics, cost: Decimal, unpriced_tokens: int) -> TokenUsage:
    return TokenUsage(
        cost=cost,
        unpriced_tokens=unpriced_tokens,
        total_tokens=metrics.total_tokens,
        prompt_tokens=metrics.prompt_tokens,
        completion_tokens=metrics.completion_tokens,
        cached_prompt_tokens=metrics.cached_prompt_tokens,
        reasoning_tokens=metrics.reasoning_tokens,
        cache_creation_tokens=metrics.cache_creation_tokens,
        successful_requests=metrics.successful_requests,
    )
