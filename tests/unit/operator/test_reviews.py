"""/metrics' check (TokenReview, then SubjectAccessReview) and the bounded verdict caches."""

from __future__ import annotations

import asyncio
from typing import Any

from flowkube_operator.kube.reviews import MetricsAuth, VerdictCache


class ReviewKube:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.users = {"prom": "system:serviceaccount:monitoring:prometheus", "nosy": "system:serviceaccount:x:nosy"}

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        self.calls.append((path.rsplit("/", 1)[-1], body))
        if path.endswith("/tokenreviews"):
            user = self.users.get(body["spec"]["token"])
            return {"status": {"authenticated": user is not None,
                               "user": {"username": user, "groups": ["system:serviceaccounts"]} if user else {}}}
        allowed = body["spec"]["user"].endswith(":prometheus") and body["spec"]["nonResourceAttributes"] == {
            "path": "/metrics", "verb": "get"}
        return {"status": {"allowed": allowed}}


def test_only_a_user_allowed_to_get_metrics_gets_them_and_verdicts_are_cached() -> None:
    kube = ReviewKube()
    auth = MetricsAuth(lambda: kube)  # type: ignore[arg-type,return-value]

    async def scenario() -> None:
        assert await auth.check("") == 401 and await auth.check("Basic x") == 401
        assert await auth.check("Bearer " + "x" * 20_000) == 401  # longer than any token: not sent on
        assert kube.calls == []  # nothing asked for what is not a bearer token
        assert await auth.check("Bearer forged") == 401
        assert await auth.check("Bearer nosy") == 403
        assert await auth.check("Bearer prom") == 200
        calls = len(kube.calls)
        for token, code in (("forged", 401), ("nosy", 403), ("prom", 200)):
            assert await auth.check(f"Bearer {token}") == code
        assert len(kube.calls) == calls  # cached: one review per token, not per scrape

    asyncio.run(scenario())
    sar = next(body for kind, body in kube.calls if kind == "subjectaccessreviews")
    assert sar["spec"]["groups"] == ["system:serviceaccounts"]


def test_a_full_cache_drops_the_expired_first_then_only_itself() -> None:
    cache: VerdictCache[int] = VerdictCache(seconds=10, limit=3)
    cache.put("a", 1, now=0)
    cache.put("b", 2, now=5)
    cache.put("c", 3, now=6)
    cache.put("d", 4, now=12)  # full: "a" expired at 10 and goes
    assert [cache.get(k, now=12) for k in "abcd"] == [None, 2, 3, 4]
    cache.put("e", 5, now=13)  # full of live entries: this cache starts over
    assert len(cache) == 1 and cache.get("e", now=13) == 5
