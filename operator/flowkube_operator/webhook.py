"""Admission: refuse bad Flows and bad feedback at `kubectl` time, and record who answered.

TLS is self-managed: the operator makes its own CA and serving certificate at start-up and kopf
writes the CA bundle into the webhook configurations it manages (no cert-manager needed).
The decisions themselves are pure functions, tested without a cluster.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import kopf
from aiohttp import web

from flowkube_api import cron, limits, templates
from flowkube_api.models import ConversationStatus, FeedbackRequest
from flowkube_operator.inbox import validate_message, validate_response
from flowkube_operator.kube import Kube
from flowkube_operator.templatecache import TemplateKey

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


async def template_problem(spec: Body, namespace: str, status: Body | None,
                           lookup: TemplateLookup) -> tuple[dict[str, Any], str | None]:
    """A Flow of a template: (the spec it runs, why it is refused or None). A Flow that took its
    template already is checked against the copy in its status; a new one against the template as
    it is now (refused when there is none, naming spec.templateRef)."""
    ref = spec.get("templateRef") or {}
    taken = (status or {}).get("template")
    template = {"spec": taken.get("spec") or {}} if isinstance(taken, Mapping) else await lookup(
        templates.template_key(namespace, ref))
    if template is None:
        return dict(spec), (f"spec.templateRef: {templates.describe_ref(namespace, ref)} not found "
                            "(create the template first)")
    effective, problems = templates.problems(template, namespace, spec)
    return effective, "; ".join(problems) or None


def template_spec_problem(spec: Body) -> str | None:
    """A FlowTemplate's own checks besides its schema: its size (each Flow of it keeps a copy in its
    status), its parameters' defaults' depth, and each default of its parameter's type."""
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
LARGE_REVIEW = 256 * 1024  # reviews over this are decoded one at a time (memory, not time, is the bound)


class FlowkubeWebhookServer(kopf.WebhookServer):
    """kopf's HTTPS server; in a cluster the API server is pointed at our Service instead of a URL."""

    _large = asyncio.Semaphore(1)

    @staticmethod
    async def _serve(fn: kopf.WebhookFn, request: web.Request) -> web.Response:
        request = request.clone(client_max_size=REVIEW_BODY_LIMIT)
        length = request.content_length
        if length is not None and length <= LARGE_REVIEW:
            return await kopf.WebhookServer._serve(fn, request)
        async with FlowkubeWebhookServer._large:
            return await kopf.WebhookServer._serve(fn, request)

    def __init__(self, *, service: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.service = service
        self.listening = False  # kopf's server yields its first config once its socket is bound

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        async for config in super().__call__(fn):
            self.listening = True
            if self.service:
                ns, name = self.service.split("/", 1)
                svc = kopf.WebhookClientConfigService(namespace=ns, name=name, port=443)
                config = kopf.WebhookClientConfig(service=svc, caBundle=config.get("caBundle", ""))
            yield config
