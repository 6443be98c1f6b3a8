"""Admission: refuse bad Flows and bad feedback at `kubectl` time, and record who answered.

TLS is self-managed: the operator makes its own CA and serving certificate at start-up and kopf
writes the CA bundle into the webhook configurations it manages (no cert-manager needed).
The decisions themselves are pure functions, tested without a cluster.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import kopf
from aiohttp import web

from flowkube_api import cron, limits, templates
from flowkube_api.models import ConversationStatus, FeedbackRequest
from flowkube_operator.flows.refusals import validate_message, validate_response
from flowkube_operator.kube.client import Kube
from flowkube_operator.templates.cache import TemplateKey

Body = Mapping[str, Any]
log = logging.getLogger("flowkube.webhook")


# The two fields people write: (status section, inbox field) of a feedback answer and of a message.
FEEDBACK_INBOX = ("feedback", "response")
MESSAGE_INBOX = ("conversation", "inbox")


def _status_without_inbox(status: Body | None) -> dict[str, Any]:
    st = json.loads(json.dumps(dict(status or {})))
    for section, field in (FEEDBACK_INBOX, MESSAGE_INBOX):
        part = st.get(section)
        if isinstance(part, dict):
            part.pop(field, None)
            if not part:
                st.pop(section)
    return dict(st)


def inbox(status: Body | None, where: tuple[str, str]) -> dict[str, Any] | None:
    value = ((status or {}).get(where[0]) or {}).get(where[1])
    return dict(value) if isinstance(value, Mapping) else None


def inbox_response(status: Body | None) -> dict[str, Any] | None:
    return inbox(status, FEEDBACK_INBOX)


def review_status_write(old: Body | None, new: Body | None, *, by_operator: bool,
                        username: str = "") -> str | None:
    """Why a write to flows/status must be refused, or None. Humans may only write the inbox."""
    if by_operator:
        return None
    old_st, new_st = (old or {}).get("status"), (new or {}).get("status")
    if _status_without_inbox(old_st) != _status_without_inbox(new_st):
        return ("only status.feedback.response and status.conversation.inbox may be written by users; "
                "the rest of the status belongs to the flowkube operator")
    problems = [_message_problem(old_st, new_st, username), _response_problem(old_st, new_st, username)]
    return next((p for p in problems if p), None)


def recorded_senders(old: Body | None, new: Body | None, username: str) -> dict[str, Any]:
    """The status patch that records who wrote a new answer or message (respondedBy, sentBy)."""
    new_st, old_st = (new or {}).get("status"), (old or {}).get("status")
    status: dict[str, Any] = {}
    resp = inbox_response(new_st)
    if resp is not None and resp != inbox_response(old_st):
        status["feedback"] = {"response": {**resp, "respondedBy": username}}
    message = inbox(new_st, MESSAGE_INBOX)
    if message is not None and message != inbox(old_st, MESSAGE_INBOX):
        status["conversation"] = {"inbox": {**message, "sentBy": username}}
    return status


def _inbox_shape_problem(value: dict[str, Any], where: tuple[str, str], allowed: tuple[str, ...],
                         recorded: str, username: str) -> str | None:
    """What is wrong with the form of a newly written inbox: its fields, its text, who it says wrote it."""
    path = f"status.{where[0]}.{where[1]}"
    unknown = set(value) - {*allowed, recorded}
    if unknown:
        return f"{path} has unknown field(s) {sorted(unknown)}; allowed: {', '.join(allowed)}"
    if value.get("text") is not None and not isinstance(value.get("text"), str):
        return f"{path}.text must be a string"
    if value.get(recorded) not in (None, username):
        return f"{path}.{recorded} is recorded by flowkube (the user who patched), not set by users"
    return None


def _response_problem(old_st: Body | None, new_st: Body | None, username: str) -> str | None:
    resp = inbox_response(new_st)
    if resp is None or resp == inbox_response(old_st):
        return None
    shape = _inbox_shape_problem(resp, FEEDBACK_INBOX, ("text", "requestId"), "respondedBy", username)
    if shape:
        return shape
    raw_req = ((old_st or {}).get("feedback") or {}).get("request")
    req = FeedbackRequest.model_validate(raw_req) if raw_req else None
    problem = _answered_already(req, inbox_response(old_st)) or validate_response(
        req, resp.get("text"), resp.get("requestId"))
    return f"status.feedback.response refused: {problem}" if problem else None


def _answered_already(req: FeedbackRequest | None, earlier: dict[str, Any] | None) -> str | None:
    """A second answer to the same request, written before the operator applied the first (two
    people answering at once): refused, so the first answer is the one applied, and the second
    person is told so."""
    if req is None or not earlier or not isinstance(earlier.get("text"), str) or not earlier["text"].strip():
        return None
    if earlier.get("requestId") not in (None, "", req.id):
        return None
    who = f" by {earlier['respondedBy']}" if earlier.get("respondedBy") else ""
    return f"request {req.id!r} was answered already{who}; the operator is applying that answer"


def _message_problem(old_st: Body | None, new_st: Body | None, username: str) -> str | None:
    message = inbox(new_st, MESSAGE_INBOX)
    if message is None or message == inbox(old_st, MESSAGE_INBOX):
        return None
    shape = _inbox_shape_problem(message, MESSAGE_INBOX, ("text",), "sentBy", username)
    if shape:
        return shape
    raw = (old_st or {}).get("conversation")
    conv = ConversationStatus.model_validate(raw) if isinstance(raw, Mapping) else None
    if conv is not None and conv.inbox is not None and conv.inbox.text:
        return "a message is already waiting in status.conversation.inbox; send the next one after its reply"
    problem = validate_message(conv, (old_st or {}).get("phase"), message.get("text"))
    return f"status.conversation.inbox refused: {problem}" if problem else None


TemplateLookup = Callable[[TemplateKey], Awaitable[Body | None]]
# (namespace, status.template) -> the template spec of the snapshot it names, None when it cannot be read
SnapshotLookup = Callable[[str, Mapping[str, Any]], Awaitable[dict[str, Any] | None]]


async def template_problem(spec: Body, namespace: str, status: Body | None, lookup: TemplateLookup,
                           taken_lookup: SnapshotLookup | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """A Flow of a template: (the spec it runs, why it is refused or None). A Flow that took its
    template already is checked against what it took (its snapshot, or the copy an older operator
    wrote into its status); a new one against the template as it is now (refused when there is none,
    naming spec.templateRef). (None, None) when what it took cannot be read now: its own bytes were
    checked already, and the reconcile fails a Flow whose snapshot is gone, naming it."""
    ref = spec.get("templateRef") or {}
    taken = (status or {}).get("template")
    template: Body | None
    if isinstance(taken, Mapping):
        tspec = templates.taken_spec(taken)
        if tspec is None and taken_lookup is not None and taken.get("snapshot"):
            tspec = await taken_lookup(namespace, taken)  # (a Body or None: the lookup's own type)
        if tspec is None:
            return None, None
        template = {"spec": tspec}
    else:
        template = await lookup(templates.template_key(namespace, ref))
    if template is None:
        return dict(spec), (f"spec.templateRef: {templates.describe_ref(namespace, ref)} not found "
                            "(create the template first)")
    effective, problems = templates.problems(template, namespace, spec)
    return effective, "; ".join(problems) or None


def template_spec_problem(spec: Body) -> str | None:
    """A FlowTemplate's own checks besides its schema: its size (each generation Flows take is
    stored in a snapshot), its parameters' defaults' depth, and each default of its parameter's type."""
    too_big = limits.template_problem(spec)
    if too_big:
        return too_big
    for p in spec.get("parameters") or []:
        if limits.depth_over(p.get("default")):
            return (f"spec.parameters[{p['name']}].default nests objects and lists more than {limits.DEPTH_LIMIT} "
                    "levels deep")
    for p in spec.get("parameters") or []:
        want, default = p.get("type"), p.get("default")
        if want and default is not None and templates.parameter_problems(
                {"parameters": [p]}, {p["name"]: default}, "this template"):
            return f"spec.parameters[{p['name']}].default: must be {want}"
    return None


def schedule_problem(spec: Body) -> str | None:
    """A CronFlow's schedule and time zone, as its controller will read them (flowkube_api.cron)."""
    try:
        cron.parse("@daily", spec.get("timeZone"))
    except cron.ScheduleError as e:
        return f"spec.timeZone: {e}"
    try:
        cron.parse(str(spec.get("schedule") or ""))
    except cron.ScheduleError as e:
        return f"spec.schedule: {e}"
    return None


class Validator:
    """The validator sidecar: crewAI's own FlowDefinition model, in the runner image, over loopback
    HTTP. Asked about ``spec.definition`` on every Flow create and update (a validator that does not
    answer admits the Flow: the runner then refuses it with InvalidDefinition)."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def problem(self, spec: Body) -> str | None:
        definition = spec.get("definition")
        if not isinstance(definition, Mapping) or not self.url:
            return None
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.post(self.url, json=dict(definition)) as r:
                verdict = await r.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None  # validator down: admit; the runner refuses it with InvalidDefinition instead
        if not isinstance(verdict, dict) or verdict.get("valid", True):
            return None
        lines = []
        for err in verdict.get("errors") or []:
            loc = ".".join(str(p) for p in err.get("loc") or [])
            lines.append(f"spec.definition{'.' + loc if loc else ''}: {err.get('msg', 'invalid')}")
        return "invalid crewAI flow definition: " + ("; ".join(lines) or str(verdict.get("message")))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def install_ca_bundle(kube: Kube, name: str, ca: bytes) -> None:
    """Put our CA into every webhook of the (Validating|Mutating)WebhookConfiguration `name`.

    The configurations themselves come from the Helm chart (or the local stack); the operator only
    owns their caBundle, so it needs get/patch on those two named objects and nothing broader.
    """
    bundle = base64.b64encode(ca).decode()
    for plural in ("validatingwebhookconfigurations", "mutatingwebhookconfigurations"):
        path = f"/apis/admissionregistration.k8s.io/v1/{plural}/{name}"
        current = await kube.get(path)
        if current is None:
            log.warning("webhook configuration %s/%s not found; admission checks are off", plural, name)
            continue
        hooks = [{**h, "clientConfig": {**h.get("clientConfig", {}), "caBundle": bundle}}
                 for h in current.get("webhooks") or []]
        await kube.merge_patch(path, {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"]},
                                      "webhooks": hooks})


# An AdmissionReview carries the object and, on UPDATE, the old one: up to twice the API server's
# 3 MiB request limit. aiohttp's default (1 MiB) answered a big Flow with a bare 413 that named no
# field; with this bound the handler sees it and says which field is over its limit.
REVIEW_BODY_LIMIT = 8 * 1024 * 1024
LARGE_REVIEW = 256 * 1024  # reviews over this (or of unknown length) share a byte budget to be received
BODY_SECONDS = 3.0  # to receive a whole body (FLOWKUBE_WEBHOOK_BODY_SECONDS): the API server sends it at once
BODY_BUDGET = 24 * 1024 * 1024  # bytes of large reviews being received at once (FLOWKUBE_WEBHOOK_BODY_BUDGET_MIB)
LARGE_DECODING = 2  # large reviews decoded and answered at once: only once their whole body is in


class ByteBudget:
    """Bytes of large admission reviews being received at once, reserved by their Content-Length
    (the most a review may be, without one). Waiters are served in order, except that one whose
    client (source address) holds its share already is passed over: one client holds at most
    `per_client` bytes, so there is always room for someone else, and no large review is overtaken
    for ever by smaller ones. A reservation is held only until its body is in, or its deadline."""

    def __init__(self, total: int, per_client: int) -> None:
        self.total, self.per_client, self.free = total, per_client, total
        self._held: dict[str, int] = {}
        self._waiting: collections.deque[tuple[str, int, asyncio.Future[None]]] = collections.deque()

    def _take(self, client: str, n: int) -> None:
        self.free -= n
        self._held[client] = self._held.get(client, 0) + n

    async def acquire(self, client: str, n: int) -> None:
        n = min(n, self.per_client)
        if not self._waiting and n <= self.free and self._held.get(client, 0) + n <= self.per_client:
            self._take(client, n)
            return
        entry = (client, n, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        self._grant()  # those ahead may be held back by their own client's share, not this one
        try:
            await entry[2]
        except BaseException:
            if entry[2].done() and not entry[2].cancelled():
                self.release(client, n)  # granted as it was given up: hand it on
            else:
                with contextlib.suppress(ValueError):
                    self._waiting.remove(entry)
                self._grant()  # it may have stood at the head of the line
            raise

    def release(self, client: str, n: int) -> None:
        n = min(n, self.per_client)
        self.free += n
        left = self._held.pop(client, n) - n
        if left > 0:
            self._held[client] = left
        self._grant()

    def _grant(self) -> None:
        for entry in list(self._waiting):
            client, n, future = entry
            if future.done():
                self._waiting.remove(entry)
            elif self._held.get(client, 0) + n > self.per_client:
                continue  # its own client's share is full: others go first
            elif n > self.free:
                break
            else:
                self._waiting.remove(entry)
                self._take(client, n)
                future.set_result(None)


async def _refusal(request: web.Request, status: int, message: str) -> web.Response:
    """Not an AdmissionReview (its uid is in the body that did not come): the API server applies the
    webhook's failure policy, and logs this text. Sent, then the connection is closed at once
    (aiohttp would otherwise wait 10 s more for the rest of the body it will never read)."""
    response = web.Response(status=status, text=message + "\n")
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    if request.protocol is not None:
        request.protocol.force_close()
    return response


class FlowkubeWebhookServer(kopf.WebhookServer):
    """kopf's HTTPS server; in a cluster the API server is pointed at our Service instead of a URL.

    No client can hold admission for others: every body must arrive within `body_seconds` (408 and
    the connection closed otherwise); a large one (or one of unknown length, read under the 8 MiB cap
    as it comes) first reserves its bytes in a `ByteBudget`, of which one source address gets at most
    all but 8 MiB, and waits at most twice `body_seconds` for them; only a body that is wholly in
    takes one of LARGE_DECODING slots to be decoded and answered. Memory: at most the budget in
    bodies being received, plus LARGE_DECODING large reviews decoded, plus small ones."""

    async def _serve(self, fn: kopf.WebhookFn, request: web.Request) -> web.Response:  # type: ignore[override]
        request = request.clone(client_max_size=REVIEW_BODY_LIMIT)
        length = request.content_length
        if length is not None and length <= LARGE_REVIEW:
            return await self._received(fn, request, None)
        client, n = request.remote or "", min(length or REVIEW_BODY_LIMIT, REVIEW_BODY_LIMIT)
        try:
            async with asyncio.timeout(2 * self.body_seconds):
                await self._budget.acquire(client, n)
        except TimeoutError:
            log.warning("admission: no room to receive a %s review from %s within %ss", length or "chunked",
                        client, 2 * self.body_seconds)
            return await _refusal(request, 503, "too many large admission reviews are being received; retry")
        try:
            return await self._received(fn, request, self._decoding)
        finally:
            self._budget.release(client, n)

    async def _received(self, fn: kopf.WebhookFn, request: web.Request,
                        slot: asyncio.Semaphore | None) -> web.Response:
        """The body read within the deadline (kopf then finds it read), then kopf's answer."""
        try:
            async with asyncio.timeout(self.body_seconds):
                await request.read()
        except TimeoutError:
            log.warning("admission: the body from %s did not arrive within %ss; connection closed",
                        request.remote, self.body_seconds)
            return await _refusal(request, 408,
                                  f"the admission review's body did not arrive within {self.body_seconds:g} s")
        if slot is None:
            return await kopf.WebhookServer._serve(fn, request)
        async with slot:
            return await kopf.WebhookServer._serve(fn, request)

    def __init__(self, *, service: str = "", body_seconds: float = BODY_SECONDS, body_budget: int = BODY_BUDGET,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.service = service
        self.body_seconds = body_seconds
        self._budget = ByteBudget(body_budget, max(body_budget - REVIEW_BODY_LIMIT, REVIEW_BODY_LIMIT))
        self._decoding = asyncio.Semaphore(LARGE_DECODING)
        self.listening = False  # kopf's server yields its first config once its socket is bound

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        async for config in super().__call__(fn):
            self.listening = True
            if self.service:
                ns, name = self.service.split("/", 1)
                svc = kopf.WebhookClientConfigService(namespace=ns, name=name, port=443)
                config = kopf.WebhookClientConfig(service=svc, caBundle=config.get("caBundle", ""))
            yield config
