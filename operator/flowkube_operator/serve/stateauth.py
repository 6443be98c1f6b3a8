"""Who is asking the state API (stateapi.py), before anything is read or written for them.

Nothing waits for a TokenReview before it is known to be worth one. Each source address has a rate
and a few authentications in flight (`ClientLimits`, HTTP 429 beyond); a token is then checked here
with the cluster's service-account issuer keys (issuerkeys.py: signature, expiry, audience), and
only one that passes goes to a TokenReview, on the API client's own review connections, under this
API's own slots. The TokenReview stays: it says the pod and its ServiceAccount still exist now (a
signature only says they did when the token was made), and it is cached for a minute per token.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from flowkube_api import constants as c
from flowkube_operator.kube import reviews
from flowkube_operator.kube.client import ApiError, Kube, flow_path, ns_path
from flowkube_operator.kube.issuerkeys import IssuerKeys, TokenRefused
from flowkube_operator.kube.reviews import VerdictCache

Body = dict[str, Any]
log = logging.getLogger("flowkube.state")

POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
SA_PREFIX = "system:serviceaccount:"
REVIEW_CONCURRENCY = 16  # TokenReviews of the state API at once (FLOWKUBE_STATE_TOKEN_REVIEWS)
CLIENT_RATE = 50.0  # requests a second from one source address (FLOWKUBE_STATE_CLIENT_RATE), and
CLIENT_BURST = 100  # how many may come at once after a quiet spell (FLOWKUBE_STATE_CLIENT_BURST)
CLIENT_AUTHENTICATING = 8  # requests of one address being authenticated at once
CLIENTS_KEPT = 20_000  # source addresses remembered; idle ones (a full bucket) go first

@dataclass(frozen=True)
class Caller:
    """The pod a token is bound to, as the API server vouched for it."""

    namespace: str
    pod: str
    pod_uid: str


@dataclass(frozen=True)
class Target:
    """The one Flow whose state a caller may touch."""

    namespace: str
    flow: str
    flow_uid: str
    pod: str
    pod_uid: str
    late: bool = False  # its run was closed: only its own report key is writable


class StateError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def caller_from_review(review: Body) -> Caller | None:
    """The pod a successful TokenReview names, or None (not authenticated, not a pod-bound token)."""
    status = review.get("status") or {}
    if not status.get("authenticated") or c.STATE_AUDIENCE not in (status.get("audiences") or []):
        return None
    user = status.get("user") or {}
    username = str(user.get("username") or "")
    extra = user.get("extra") or {}
    pods, uids = extra.get(POD_NAME_EXTRA) or [], extra.get(POD_UID_EXTRA) or []
    if not username.startswith(SA_PREFIX) or len(pods) != 1 or len(uids) != 1:
        return None
    namespace = username[len(SA_PREFIX):].split(":", 1)[0]
    return Caller(namespace=namespace, pod=str(pods[0]), pod_uid=str(uids[0]))


def target_of_pod(pod: Body) -> Target | None:
    """The Flow a runner pod belongs to: our labels and a Flow controller reference, or None."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(c.LABEL_MANAGED_BY) != c.MANAGED_BY or labels.get(c.LABEL_COMPONENT) != c.COMPONENT_RUNNER:
        return None
    ref = next((r for r in meta.get("ownerReferences") or []
                if r.get("controller") and r.get("kind") == c.KIND and r.get("apiVersion") == c.API_VERSION), None)
    if ref is None or ref.get("name") != labels.get(c.LABEL_FLOW):
        return None
    return Target(namespace=meta.get("namespace", ""), flow=str(ref["name"]), flow_uid=str(ref.get("uid", "")),
                  pod=meta.get("name", ""), pod_uid=meta.get("uid", ""))


@dataclass
class _Client:
    tokens: float
    at: float
    authenticating: int = 0


class ClientLimits:
    """Per source address, before anything is known of the token: a rate (a token bucket of `burst`
    refilled at `rate` a second) and `authenticating` requests being authenticated at once. Beyond
    either, HTTP 429, which runners retry. A runner makes a few requests a second at most; a pod
    sending made-up tokens is slowed to its share and never holds more than its few review waits.
    Addresses are those the operator sees: a runner pod's own, unless the network plugin rewrites
    the source of pod-to-Service traffic (then one node's runners share the node's address)."""

    def __init__(self, rate: float = CLIENT_RATE, burst: int = CLIENT_BURST,
                 authenticating: int = CLIENT_AUTHENTICATING, *, clock: Callable[[], float] = time.monotonic,
                 kept: int = CLIENTS_KEPT) -> None:
        self.rate, self.burst, self.authenticating_limit = rate, burst, authenticating
        self._clock = clock
        self._kept = kept
        self._clients: dict[str, _Client] = {}

    def _client(self, address: str, now: float) -> _Client:
        client = self._clients.get(address)
        if client is None:
            if len(self._clients) >= self._kept:
                self._forget_idle(now)
            client = self._clients[address] = _Client(tokens=float(self.burst), at=now)
        client.tokens = min(float(self.burst), client.tokens + (now - client.at) * self.rate)
        client.at = now
        return client

    def _forget_idle(self, now: float) -> None:
        """Addresses whose bucket is full again and that wait for nothing are as good as new."""
        for address, seen in list(self._clients.items()):
            if not seen.authenticating and seen.tokens + (now - seen.at) * self.rate >= self.burst:
                del self._clients[address]
        if len(self._clients) >= self._kept:  # all busy: start afresh rather than grow
            self._clients = {a: seen for a, seen in self._clients.items() if seen.authenticating}

    def take(self, address: str) -> None:
        client = self._client(address, self._clock())
        if client.tokens < 1:
            raise StateError(429, f"more than {self.rate:g} requests a second from {address}; retry")
        client.tokens -= 1

    @contextlib.contextmanager
    def authenticating(self, address: str) -> Iterator[None]:
        client = self._client(address, self._clock())
        if client.authenticating >= self.authenticating_limit:
            raise StateError(429, f"{address} has {self.authenticating_limit} requests being authenticated "
                                  "already; retry")
        client.authenticating += 1
        try:
            yield
        finally:
            client.authenticating -= 1


def claims(token: str) -> dict[str, Any]:
    """The JWT's payload, unverified: only to turn junk away before a TokenReview is spent on it."""
    try:
        payload = token.split(".")[1]
        decoded = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return {}
    return decoded if isinstance(decoded, dict) else {}


def plausible(token: str) -> bool:
    """A pod-bound ServiceAccount token for our audience, by its (unverified) claims."""
    found = claims(token)
    aud = found.get("aud")
    audiences = aud if isinstance(aud, list) else [aud]
    pod = (found.get("kubernetes.io") or {}).get("pod") if isinstance(found.get("kubernetes.io"), dict) else None
    return c.STATE_AUDIENCE in audiences and isinstance(pod, dict)


def client(kube: Callable[[], Kube | None]) -> Kube:
    """The API client of the latest login; 503 while the operator has none yet."""
    found = kube()
    if found is None:
        raise StateError(503, "the operator is starting; retry")
    return found


class ActiveRuns(Protocol):
    def active_run(self, namespace: str, pod: str) -> tuple[str, str, str] | None:
        """(flow name, flow uid, the pod's uid if its watch event has been seen, else "") when the
        pod is its Flow's running attempt; None otherwise."""


class StateAuth:
    """Who a request of the state API comes from: its bearer token checked with the issuer keys,
    then (once a minute per token) a TokenReview, and the pod it is bound to matched to the running
    attempt of its Flow (the Flow cache, ``runs``), or to a closed run of it (``Target.late``)."""

    def __init__(self, kube: Callable[[], Kube | None], runs: ActiveRuns, *, issuer: IssuerKeys | None = None,
                 token_reviews: int = REVIEW_CONCURRENCY) -> None:
        """`issuer`: the keys tokens are checked with before a TokenReview (None: none, the TokenReview
        alone decides)."""
        self._kube = kube
        self._runs = runs
        self._issuer = issuer
        # Verdicts by sha256(token): accepted for 60 s (checked against the running attempt on every
        # request), refusals for 5 s, in two caches: refusals never evict a runner's token.
        self._tokens: VerdictCache[Target] = VerdictCache(reviews.ACCEPTED_SECONDS)
        self._refused: VerdictCache[StateError] = VerdictCache(reviews.REFUSED_SECONDS)
        self._reviews = asyncio.Semaphore(token_reviews)  # the state API's own: not the reconcile's

    def _running(self, t: Target) -> bool:
        """Is t's pod (still) the running attempt of its Flow?"""
        active = self._runs.active_run(t.namespace, t.pod)
        return active is not None and active == (t.flow, t.flow_uid, t.pod_uid)

    async def authenticate(self, authorization: str) -> Target:
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise StateError(401, "a bearer token (the pod's flowkube.io/state token) is required")
        if not plausible(token):
            raise StateError(401, f"not a pod-bound token for audience {c.STATE_AUDIENCE}")
        digest, now = reviews.token_key(token), time.monotonic()
        refused = self._refused.get(digest, now)
        if refused is not None:
            raise refused  # refused a moment ago: no second TokenReview for it yet
        hit = self._tokens.get(digest, now)
        if hit is not None and (hit.late or self._running(hit)):
            return hit
        if self._issuer is not None:
            try:
                await self._issuer.verify(token, c.STATE_AUDIENCE)
            except TokenRefused as e:  # nothing was spent on it: no TokenReview, no cache entry
                raise StateError(401, f"not a valid pod-bound token for audience {c.STATE_AUDIENCE}: {e}") from e
        try:
            target = await self._authorize(token)
        except StateError as e:
            if e.status in (401, 403):
                self._refused.put(digest, e, now)
            raise
        self._tokens.put(digest, target, now)
        return target

    async def _authorize(self, token: str) -> Target:
        kube = client(self._kube)
        async with self._reviews:
            try:
                review = await kube.request("POST", "/apis/authentication.k8s.io/v1/tokenreviews", {
                    "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                    "spec": {"token": token, "audiences": [c.STATE_AUDIENCE]}})
            except ApiError as e:
                log.warning("state API: token review failed: %s", e)
                raise StateError(503 if e.status >= 500 or e.status == 429 else 500,
                                 f"token review failed (HTTP {e.status}); see the operator's log") from e
        caller = caller_from_review(review)
        if caller is None:
            raise StateError(401, f"not a valid pod-bound token for audience {c.STATE_AUDIENCE}")
        refused = StateError(403, f"pod {caller.namespace}/{caller.pod} is not the running attempt of a Flow")
        active = self._runs.active_run(caller.namespace, caller.pod)
        late = False
        if active is not None and active[2]:
            flow, flow_uid, pod_uid = active
        else:  # the caches lag (a restarted operator, a pod just made): ask the API server
            try:
                found = await self._live_target(kube, caller)
            except ApiError as e:
                log.warning("state API: reading %s/%s: %s", caller.namespace, caller.pod, e)
                raise StateError(503, "could not read the pod or its Flow; retry") from e
            if found is None or (active is not None and active[:2] != (found.flow, found.flow_uid)
                                 and not found.late):
                raise refused
            flow, flow_uid, pod_uid, late = found.flow, found.flow_uid, found.pod_uid, found.late
        if pod_uid != caller.pod_uid:
            raise refused
        return Target(namespace=caller.namespace, flow=flow, flow_uid=flow_uid, pod=caller.pod,
                      pod_uid=caller.pod_uid, late=late)

    @staticmethod
    async def _live_target(kube: Kube, caller: Caller) -> Target | None:
        """The caller's pod and Flow as the API server has them: a runner pod, controlled by a Flow
        whose last run is this pod and is not finished, or (``late``) one of its closed runs."""
        pod = await kube.get(ns_path(caller.namespace, "pods", caller.pod))
        target = target_of_pod(pod) if pod is not None else None
        if target is None:
            return None
        flow = await kube.get(flow_path(caller.namespace, target.flow))
        if flow is None or flow["metadata"].get("uid") != target.flow_uid:
            return None
        runs = (flow.get("status") or {}).get("runs") or []
        if runs and runs[-1].get("pod") == caller.pod and not runs[-1].get("finishedAt"):
            return target
        if caller.pod == c.run_pod_name(target.flow, len(runs)):
            # The next run's pod, created before the status write that records it (a kickoff or a
            # retry): that write comes in milliseconds, or the next leader adopts the pod.
            raise StateError(503, f"the run of pod {caller.pod} is not recorded yet; retry")
        closed = any(r.get("pod") == caller.pod and r.get("finishedAt") for r in runs)
        return dataclasses.replace(target, late=True) if closed else None

