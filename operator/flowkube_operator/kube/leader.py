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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from flowkube_operator.kube.client import ApiError, ns_path

Body = dict[str, Any]
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
        self.leading = False
        self.renewed_at = 0.0  # when the last successful acquire or renewal was sent (monotonic)
        self.lost_to = ""  # the other holder seen while leading, if that is how leadership ended

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
                self.leading = False
                return False
            self._observe(created, self._clock())
            log.info("became the leader (lease %s/%s created)", cfg.namespace, cfg.name)
            self.leading, self.renewed_at = True, sent
            return True
        # Observed when the answer came: the record cannot have been written later than that.
        self._observe(lease, self._clock())
        holder = self.holder
        if holder and holder != me and self.expires_in() > 0:
            if self.leading:
                self.lost_to = holder
            self.leading = False
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
        self.leading, self.renewed_at = True, sent
        return True

    def still_leading(self) -> bool:
        """Whether this process may still write: it leads and its last renewal is within the renew
        deadline. Checked before every write, so a process that was frozen (or starved) past its
        deadline writes nothing even before its renew loop notices."""
        return self.leading and self._clock() - self.renewed_at < self.config.renew_deadline

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
                self.leading = False
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
        self.leading = False
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
