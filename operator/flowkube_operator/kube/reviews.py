"""Who is asking, as the API server says: bounded caches of token verdicts, and /metrics' check.

Both HTTPS endpoints a pod can reach with a token (the state API, `/metrics` with
`metrics.auth.enabled`) ask the API server with a TokenReview; their verdicts are cached here.
Accepted and refused tokens are kept apart: a flood of made-up tokens fills only the refusals, and
never evicts a token that was accepted.

`/metrics` is checked as kube-rbac-proxy and kube-state-metrics check it: a TokenReview of the
bearer token (the API server's own audience), then a SubjectAccessReview of `get` on the
non-resource URL `/metrics` for that user. The chart's `<fullname>-metrics-reader` ClusterRole
grants exactly that; bind it to Prometheus's ServiceAccount.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from flowkube_api import constants as c
from flowkube_operator.kube.client import ApiError, Kube

log = logging.getLogger("flowkube.reviews")

V = TypeVar("V")
CACHE_LIMIT = 20_000  # entries of each cache
ACCEPTED_SECONDS = 60.0
REFUSED_SECONDS = 5.0


def token_key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class VerdictCache(Generic[V]):
    """sha256(token) -> verdict until a deadline; when full, expired entries go first, then all of
    this cache (only this one: the accepted and refused caches are two instances)."""

    def __init__(self, seconds: float, limit: int = CACHE_LIMIT) -> None:
        self.seconds = seconds
        self.limit = limit
        self._entries: dict[str, tuple[float, V]] = {}

    def get(self, key: str, now: float) -> V | None:
        hit = self._entries.get(key)
        return hit[1] if hit is not None and hit[0] > now else None

    def put(self, key: str, value: V, now: float) -> None:
        if len(self._entries) >= self.limit:
            for k in [k for k, (until, _) in self._entries.items() if until <= now]:
                del self._entries[k]
            if len(self._entries) >= self.limit:
                self._entries.clear()
        self._entries[key] = (now + self.seconds, value)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class MetricsAuth:
    """Whether a request for `/metrics` may have it: 200, or 401 (no valid token) / 403 (not allowed)."""

    PATH = "/metrics"

    def __init__(self, kube: Callable[[], Kube | None], concurrency: int = 4) -> None:
        self._kube = kube
        self._allowed: VerdictCache[bool] = VerdictCache(ACCEPTED_SECONDS)
        self._refused: VerdictCache[int] = VerdictCache(REFUSED_SECONDS)
        self._reviews = asyncio.Semaphore(concurrency)

    async def check(self, authorization: str) -> int:
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token) > 16384:
            return 401
        key, now = token_key(token), time.monotonic()
        if self._allowed.get(key, now):
            return 200
        refused = self._refused.get(key, now)
        if refused is not None:
            return refused
        kube = self._kube()
        if kube is None:
            return 503
        try:
            async with self._reviews:
                code = await self._review(kube, token)
        except ApiError as e:
            log.warning("/metrics: review failed: %s", e)
            return 503
        if code == 200:
            self._allowed.put(key, True, now)
        else:
            self._refused.put(key, code, now)
        return code

    async def _review(self, kube: Kube, token: str) -> int:
        review = await kube.request("POST", "/apis/authentication.k8s.io/v1/tokenreviews", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}})
        status = review.get("status") or {}
        user = status.get("user") or {}
        if not status.get("authenticated") or not user.get("username"):
            return 401
        sar = await kube.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", {
            "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {"user": user["username"], "groups": user.get("groups") or [], "uid": user.get("uid", ""),
                     "extra": user.get("extra") or {},
                     "nonResourceAttributes": {"path": self.PATH, "verb": "get"}}})
        return 200 if (sar.get("status") or {}).get("allowed") else 403


async def may(kube: Kube, userinfo: Mapping[str, Any], verb: str, namespace: str, plural: str, name: str) -> bool:
    """Whether the user an admission request names (its ``userInfo``) may ``verb`` that object of
    flowkube.io: a SubjectAccessReview, as the API server would decide a request of theirs."""
    sar = await kube.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", {
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": str(userinfo.get("username") or ""), "groups": list(userinfo.get("groups") or []),
                 "uid": str(userinfo.get("uid") or ""), "extra": dict(userinfo.get("extra") or {}),
                 "resourceAttributes": {"group": c.GROUP, "resource": plural, "verb": verb,
                                        "namespace": namespace, "name": name}}})
    return bool((sar.get("status") or {}).get("allowed"))
