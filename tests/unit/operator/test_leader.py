"""The Lease elector against a small fake of the Lease API: optimistic concurrency on
resourceVersion, expiry judged by when this process saw the record change, release; and its thread.
(tests/integration/test_lease.py: the same against the real kube-apiserver, with the loop saturated.)"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import threading
from typing import Any, cast

import pytest

from flowkube_devstack.cluster import wait_for
from flowkube_operator.kube.client import ApiError, Kube
from flowkube_operator.kube.leader import ElectionThread, LeaderElector, LeaseConfig, micro_time

Body = dict[str, Any]
PATH = "/apis/coordination.k8s.io/v1/namespaces/ns/leases/op"


class FakeLeases:
    """One namespace's Leases: create refuses a duplicate, PUT refuses a stale resourceVersion."""

    def __init__(self) -> None:
        self.objects: dict[str, Body] = {}
        self.rv = 0
        self.writes = 0
        self.fail: Exception | None = None  # raised by every call while set

    def _check(self) -> None:
        if self.fail is not None:
            raise self.fail

    async def get(self, path: str) -> Body | None:
        self._check()
        found = self.objects.get(path)
        return copy.deepcopy(found) if found is not None else None

    async def create(self, path: str, body: Body) -> Body | None:
        self._check()
        full = f"{path}/{body['metadata']['name']}"
        if full in self.objects:
            return None  # kube.Kube.create: AlreadyExists is None
        return self._store(full, body)

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        self._check()
        assert method == "PUT"
        current = self.objects.get(path)
        if current is None:
            raise ApiError(404, {"reason": "NotFound"}, method, path)
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            raise ApiError(409, {"reason": "Conflict"}, method, path)
        return self._store(path, body)

    def _store(self, path: str, body: Body) -> Body:
        self.rv += 1
        self.writes += 1
        stored = copy.deepcopy(body)
        stored["metadata"]["resourceVersion"] = str(self.rv)
        self.objects[path] = stored
        return copy.deepcopy(stored)

    def spec(self) -> Body:
        spec: Body = self.objects[PATH]["spec"]
        return spec

    def set_spec(self, **changes: Any) -> None:
        """Another replica (or a person) writes the Lease."""
        obj = self.objects[PATH]
        obj["spec"] = {**obj["spec"], **changes}
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


WALL = dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC)


def elector(api: FakeLeases, identity: str, clock: Clock) -> LeaderElector:
    return LeaderElector(lambda: api, LeaseConfig(namespace="ns", name="op", identity=identity), clock=clock,
                         wall=lambda: WALL + dt.timedelta(seconds=clock.now))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_acquires_a_lease_that_does_not_exist() -> None:
    api, clock = FakeLeases(), Clock()
    a = elector(api, "a", clock)
    assert run(a.try_acquire_or_renew()) is True and a.leading
    spec = api.spec()
    assert spec["holderIdentity"] == "a" and spec["leaseDurationSeconds"] == 10
    assert spec["leaseTransitions"] == 0
    assert spec["acquireTime"] == spec["renewTime"] == micro_time(WALL + dt.timedelta(seconds=1000))
    assert spec["renewTime"].endswith("Z") and len(spec["renewTime"].split(".")[1]) == 7  # MicroTime


def test_renews_its_own_lease_keeping_acquire_time_and_transitions() -> None:
    api, clock = FakeLeases(), Clock()
    a = elector(api, "a", clock)
    run(a.try_acquire_or_renew())
    acquired = api.spec()["acquireTime"]
    clock.now += 2
    assert run(a.try_acquire_or_renew()) is True
    spec = api.spec()
    assert spec["acquireTime"] == acquired and spec["renewTime"] != acquired
    assert spec["leaseTransitions"] == 0 and api.writes == 2


def test_does_not_steal_an_unexpired_lease_even_with_an_old_renew_time() -> None:
    api, clock = FakeLeases(), Clock()
    run(elector(api, "a", clock).try_acquire_or_renew())
    # b's wall clock is far ahead (skew): renewTime looks ancient, but b has only just seen the record.
    b = LeaderElector(lambda: api, LeaseConfig(namespace="ns", name="op", identity="b"), clock=clock,
                      wall=lambda: WALL + dt.timedelta(days=1))
    assert run(b.try_acquire_or_renew()) is False and not b.leading
    clock.now += 9.9
    assert run(b.try_acquire_or_renew()) is False
    assert api.spec()["holderIdentity"] == "a" and api.writes == 1
    assert b.expires_in() == pytest.approx(0.1)


def test_a_renewal_seen_by_the_follower_restarts_its_count() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, "a", clock), elector(api, "b", clock)
    run(a.try_acquire_or_renew())
    run(b.try_acquire_or_renew())
    clock.now += 6
    run(a.try_acquire_or_renew())  # a renews
    clock.now += 6  # 12 s since b first looked, 6 s since the renewal it is about to see
    assert run(b.try_acquire_or_renew()) is False
    clock.now += 10
    assert run(b.try_acquire_or_renew()) is True


def test_takes_over_an_expired_lease_and_counts_the_transition() -> None:
    api, clock = FakeLeases(), Clock()
    run(elector(api, "a", clock).try_acquire_or_renew())
    b = elector(api, "b", clock)
    assert run(b.try_acquire_or_renew()) is False
    clock.now += 10
    assert run(b.try_acquire_or_renew()) is True and b.leading
    spec = api.spec()
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    assert spec["acquireTime"] == micro_time(WALL + dt.timedelta(seconds=1010))


def test_a_conflicting_write_leaves_it_a_follower() -> None:
    api, clock = FakeLeases(), Clock()
    run(elector(api, "a", clock).try_acquire_or_renew())
    api.set_spec(holderIdentity="")  # released: free for whoever writes first
    b = elector(api, "b", clock)
    real_get = api.get

    async def racing_get(path: str) -> Body | None:
        seen = await real_get(path)
        api.set_spec(holderIdentity="c", renewTime="x")  # c wins the race between b's read and write
        return seen

    api.get = racing_get  # type: ignore[method-assign]
    assert run(b.try_acquire_or_renew()) is False and not b.leading
    assert api.spec()["holderIdentity"] == "c"


def test_two_replicas_creating_it_at_once_make_one_leader() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, "a", clock), elector(api, "b", clock)
    real_get = api.get

    async def not_yet(path: str) -> Body | None:
        await asyncio.sleep(0)  # both read "no Lease" before either creates it
        return None

    api.get = not_yet  # type: ignore[method-assign]

    async def both() -> list[bool]:
        return list(await asyncio.gather(a.try_acquire_or_renew(), b.try_acquire_or_renew()))

    assert sorted(run(both())) == [False, True]
    api.get = real_get  # type: ignore[method-assign]
    assert api.spec()["holderIdentity"] in ("a", "b") and api.writes == 1


def test_a_restarted_process_of_the_same_pod_takes_its_lease_back_at_once() -> None:
    api, clock = FakeLeases(), Clock()
    run(elector(api, "pod-1", clock).try_acquire_or_renew())
    again = elector(api, "pod-1", clock)  # the container restarted: a new process, same pod name
    assert run(again.try_acquire_or_renew()) is True
    assert api.spec()["leaseTransitions"] == 1  # a new term


def test_release_clears_the_holder_and_the_follower_takes_over_at_once() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, "a", clock), elector(api, "b", clock)
    run(a.try_acquire_or_renew())
    assert run(b.try_acquire_or_renew()) is False
    assert run(a.release()) is True and not a.leading
    spec = api.spec()
    assert spec["holderIdentity"] == "" and spec["leaseDurationSeconds"] == 1 and spec["leaseTransitions"] == 0
    assert run(a.release()) is False  # only once, and only while leading
    assert run(b.try_acquire_or_renew()) is True  # no wait for the lease to run out
    assert api.spec()["holderIdentity"] == "b" and api.spec()["leaseTransitions"] == 1


def test_hold_gives_up_when_no_renewal_succeeds_within_the_deadline() -> None:
    api = FakeLeases()
    cfg = LeaseConfig(namespace="ns", name="op", identity="a", lease_duration=0.5, renew_deadline=0.3,
                      retry_period=0.05)
    a = LeaderElector(lambda: api, cfg)

    async def scenario() -> float:
        assert await a.try_acquire_or_renew()
        api.fail = ApiError(500, {"message": "etcd is sad"}, "GET", PATH)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(a.hold(), 2)
        return loop.time() - started

    took = run(scenario())
    assert not a.leading and took < 0.45  # before the lease could run out for anyone else


def test_hold_gives_up_at_once_when_another_holder_is_seen() -> None:
    api = FakeLeases()
    cfg = LeaseConfig(namespace="ns", name="op", identity="a", lease_duration=5, renew_deadline=3,
                      retry_period=0.02)
    a = LeaderElector(lambda: api, cfg)

    async def scenario() -> None:
        assert await a.try_acquire_or_renew()
        api.set_spec(holderIdentity="intruder")
        await asyncio.wait_for(a.hold(), 1)

    run(scenario())
    assert not a.leading and a.lost_to == "intruder"


def test_acquire_waits_for_a_holder_that_stopped_renewing() -> None:
    api = FakeLeases()
    cfg = LeaseConfig(namespace="ns", name="op", identity="b", lease_duration=0.3, renew_deadline=0.2,
                      retry_period=0.1)
    dead = LeaderElector(lambda: api, LeaseConfig(namespace="ns", name="op", identity="a"))
    b = LeaderElector(lambda: api, cfg)

    async def scenario() -> float:
        assert await dead.try_acquire_or_renew()
        api.set_spec(leaseDurationSeconds=0.3)  # as if "a" had asked for a short lease
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(b.acquire(), 2)
        return loop.time() - started

    took = run(scenario())
    assert b.leading and api.spec()["holderIdentity"] == "b"
    assert 0.3 <= took < 0.6


def test_timing_must_leave_the_old_leader_time_to_stop() -> None:
    with pytest.raises(ValueError, match="renew deadline"):
        LeaseConfig(namespace="ns", name="op", identity="a", lease_duration=5, renew_deadline=5)


def test_still_leading_turns_false_past_the_renew_deadline_before_the_renew_loop_notices() -> None:
    api, clock = FakeLeases(), Clock()
    a = elector(api, "a", clock)
    assert not a.still_leading()
    run(a.try_acquire_or_renew())
    clock.now += 6.9
    assert a.still_leading()
    clock.now += 0.2  # e.g. the process was frozen: its writes are fenced off at once
    assert a.leading and not a.still_leading()


class Login:
    """What `ElectionThread` uses of a `Kube` login: `sibling`, here a view of the fake that records
    the threads it is called on, and whether it was closed."""

    def __init__(self, api: FakeLeases) -> None:
        self.api = api
        self.siblings: list[Sibling] = []

    def sibling(self) -> Sibling:
        self.siblings.append(Sibling(self.api))
        return self.siblings[-1]


class Sibling:
    def __init__(self, api: FakeLeases) -> None:
        self.api = api
        self.threads: set[int] = set()
        self.closed = False

    async def get(self, path: str) -> Body | None:
        self.threads.add(threading.get_ident())
        return await self.api.get(path)

    async def create(self, path: str, body: Body) -> Body | None:
        self.threads.add(threading.get_ident())
        return await self.api.create(path, body)

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        self.threads.add(threading.get_ident())
        return await self.api.request(method, path, body)

    async def close(self) -> None:
        self.closed = True


def test_the_election_thread_renews_with_a_client_of_its_own_for_each_login() -> None:
    api = FakeLeases()
    logins = [Login(api)]
    cfg = LeaseConfig(namespace="ns", name="op", identity="a", lease_duration=5, renew_deadline=3,
                      retry_period=0.02)
    election = ElectionThread(lambda: cast(Kube, logins[-1]), cfg)

    async def scenario() -> None:
        await asyncio.wait_for(election.acquire(), 5)
        holding = asyncio.create_task(election.hold())
        # This loop blocked (the wait below sleeps on it): the thread renews on its own, and
        # after a new login with a client made of that login, the old one closed.
        writes = api.writes
        wait_for(lambda: api.writes > writes + 2, 5, "renewals while the loop is blocked", interval=0.01)
        logins.append(Login(api))
        wait_for(lambda: bool(logins[1].siblings) and api.writes > writes + 5 and logins[0].siblings[0].closed,
                 5, "renewals with the new login's client, the old one closed", interval=0.01)
        assert not holding.done() and election.elector.still_leading()
        holding.cancel()  # as App.stop: the term's wait cancelled, then the Lease released
        assert await asyncio.wait_for(election.release(), 5)
        await election.close()

    asyncio.run(scenario())
    assert api.spec()["holderIdentity"] == ""
    (old,), (new,) = logins[0].siblings, logins[1].siblings
    assert old.closed and new.closed
    used = old.threads | new.threads
    assert len(used) == 1 and threading.get_ident() not in used
    assert not any(t.ident in used for t in threading.enumerate()), "the thread ended"
