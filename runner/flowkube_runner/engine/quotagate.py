"""Spend quotas at the model call (issue 41): before a model request is sent, its worst case is
reserved at the quota desk (the operator's state API); once the call is counted, the run's charges
settle it. A request whose worst case does not fit a quota is not sent: the run ends
``QuotaExhausted``, with the desk's message.

Where: at the HTTP request, not at crewAI's model-call hooks. crewAI 1.15.30 calls its pre-call hooks
once per call (sometimes before the call's id exists, from the agent executor) and its post-call
hooks only for some answers (not for tool calls, failures or async calls), so a reservation made in
one and freed in the other could leak or go unpaired. Every provider SDK crewAI drives sends through
httpx (``Client.send`` / ``AsyncClient.send``), inside crewAI's call scope (``_current_call_id``):
there each request is reserved, and its reservation is settled

- at once, when the request failed or the provider refused it (nothing was billed);
- when crewAI's completed or failed event for its call has been counted (``UsageRecorder._count``),
  so the charges the settle carries already hold the call: the book never sees the call's
  reservation go before its usage comes;
- at the latest when the recording ends (``settle_all``); a pod lost mid-call leaves its reservations
  to the operator, which frees them when the pod's run ends.

A refused request is answered here with HTTP 402 and ``x-should-retry: false`` (the SDKs then raise
without retrying), and the pre-call hook refuses every later call of the run (crewAI's own
``HookAborted``): the crossing call is the one refused, nothing after it.

The worst case, without a tokenizer (none ships with crewAI 1.15.30, and none can be downloaded in a
pod without network): the request body's bytes, a true upper bound on its prompt tokens (the body
holds the messages, tools and schema, and a BPE or byte-fallback tokenizer never makes more tokens
than bytes), plus its answers' bound: ``max_tokens`` (``max_completion_tokens``,
``max_output_tokens``) times ``n``, or ``DEFAULT_ANSWER_TOKENS`` when the request sets none, priced
as the call would be. The one overshoot left: a model that answers a request with no ``max_tokens``
with more than ``DEFAULT_ANSWER_TOKENS`` tokens (set ``max_tokens`` on the LLM for a hard bound).

Media the body only points at are not in its bytes: an image by URL adds ``REMOTE_IMAGE_TOKENS``
(providers scale an image down before they count it: at most about 1,600 tokens at Anthropic, 1,445
at OpenAI's gpt-4o and about 3,800 at its patch-billed models, 258 per tile at Gemini); a file or
document by URL or by an uploaded file's id (a PDF's pages, an audio file's length) has no bound the
request shows, so under a quota such a request is not sent (pass the file inline: its bytes are then
counted).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from decimal import Decimal
from typing import Any, Protocol

import httpx
from crewai.hooks.dispatch import HookAborted
from crewai.llms.base_llm import _current_call_id

from flowkube_api.report import Charge

from ..store import QuotaRefused
from .pricing import CallTokens, Pricer

log = logging.getLogger("flowkube_runner")

DEFAULT_ANSWER_TOKENS = 16384  # an answer's bound when the request sets no max_tokens
# crewAI's native providers whose SDKs do not send through httpx (boto3, azure-core): not gated, so refused.
UNSEEN_PROVIDERS = (".bedrock.", ".azure.")
# The model of the call being made, as crewAI names it: set by the pre-call hook in the call's context
# (asyncio.to_thread and SDK retries within the call see it; the next call sets its own).
_CALL_MODEL: ContextVar[str | None] = ContextVar("flowkube_call_model", default=None)
ANSWER_BOUNDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
REMOTE_IMAGE_TOKENS = 6000  # an image a request points at (see the docstring): above every provider's own cap
# Content parts that point at media instead of holding it: OpenAI chat ``image_url``, OpenAI responses
# ``input_image`` / ``input_file``, Anthropic ``image`` / ``document`` with a ``url`` or ``file``
# source, Gemini ``fileData`` / ``file_data``.
_IMAGE_PARTS = ("image_url", "input_image", "image")


class UnboundedRequest(QuotaRefused):
    """A request whose worst case its body does not show (a file by reference): not sent under a quota."""


def _remote(value: Any) -> bool:
    return isinstance(value, str) and not value.startswith("data:")


def remote_media(asked: Any) -> int:
    """How many images the request points at (by URL); raises ``UnboundedRequest`` for a file or
    document it points at (by URL or by an uploaded file's id)."""
    images, stack = 0, [asked]
    while stack:  # every node, without recursion: as many as json.loads made of the body, no more
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        raw_source = node.get("source")
        source: dict[str, Any] = raw_source if isinstance(raw_source, dict) else {}
        if kind in _IMAGE_PARTS:
            url = node.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if _remote(url) or (kind == "image" and source.get("type") in ("url", "file")) or node.get("file_id"):
                images += 1
        elif ((kind == "input_file" and (_remote(node.get("file_url")) or node.get("file_id")))
              or (kind == "document" and source.get("type") in ("url", "file"))
              or "fileData" in node or "file_data" in node):
            raise UnboundedRequest(
                "a model request points at a file by URL or by id, whose size (pages, length) the request does "
                "not show: under a FlowQuota its worst case cannot be reserved, so it was not sent (pass the "
                "file inline)")
        stack.extend(v for v in node.values() if isinstance(v, dict | list))
    return images


Held = tuple[int, str, int, Decimal]  # a reservation in flight: (id, model, tokens, cost)


class QuotaDesk(Protocol):
    def reserve(self, model: str, tokens: int, cost: Decimal | None, *, charges: list[Charge] | None = None,
                held: list[Held] | None = None) -> int:
        """A reservation of this worst case (its id, 0: no quota covers the run; ``cost`` None: the
        model has no price); raises ``QuotaRefused``. ``charges``: the run's so far, ``held``: its
        other reservations in flight (a new leader takes them again)."""
        ...

    def settle(self, reservation: int, charges: list[Charge] | None, *, held: list[Held] | None = None) -> None:
        """The call is counted (or was not billed): free the reservation; ``charges`` are the
        run's, all of them so far."""
        ...

    def hold(self, charges: list[Charge] | None, held: list[Held]) -> None:
        """A reminder, while calls are in flight, of the reservations held (a new leader takes them
        again before its recovery ends, however long the calls take)."""
        ...


def worst_case(body: bytes, model: str | None, pricer: Pricer) -> tuple[str, int, Decimal | None]:
    """(model, tokens, cost) a model request may use at most; the cost is None for a model with no price.
    Raises ``UnboundedRequest`` for a request that points at a file (see ``remote_media``)."""
    try:
        asked = json.loads(body) if body else {}
    except ValueError:
        asked = {}  # not JSON (a multipart upload holds its file): its bytes bound it
    except RecursionError:
        raise UnboundedRequest("a model request nested too deeply to be read: under a FlowQuota its worst "
                               "case cannot be reserved, so it was not sent") from None
    asked = asked if isinstance(asked, dict) else {}
    model = model or str(asked.get("model") or "unknown")
    answer = next((v for k in ANSWER_BOUNDS if isinstance(v := asked.get(k), int) and v > 0), DEFAULT_ANSWER_TOKENS)
    n = asked.get("n")
    choices = n if isinstance(n, int) and n > 1 else 1
    prompt, answers = len(body) + remote_media(asked) * REMOTE_IMAGE_TOKENS, answer * choices
    price = pricer.price(model, CallTokens(prompt=prompt, completion=answers))
    return model, prompt + answers, price.cost if price is not None else None


class QuotaGate:
    """The quota side of a run's model calls (see the module's docstring)."""

    def __init__(self, desk: QuotaDesk, pricer: Pricer, charges: Callable[[], list[Charge] | None], *,
                 heartbeat: float = 0.0) -> None:
        self._desk, self._pricer, self._charges = desk, pricer, charges
        self._heartbeat = heartbeat  # seconds between reminders of what is held (0: none)
        self._beating: threading.Thread | None = None  # the reminders' thread, while anything is held
        self._lock = threading.Lock()
        self._held: dict[str, list[int]] = {}  # crewAI call id -> reservations of its answered requests
        self._outstanding: dict[int, Held] = {}  # every reservation not settled yet
        self._asking = threading.local()  # set while this thread asks the desk: its own requests pass
        self.refused: str | None = None  # why a request was refused: the run ends with it

    # -- crewAI's pre-call hook ----------------------------------------------------------------------

    def before(self, ctx: Any) -> None:
        """Once a request was refused no call starts; a provider whose requests the gate cannot see is
        refused (fail closed); else note the call's model as crewAI names it (usage and quotas count it
        under that name; the request body may name it otherwise)."""
        if self.refused is not None:
            raise HookAborted(self.refused, source="flowkube quota")
        llm = getattr(ctx, "llm", None)
        provider = type(llm).__module__
        if any(part in provider for part in UNSEEN_PROVIDERS):
            why = (f"the spend quota cannot see the requests of {type(llm).__name__} ({provider}: it does not "
                   "send through httpx), so it cannot reserve them; under a FlowQuota use a provider that does "
                   "(OpenAI-compatible, Anthropic, Gemini, or LiteLLM)")
            self.refused = why
            raise HookAborted(why, source="flowkube quota")
        _CALL_MODEL.set(getattr(llm, "model", None))

    # -- the HTTP request ----------------------------------------------------------------------------

    def _reserve(self, request: httpx.Request) -> int | httpx.Response:
        """The request's reservation, or the refusal to answer it with."""
        if self.refused is None:
            model = _CALL_MODEL.get()
            try:
                name, tokens, cost = worst_case(request.content, model, self._pricer)
                self._asking.on = True
                try:
                    reservation = self._desk.reserve(name, tokens, cost, charges=self._charges(),
                                                     held=self._in_flight())
                finally:
                    self._asking.on = False
                if reservation:
                    with self._lock:
                        self._outstanding[reservation] = (reservation, name, tokens, cost or Decimal(0))
                        if self._heartbeat > 0 and self._beating is None:
                            self._beating = threading.Thread(target=self._remind, name="quota-heartbeat",
                                                             daemon=True)
                            self._beating.start()
                return reservation
            except Exception as e:
                # Fail closed: a desk that cannot be reached (or any error here) stops the request
                # rather than letting it go unreserved.
                self.refused = str(e) if isinstance(e, QuotaRefused) else (
                    f"the quota desk could not reserve the call ({type(e).__name__}: {e}); it was not sent")
                log.error("quota: a model request was not sent: %s", self.refused)
        return httpx.Response(402, request=request, headers={"x-should-retry": "false"}, json={"error": {
            "message": self.refused, "type": "flowkube_quota_exhausted", "code": "quota_exhausted"}})

    def _answered(self, call_id: str, reservation: int, response: httpx.Response | None) -> None:
        """A reserved request came back: held until its call is counted, or settled now when nothing
        was billed (no answer, or an error status)."""
        if reservation == 0:
            return
        if response is None or response.status_code >= 400:
            self._settle([reservation])
            return
        with self._lock:
            self._held.setdefault(call_id, []).append(reservation)

    def _gated(self, request: httpx.Request) -> str | None:
        """The crewAI call a request is made in, if it is a model request (not the desk's own)."""
        if request.method != "POST" or getattr(self._asking, "on", False):
            return None
        call_id: str | None = _current_call_id.get()
        return call_id

    def send(self, original: Callable[..., httpx.Response], client: httpx.Client, request: httpx.Request,
             *args: Any, **kwargs: Any) -> httpx.Response:
        call_id = self._gated(request)
        if call_id is None:
            return original(client, request, *args, **kwargs)
        reservation = self._reserve(request)
        if isinstance(reservation, httpx.Response):
            return reservation
        response = None
        try:
            response = original(client, request, *args, **kwargs)
            return response
        finally:
            self._answered(call_id, reservation, response)

    async def send_async(self, original: Callable[..., Any], client: httpx.AsyncClient, request: httpx.Request,
                         *args: Any, **kwargs: Any) -> httpx.Response:
        call_id = self._gated(request)
        if call_id is None:
            answer: httpx.Response = await original(client, request, *args, **kwargs)
            return answer
        reservation = await asyncio.to_thread(self._reserve, request)
        if isinstance(reservation, httpx.Response):
            return reservation
        response: httpx.Response | None = None
        try:
            response = await original(client, request, *args, **kwargs)
            return response
        finally:
            await asyncio.to_thread(self._answered, call_id, reservation, response)

    # -- the count -----------------------------------------------------------------------------------

    def counted(self, call_id: str) -> None:
        """crewAI's event for the call was counted (or said it failed unanswered): settle its requests."""
        with self._lock:
            held = self._held.pop(call_id, [])
        if held:
            self._settle(held)

    def settle_all(self) -> None:
        """The recording ends: whatever is still held is settled with the run's final charges."""
        with self._lock:
            held = [r for rs in self._held.values() for r in rs]
            self._held.clear()
        if held:
            self._settle(held)

    def _in_flight(self) -> list[Held]:
        with self._lock:
            return list(self._outstanding.values())

    def _remind(self) -> None:
        """While reservations are held, tell the desk which every ``heartbeat`` seconds: a call longer
        than a new leader's recovery (``quotas.recoverySeconds``, a third of which this is) is then
        reserved there again before the leader lets other calls through. Ends when nothing is held."""
        while True:
            time.sleep(self._heartbeat)  # the interval itself, not a wait for a condition
            with self._lock:
                held = list(self._outstanding.values())
                if not held:
                    self._beating = None
                    return
            self._asking.on = True
            try:
                self._desk.hold(self._charges(), held)
            except Exception:  # the next reminder, or the call's settle, tells it again
                log.warning("quota: could not remind the desk of %d reservation(s) held", len(held), exc_info=True)
            finally:
                self._asking.on = False

    def _settle(self, reservations: list[int]) -> None:
        charges = self._charges()
        with self._lock:
            for reservation in reservations:
                self._outstanding.pop(reservation, None)
        self._asking.on = True
        try:
            for reservation in reservations:
                try:
                    self._desk.settle(reservation, charges, held=self._in_flight())
                except Exception:  # the operator frees it when the run ends; the charges come with its report
                    log.warning("quota: could not settle reservation %s; it is freed when the run ends",
                                reservation, exc_info=True)
        finally:
            self._asking.on = False
