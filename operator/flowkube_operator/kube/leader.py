"""Leader election over a coordination.k8s.io/v1 Lease, the way client-go's leaderelection does it.

Every operator replica watches Flows and pods, serves the state API and the webhooks; only the
holder of the Lease runs the reconcile workers, so Flow status keeps exactly one writer.

- **Acquire and renew** read the Lease and write it back with its `resourceVersion` (a PUT, or a
  create when there is none): of two replicas racing for it, exactly one write succeeds and the
  other gets a 409 and stays a follower.
- **Expiry is judged by this process's own clock**: a Lease held by someone else counts as expired
  only when its record has not changed for `leaseDurationSeconds` since *this* process last saw it
  change (monotonic time), never by comparing `renewTime` with the local wall clock. Clock skew
  between nodes cannot make two leaders; the price is that a replica that has just started waits a
  full lease duration before it takes over a Lease it finds held.
- **A holder that cannot renew** for `renew_deadline` (shorter than the lease duration, counted
  from the start of its last successful renewal) stops leading before any other replica may take
  over; it also stops at once when it sees another holder.
- **A thread of its own** (`ElectionThread`, as client-go renews on a goroutine of its own): acquire,
  renew and release run on their own thread, event loop and API client (`Kube.sibling`: the same
  login, connections of their own), so a busy operator loop (CPU-bound reconciles, a long
  synchronous section) delays no renewal and cannot cost the Lease while the API server answers.
  The operator's loop awaits `acquire`, `hold` and `release` as it would the coroutines; the thread
  replaces (leading, renewed_at) as one tuple, so `still_leading`, called before every write on the
  operator's loop, reads both of one moment without a lock. What the thread cannot get past is a
  single C call that holds the GIL for seconds (Python code yields it every 5 ms, I/O releases it).
- **Identity** is the pod's name (its hostname): a container restarted in the same pod finds the
  Lease held by its own name, knows its predecessor is dead, and takes it back at once (counted
  as a transition: a new process is a new term, unlike client-go).
- **Release**: on a clean shutdown the holder clears `holderIdentity` (duration 1 s), so a follower
  takes over at its next try instead of waiting for the lease to run out.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from flowkube_operator.kube.client import ApiError, Kube, ns_path

Body = dict[str, Any]
T = TypeVar("T")
log = logging.getLogger("flowkube.leader")

GROUP, VERSION, PLURAL = "coordination.k8s.io", "v1", "leases"


class LeaseClient(Protocol):
    """What the elector needs of `kube.Kube` (a fake in the unit tests)."""

    async def get(self, path: str) -> Body | None: ...

    async def create(self, path: str, body: Body) -> Body | None: ...

    async def request(self, method: str, path: str, body: Any = None) -> Any: ...


def micro_time(t: dt.datetime) -> str:
    """A MicroTime as the API server writes it."""
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class LeaseConfig:
    namespace: str
    name: str
    identity: str
    lease_duration: float = 10.0
    renew_deadline: float = 7.0
    retry_period: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError("leader election needs 0 < retry period < renew deadline < lease duration")


class LeaderElector:
    """The election on one event loop (the `ElectionThread`'s in the operator); `still_leading` may be
    called from any thread."""

    def __init__(self, client: Callable[[], LeaseClient | None], config: LeaseConfig, *,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)) -> None:
        self._client = client
        self.config = config
        self._clock = clock
        self._wall = wall
        self._lease: Body | None = None  # the Lease as last read or written
        self._observed: Body | None = None  # its spec, and when this process saw it change
        self._observed_at = 0.0
        # (leading, when the last successful acquire or renewal was sent (monotonic)): replaced whole,
        # so a reader on another thread sees both of one moment.
        self._term = (False, 0.0)
        self.lost_to = ""  # the other holder seen while leading, if that is how leadership ended

    @property
    def leading(self) -> bool:
        return self._term[0]

    @property
    def renewed_at(self) -> float:
        return self._term[1]

    def _stop_leading(self) -> None:
        self._term = (False, self.renewed_at)

    @property
    def path(self) -> str:
        return ns_path(self.config.namespace, PLURAL, self.config.name, group=GROUP, version=VERSION)

    @property
    def holder(self) -> str:
        return str((self._observed or {}).get("holderIdentity") or "")

    def _observe(self, lease: Body, now: float) -> None:
        self._lease = lease
        spec = lease.get("spec") or {}
        if spec != self._observed:
            self._observed, self._observed_at = spec, now

    def expires_in(self, now: float | None = None) -> float:
        """Seconds until the observed Lease counts as expired to this process (<= 0: it has)."""
        if self._observed is None:
            return 0.0
        now = self._clock() if now is None else now
        duration = float(self._observed.get("leaseDurationSeconds") or 0)
        return self._observed_at + duration - now

    def _spec(self, stamp: str, acquired: str, transitions: int) -> Body:
        # Whole seconds in the API: rounded up, so a follower never waits less than the holder assumes.
        return {"holderIdentity": self.config.identity,
                "leaseDurationSeconds": max(1, math.ceil(self.config.lease_duration)),
                "acquireTime": acquired, "renewTime": stamp, "leaseTransitions": transitions}

    async def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this process holds the Lease afterwards. Sets `leading`."""
        client = self._client()
        if client is None:
            return False
        try:
            return await self._try(client)
        except ApiError as e:
            if e.status != 409:  # a conflict: someone else wrote the Lease since we read it
                log.warning("lease %s/%s: %s", self.config.namespace, self.config.name, e)
            return False

    async def _try(self, client: LeaseClient) -> bool:
        cfg, me = self.config, self.config.identity
        # A holder counts its renew deadline from before its write: a follower can only have seen
        # the write after it was sent.
        sent = self._clock()
        stamp = micro_time(self._wall())
        lease = await client.get(self.path)
        if lease is None:
            body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Lease",
                    "metadata": {"name": cfg.name, "namespace": cfg.namespace},
                    "spec": self._spec(stamp, stamp, 0)}
            created = await client.create(ns_path(cfg.namespace, PLURAL, group=GROUP, version=VERSION), body)
            if created is None:  # another replica created it first
                self._stop_leading()
                return False
            self._observe(created, self._clock())
            log.info("became the leader (lease %s/%s created)", cfg.namespace, cfg.name)
            self._term = (True, sent)
            return True
        # Observed when the answer came: the record cannot have been written later than that.
        self._observe(lease, self._clock())
        holder = self.holder
        if holder and holder != me and self.expires_in() > 0:
            if self.leading:
                self.lost_to = holder
            self._stop_leading()
            return False
        old = self._observed or {}
        renewing = self.leading and holder == me
        transitions = int(old.get("leaseTransitions") or 0)
        spec = self._spec(stamp, str(old.get("acquireTime") or stamp) if renewing else stamp,
                          transitions if renewing else transitions + 1)
        updated: Body = await client.request("PUT", self.path, {**lease, "spec": spec})
        self._observe(updated, self._clock())
        if not renewing:
            how = ("taken back: this pod's previous container held it" if holder == me
                   else f"taken over from {holder}" if holder else "was free")
            log.info("became the leader (lease %s/%s %s)", cfg.namespace, cfg.name, how)
        self._term = (True, sent)
        return True

    def still_leading(self) -> bool:
        """Whether this process may still write: it leads and its last renewal is within the renew
        deadline. Checked before every write, so a process that was frozen (or starved) past its
        deadline writes nothing even before its renew loop notices."""
        leading, renewed_at = self._term
        return leading and self._clock() - renewed_at < self.config.renew_deadline

    async def _attempt(self, within: float) -> bool:
        try:
            async with asyncio.timeout(max(0.05, within)):
                return await self.try_acquire_or_renew()
        except Exception as e:  # a timeout or a transport error is one failed attempt, never a crash
            log.warning("lease %s/%s: %s %s", self.config.namespace, self.config.name, type(e).__name__, e)
            return False

    async def acquire(self) -> None:
        """Return once this process leads. A follower tries every retry period, and exactly when the
        Lease it watches runs out if that is sooner."""
        cfg = self.config
        logged = ""
        while not await self._attempt(cfg.renew_deadline):
            if self.holder and self.holder != logged:
                logged = self.holder
                log.info("following %s (lease %s/%s)", logged, cfg.namespace, cfg.name)
            remaining = self.expires_in()
            await asyncio.sleep(min(cfg.retry_period, remaining) if remaining > 0 else cfg.retry_period)

    async def hold(self) -> None:
        """Renew every retry period while leading; return when leadership is lost: no renewal
        succeeded within the renew deadline (counted from when the last good one was sent), or
        another holder was seen."""
        cfg = self.config
        wait = cfg.retry_period
        while True:
            await asyncio.sleep(wait)
            left = cfg.renew_deadline - (self._clock() - self.renewed_at)
            if left > 0 and not self.lost_to and await self._attempt(left):
                wait = cfg.retry_period
                continue
            left = cfg.renew_deadline - (self._clock() - self.renewed_at)
            if self.lost_to or left <= 0:
                self._stop_leading()
                log.error("lost the lease %s/%s (%s)", cfg.namespace, cfg.name,
                          f"now held by {self.lost_to}" if self.lost_to
                          else f"no renewal for {cfg.renew_deadline - left:.1f}s")
                return
            wait = min(cfg.retry_period, left)  # try again, and give up no later than the deadline

    async def release(self) -> bool:
        """Give the Lease up (holder cleared, duration 1 s) if this process holds it, so another
        replica takes over at once. True when released."""
        if not self.leading or self._lease is None:
            return False
        self._stop_leading()
        client = self._client()
        if client is None:
            return False
        stamp = micro_time(self._wall())
        old = self._lease.get("spec") or {}
        spec = {"holderIdentity": "", "leaseDurationSeconds": 1, "acquireTime": stamp, "renewTime": stamp,
                "leaseTransitions": int(old.get("leaseTransitions") or 0)}
        try:
            released: Body = await client.request("PUT", self.path, {**self._lease, "spec": spec})
        except ApiError as e:
            log.warning("could not release the lease %s/%s: %s", self.config.namespace, self.config.name, e)
            return False
        self._observe(released, self._clock())
        log.info("released the lease %s/%s", self.config.namespace, self.config.name)
        return True


class ElectionThread:
    """A `LeaderElector` on a thread of its own, with its own event loop and its own client (made
    there from the latest login's with `Kube.sibling`, and made again after a new login). The
    operator's loop awaits `acquire`, `hold` and `release`; each runs on the thread, its outcome is
    set on the awaiting loop by `call_soon_threadsafe`, and cancelling the wait cancels it there.
    The thread starts with the first of them; `close` ends it."""

    def __init__(self, login: Callable[[], Kube | None], config: LeaseConfig) -> None:
        self._login = login
        self.elector = LeaderElector(self._client, config)
        # On the thread only: its client (made from the login `_own_of`), the clients of older
        # logins being closed, and the renewals once the Lease is ours.
        self._own: Kube | None = None
        self._own_of: Kube | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._holding: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def acquire(self) -> None:
        """Return once this process leads. The thread renews from then on without waiting for
        this loop: a loop busy between `acquire` and `hold` costs nothing either."""
        await self._on_thread(self._acquire())

    async def hold(self) -> None:
        """Return when leadership is lost (`LeaderElector.hold`)."""
        await self._on_thread(self._hold())

    async def release(self) -> bool:
        """Stop renewing and give the Lease up (`LeaderElector.release`)."""
        return await self._on_thread(self._release())

    async def close(self) -> None:
        """Stop renewing, close the thread's clients and end the thread."""
        if self._thread is None or self._loop is None:
            return
        await self._on_thread(self._wind_up())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()
        self._thread = self._loop = None

    def _on_thread(self, coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="flowkube-lease", daemon=True)
            self._thread.start()
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    # -- on the thread ------------------------------------------------------------------------------

    async def _acquire(self) -> None:
        await self.elector.acquire()
        self._holding = asyncio.create_task(self.elector.hold())

    async def _hold(self) -> None:
        if self._holding is None:
            raise RuntimeError("hold before acquire")
        await self._holding  # cancelled with the caller's wait

    async def _release(self) -> bool:
        await self._stop_holding()
        return await self.elector.release()

    async def _stop_holding(self) -> None:
        if self._holding is not None:
            self._holding.cancel()
            await asyncio.wait([self._holding])
            self._holding = None

    def _client(self) -> Kube | None:
        """Its own client, of the latest login."""
        login = self._login()
        if login is None:
            return None
        if login is not self._own_of:
            old, self._own, self._own_of = self._own, login.sibling(), login
            if old is not None:
                closing = asyncio.get_running_loop().create_task(old.close())
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
        return self._own

    async def _wind_up(self) -> None:
        await self._stop_holding()
        await asyncio.gather(*self._closing)
        if self._own is not None:
            await self._own.close()
        self._own = self._own_of = None
