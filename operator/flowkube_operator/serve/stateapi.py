"""The state API: the only way a runner pod reaches its Flow's durable state.

Runner pods hold no Kubernetes API credentials. Each gets a pod-bound ServiceAccount token for
the audience `flowkube.io/state`, which the API server itself refuses. A runner sends it to
`GET|PUT /v1/state/<key>`; the operator authenticates it with a TokenReview, reads the pod it is
bound to from the review, checks that pod is a runner pod of a live Flow, and reads or writes one
binaryData key of that Flow's `<flow>-state` ConfigMap. No request can name another Flow, and a
token stops working when its pod is deleted.

Only the running attempt may read or write the flow's state. A pod whose run was closed while it
still ran (stopped at the deadline, finishing its last model call after SIGTERM) may still write its
own report, for as long as the pod exists: the calls it reports were made and are billed, so they
count, once, in that run's entry. A report must be about the pod that sends it.

Who is asking is settled first, in stateauth.py: a rate per source address, the token checked with
the cluster's issuer keys, then a TokenReview (cached a minute per token), and the pod it is bound
to matched to its Flow's running attempt.

This replaces a ServiceAccount, Role and RoleBinding per Flow (three writes, two of them RBAC
escalation checks, on every Flow's first run) with one TokenReview per runner pod.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator
from decimal import Decimal
from typing import Any, Protocol

from aiohttp import web
from pydantic import Field, ValidationError, model_validator

from flowkube_api import constants as c
from flowkube_api.base import Model, Money
from flowkube_api.report import (
    CHARGES_LIMIT,
    COST_LIMIT,
    COUNT_LIMIT,
    MODEL_NAME_LIMIT,
    Charge,
    ReportTooLarge,
    RunReport,
)
from flowkube_operator import selfmetrics
from flowkube_operator.flows import checkpoints, resources
from flowkube_operator.kube.client import ApiError, Kube, delete_namesake_garbage, ns_path
from flowkube_operator.kube.issuerkeys import IssuerKeys
from flowkube_operator.meta import owner_uid
from flowkube_operator.quotas.book import Charges, Refusal, Spend
from flowkube_operator.serve.stateauth import (
    REVIEW_CONCURRENCY,
    ActiveRuns,
    ClientLimits,
    StateAuth,
    StateError,
    Target,
    client,
)

Body = dict[str, Any]
log = logging.getLogger("flowkube.state")

POD_IN_FLIGHT = 4  # requests of one runner pod at once (a runner makes one, plus a long poll)
IDLE_SECONDS = 15.0  # an idle keep-alive connection is closed after this (aiohttp keeps them an hour)
BODY_LIMIT = 2 * 1024 * 1024
CM_UIDS_KEPT = 4096
KEY_PATTERN = re.compile(c.STATE_KEY_PATTERN)
CHECKPOINT_KEY = re.compile(re.escape(c.CHECKPOINT_KEY_PREFIX) + r"([1-9][0-9]{0,14})")


class Runs(ActiveRuns, Protocol):
    """What the state API asks of the Flow cache (`cache.FlowCache`)."""

    def message_for(self, namespace: str, flow: str, pod: str, after: int) -> tuple[int, Body | None]: ...

    def answer_for(self, namespace: str, flow: str, pod: str, request_id: str) -> tuple[int, Body | None]: ...

    async def changed(self, key: tuple[str, str], seconds: float) -> None:
        """Return when the cached Flow changes, or after ``seconds``."""

    def checkpoints_kept(self, namespace: str, flow: str) -> int:
        """The cached Flow's ``spec.checkpoints.keep``."""


class Reports(Protocol):
    """What the state API tells the Flows' controller (`controller.Controller`)."""

    def late_report(self, namespace: str, flow: str, report: RunReport) -> None:
        """A pod whose run is closed stored a report: fold it in."""

    def running_report(self, namespace: str, flow: str, report: RunReport) -> bool:
        """The running attempt stored a warm or a final report: fold it in now (False: this replica
        does not lead)."""


class QuotaDesk(Protocol):
    """The spend quotas' side of the state API (issue 41): the book of the Flows' quotas, on the
    leader (None: this replica does not lead)."""

    def reserve(self, t: Target, model: str, worst: Spend, priced: bool, charges: Charges | None,
                held: list[tuple[int, str, Spend]]) -> int | Refusal | str | None:
        """The reservation's id (0: no quota covers the Flow), a refusal, why to ask again (str), or
        None (not the leader). ``charges``: the run's so far; ``held``: the pod's reservations in
        flight, ``(id, model, worst)``."""

    def settle(self, t: Target, reservation: int, charges: Charges,
               held: list[tuple[int, str, Spend]]) -> bool | None: ...

    def hold(self, t: Target, charges: Charges | None, held: list[tuple[int, str, Spend]]) -> bool | None:
        """A pod's reminder of the reservations it holds (None: not the leader, or not listed yet)."""


QUOTA_BODY_LIMIT = 512 * 1024  # the run's charges (at most CHARGES_LIMIT entries) and what it holds
HELD_LIMIT = 64  # reservations one pod says it holds


def _bounded(tokens: int, cost: Decimal, where: str) -> None:
    """A figure a pod sends, within the bounds of a report's (the book adds them up: an exponent of a
    hundred million digits, or a count past 2^53, must not reach it)."""
    if not 0 <= tokens <= COUNT_LIMIT:
        raise ValueError(f"{where}: tokens must be from 0 to {COUNT_LIMIT}")
    if not cost.is_finite() or not 0 <= cost <= COST_LIMIT:
        raise ValueError(f"{where}: cost must be from 0 to {COST_LIMIT} USD")


class Held(Model):
    id: int = Field(ge=1, le=COUNT_LIMIT)
    model: str = Field(max_length=MODEL_NAME_LIMIT)
    tokens: int = Field(ge=0, le=COUNT_LIMIT)
    cost: Money = Decimal(0)

    @model_validator(mode="after")
    def _within(self) -> Held:
        _bounded(self.tokens, self.cost, "held")
        return self


class _Charged(Model):
    charges: list[Charge] | None = Field(default=None, max_length=CHARGES_LIMIT)  # the run's so far
    held: list[Held] | None = Field(default=None, max_length=HELD_LIMIT)  # the pod's other calls in flight

    @model_validator(mode="after")
    def _charges_within(self) -> _Charged:
        for ch in self.charges or []:
            _bounded(ch.total_tokens, ch.cost, "charges")
        return self


class Reserve(_Charged):
    model: str = Field(max_length=MODEL_NAME_LIMIT)
    tokens: int = Field(ge=0, le=COUNT_LIMIT)
    cost: Money = Decimal(0)
    priced: bool = True  # false: the model has no price (its cost is unknown, not zero)

    @model_validator(mode="after")
    def _within(self) -> Reserve:
        _bounded(self.tokens, self.cost, "reserve")
        return self


class Settle(_Charged):
    id: int = Field(ge=1, le=COUNT_LIMIT)


def _charges(charges: list[Charge] | None) -> Charges:
    return [(ch.at, ch.model, Spend(ch.total_tokens, ch.cost)) for ch in charges or []]


def _held(held: list[Held] | None) -> list[tuple[int, str, Spend]]:
    return [(h.id, h.model, Spend(h.tokens, h.cost)) for h in held or []]


class StateApi:
    def __init__(self, kube: Callable[[], Kube | None], runs: Runs, reports: Reports, *,
                 issuer: IssuerKeys | None = None, limits: ClientLimits | None = None,
                 token_reviews: int = REVIEW_CONCURRENCY, quotas: QuotaDesk | None = None) -> None:
        """`issuer`: the keys tokens are checked with before a TokenReview (None: none, the TokenReview
        alone decides). `limits`: per source address (default: the documented defaults). `quotas`: the
        spend quotas' desk (None: quotas are not enforced, and the quota paths answer 404)."""
        self._quotas = quotas
        self._kube = kube
        self._runs, self._reports = runs, reports
        self.auth = StateAuth(kube, runs, issuer=issuer, token_reviews=token_reviews)
        self._limits = limits or ClientLimits()
        self._in_flight: dict[tuple[str, str], int] = {}  # (namespace, pod) -> requests being served
        # Flow uid -> uid of its state ConfigMap, for the uid precondition of every write. The oldest
        # entries go first past CM_UIDS_KEPT: a Flow's is looked up again when it is needed.
        self._cm_uids: dict[str, str] = {}

    # -- the Flow's state ConfigMap ------------------------------------------------------------------

    def forget_flow(self, flow_uid: str) -> None:
        self._cm_uids.pop(flow_uid, None)

    def _remember_cm(self, flow_uid: str, cm_uid: str) -> None:
        self._cm_uids.pop(flow_uid, None)
        self._cm_uids[flow_uid] = cm_uid
        if len(self._cm_uids) > CM_UIDS_KEPT:
            del self._cm_uids[next(iter(self._cm_uids))]

    async def _own_configmap(self, t: Target) -> Body | None:
        """The Flow's state ConfigMap; None if absent. One left by an earlier Flow of the same
        name (garbage collection is asynchronous) is not this Flow's: a conflict, retried."""
        path = ns_path(t.namespace, "configmaps", c.state_configmap_name(t.flow))
        cm = await client(self._kube).get(path)
        if cm is None:
            return None
        if await delete_namesake_garbage(client(self._kube), path, cm, t.flow, t.flow_uid):
            return None
        if owner_uid(cm["metadata"]) != t.flow_uid:
            raise StateError(409, f"configmap {c.state_configmap_name(t.flow)} still belongs to an earlier "
                                  "Flow of the same name; retry once it is garbage-collected")
        self._remember_cm(t.flow_uid, cm["metadata"]["uid"])
        return cm

    async def get(self, t: Target, key: str) -> bytes | None:
        cm = await self._own_configmap(t)
        value = ((cm or {}).get("binaryData") or {}).get(key)
        return base64.b64decode(value) if value is not None else None

    async def put(self, t: Target, key: str, value: bytes) -> None:
        kube = client(self._kube)
        data = {key: base64.b64encode(value).decode("ascii")}
        path = ns_path(t.namespace, "configmaps", c.state_configmap_name(t.flow))
        for _ in range(3):
            uid = self._cm_uids.get(t.flow_uid)
            if uid is None and await self._own_configmap(t) is None:
                flow = {"metadata": {"name": t.flow, "namespace": t.namespace, "uid": t.flow_uid}}
                created = await kube.create(ns_path(t.namespace, "configmaps"),
                                            {**resources.state_configmap(flow), "binaryData": data})
                if created is not None:
                    self._remember_cm(t.flow_uid, created["metadata"]["uid"])
                    return
                continue  # made by a concurrent write: patch it
            uid = self._cm_uids.get(t.flow_uid)
            try:
                # The uid is a precondition: never write into a same-named ConfigMap of another Flow.
                await kube.merge_patch(path, {"metadata": {"uid": uid}, "binaryData": data})
                return
            except ApiError as e:
                # A uid that does not match is refused as an immutable field (422) or a failed
                # precondition (409): the ConfigMap was replaced; look again.
                if e.status == 404 or (e.status in (409, 422) and "uid" in str(e).lower()):
                    self.forget_flow(t.flow_uid)
                    continue
                raise
        raise StateError(409, f"configmap {c.state_configmap_name(t.flow)} keeps changing owner; retry")

    # -- a warm runner's next message ----------------------------------------------------------------

    async def _message(self, request: web.Request, t: Target, after: str) -> web.Response:
        """``GET /v1/message/<after>``: held until message ``after + 1`` is accepted for this pod (200,
        ``{"turn", "text", "sender"}``), for at most ``?wait=`` seconds (204), or 410 when none will come."""
        if not after.isdigit():
            return _error(400, "the path ends with the number of the last message answered")
        return await self._long_poll(request, t, lambda w: w.message_for(t.namespace, t.flow, t.pod, int(after)))

    async def _answer(self, request: web.Request, t: Target, request_id: str) -> web.Response:
        """``GET /v1/answer/<request id>``: held until the answer to that feedback request is accepted
        (200, ``{"requestId", "text", "timedOut", "outcome"}``), at most ``?wait=`` seconds (204), or 410."""
        return await self._long_poll(request, t, lambda w: w.answer_for(t.namespace, t.flow, t.pod, request_id))

    async def _long_poll(self, request: web.Request, t: Target,
                         look: Callable[[Runs], tuple[int, Body | None]]) -> web.Response:
        """Answered from the operator's cache, looked at again each time the Flow changes."""
        try:
            wait = min(max(float(request.query.get("wait", c.MESSAGE_POLL_SECONDS)), 0.0), c.MESSAGE_POLL_SECONDS)
        except ValueError:
            return _error(400, "wait must be a number of seconds")
        deadline = time.monotonic() + wait
        key = (t.namespace, t.flow)
        while True:
            code, body = look(self._runs)
            if code != 204:
                return web.json_response(body, status=code)
            left = deadline - time.monotonic()
            if left <= 0:
                return web.Response(status=204)
            await self._runs.changed(key, left)

    # -- HTTP ----------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=BODY_LIMIT)
        app.router.add_get(c.STATE_API_PREFIX + "{key}", self._handle(self._get))
        app.router.add_put(c.STATE_API_PREFIX + "{key}", self._handle(self._put))
        app.router.add_get(c.MESSAGE_API_PREFIX + "{key}", self._handle(self._message, state_key=False))
        app.router.add_get(c.ANSWER_API_PREFIX + "{key}", self._handle(self._answer, state_key=False))
        app.router.add_post(c.QUOTA_API_PREFIX + "{key}", self._handle(self._quota, state_key=False))
        return app

    # -- spend quotas --------------------------------------------------------------------------------

    async def _quota(self, request: web.Request, t: Target, what: str) -> web.Response:
        """``POST /v1/quota/reserve`` (a call's worst case: ``{"id"}``, or 402 and why),
        ``POST /v1/quota/settle`` (the call answered: the run's charges so far; 204) and
        ``POST /v1/quota/hold`` (calls still in flight: what the pod holds; 204)."""
        if self._quotas is None:
            return _error(404, "spend quotas are not enforced by this operator")
        if (request.content_length or 0) > QUOTA_BODY_LIMIT:
            return _error(413, f"a quota request is at most {QUOTA_BODY_LIMIT} bytes")
        body = await request.read()
        if len(body) > QUOTA_BODY_LIMIT:
            return _error(413, f"a quota request is at most {QUOTA_BODY_LIMIT} bytes")
        try:
            if what == "reserve":
                answer = self._reserved(self._quotas, t, Reserve.model_validate_json(body))
                if answer is not None:
                    return answer
            elif what == "settle":
                settled = Settle.model_validate_json(body)
                if self._quotas.settle(t, settled.id, _charges(settled.charges), _held(settled.held)) is not None:
                    return web.Response(status=204)
            elif what == "hold":
                holding = _Charged.model_validate_json(body)
                charges = _charges(holding.charges) if holding.charges is not None else None
                if self._quotas.hold(t, charges, _held(holding.held)) is not None:
                    return web.Response(status=204)
            else:
                return _error(404, "the quota paths are reserve, settle and hold")
        except ValidationError as e:
            return _error(422, f"{what}: {_first_error(e)}")
        response = _error(503, "this operator replica does not lead: ask again")
        response.headers["Connection"] = "close"
        return response

    @staticmethod
    def _reserved(desk: QuotaDesk, t: Target, asked: Reserve) -> web.Response | None:
        """The desk's answer to a reservation (None: this replica does not lead)."""
        outcome = desk.reserve(t, asked.model, Spend(asked.tokens, asked.cost), asked.priced,
                               _charges(asked.charges) if asked.charges is not None else None, _held(asked.held))
        if isinstance(outcome, Refusal):
            return _error(402, outcome.message())  # Payment Required: not retried
        if isinstance(outcome, str):
            return _error(503, outcome)  # asked again by the runner
        return web.json_response({"id": outcome}) if outcome is not None else None

    @contextlib.contextmanager
    def _pod_slot(self, t: Target) -> Iterator[None]:
        """At most POD_IN_FLIGHT requests of one pod at once (a flood is told 429, which runners retry)."""
        pod = (t.namespace, t.pod)
        held = self._in_flight.get(pod, 0)
        if held >= POD_IN_FLIGHT:
            raise StateError(429, f"pod {t.pod} has {POD_IN_FLIGHT} requests in flight already; retry")
        self._in_flight[pod] = held + 1
        try:
            yield
        finally:
            left = self._in_flight.pop(pod, 1) - 1
            if left > 0:
                self._in_flight[pod] = left

    def _handle(self, fn: Callable[[web.Request, Target, str], Awaitable[web.Response]], state_key: bool = True,
                ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            code = 500
            try:
                key = request.match_info["key"]
                if not KEY_PATTERN.fullmatch(key):
                    raise StateError(400, "invalid key")
                address = request.remote or ""
                self._limits.take(address)
                with self._limits.authenticating(address):
                    target = await self.auth.authenticate(request.headers.get("Authorization", ""))
                if not state_key:
                    if target.late:
                        raise StateError(410, f"the run of pod {target.pod} was closed: nothing will come to it")
                elif key not in (c.STATE_KEY, c.report_key(target.pod)) and not (
                        CHECKPOINT_KEY.fullmatch(key) and request.method == "PUT"):
                    raise StateError(403, f"a run may use only {c.STATE_KEY}, its own report key and PUT "
                                          f"{c.CHECKPOINT_KEY_PREFIX}<n>")
                elif target.late and (key != c.report_key(target.pod) or request.method != "PUT"):
                    raise StateError(403, f"the run of pod {target.pod} was closed: only its own report "
                                          "may still be written")
                with self._pod_slot(target):
                    response = await fn(request, target, key)
            except StateError as e:
                response = _error(e.status, str(e))
            except web.HTTPException as e:  # e.g. a body over the size limit
                response = _error(e.status, e.reason)
            except ApiError as e:
                if e.status == 422 and "too long" in str(e).lower():
                    response = _error(413, "the Flow's state is over the 1 MiB limit of a ConfigMap")
                else:
                    log.warning("state API: %s", e)  # details stay in the operator's log
                    response = _error(503 if e.status >= 500 or e.status == 429 else 502,
                                      f"the API server answered HTTP {e.status}; see the operator's log")
            except Exception as e:
                log.exception("state API failed")
                response = _error(500, f"internal error: {type(e).__name__}")
            code = response.status
            selfmetrics.STATE_REQUESTS.labels(request.method, str(code)).inc()
            return response

        return handler

    async def _get(self, _: web.Request, t: Target, key: str) -> web.Response:
        value = await self.get(t, key)
        if value is None:
            return _error(404, f"no {key} in the state of flow {t.namespace}/{t.flow}")
        return web.Response(body=value, content_type="application/octet-stream")

    async def _put(self, request: web.Request, t: Target, key: str) -> web.Response:
        if (request.content_length or 0) > c.STATE_LIMIT:
            return _error(413, f"{request.content_length} bytes is over the {c.STATE_LIMIT}-byte limit of one value")
        value = await request.read()
        if len(value) > c.STATE_LIMIT:
            return _error(413, f"{len(value)} bytes is over the {c.STATE_LIMIT}-byte limit of one value")
        if (number := CHECKPOINT_KEY.fullmatch(key)) is not None:
            keep = self._runs.checkpoints_kept(t.namespace, t.flow)
            flow = {"metadata": {"name": t.flow, "namespace": t.namespace, "uid": t.flow_uid}}
            try:
                await checkpoints.store(client(self._kube), flow, int(number.group(1)), keep, value)
            except checkpoints.CheckpointRefused as e:
                raise StateError(e.status, str(e)) from e
            return web.Response(status=204)
        report = None
        if key != c.STATE_KEY:
            try:
                report = RunReport.decode(value)
            except ReportTooLarge as e:
                return _error(413, f"{key}: {e} (a run report is a few kB)")
            except ValidationError as e:
                return _error(422, f"{key} is not a valid run report: {_first_error(e)}")
            except (OSError, ValueError, EOFError):
                return _error(400, f"{key} must hold a run report (gzip JSON)")
            if report.pod != t.pod:
                return _error(403, f"pod {t.pod} may report only its own run, not {report.pod!r}")
        # A report that says something now goes to the reconcile before it is stored, so the Flow's
        # status and the ConfigMap are written at the same time, not one after the other. Nothing is
        # lost if the store fails: the runner sends the report again (its 2xx comes only after both),
        # and a report folded twice counts once (a run's reports are cumulative).
        now = report if report is not None and not t.late and (report.warm or report.final) else None
        leader = now is not None and self._reports.running_report(t.namespace, t.flow, now)
        await self.put(t, key, value)
        if report is not None and t.late:
            self._reports.late_report(t.namespace, t.flow, report)
        elif now is not None and not leader:
            # Stored, but this replica does not reconcile: the runner sends it again, on a new
            # connection (so, through the Service, likely to another replica), until the leader has it
            # (a final report only for a moment: the leader also reads it when the pod has ended).
            response = _error(503, "this operator replica does not reconcile; send the report again")
            response.headers["Connection"] = "close"
            response.headers[c.HEADER_STORED] = "true"
            return response
        return web.Response(status=204)

    async def serve(self, host: str, port: int, cert: str, key: str) -> web.AppRunner:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
        runner = web.AppRunner(self.app(), access_log=None, keepalive_timeout=IDLE_SECONDS)
        await runner.setup()
        await web.TCPSite(runner, host, port, ssl_context=ctx).start()
        log.info("serving the state API on https://%s:%s", host, port)
        return runner


def _first_error(e: ValidationError) -> str:
    """The first refusal of a report, naming its field (a bound's own message names it already)."""
    first = e.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    message = str(first["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=json.dumps({"message": message}), content_type="application/json")
