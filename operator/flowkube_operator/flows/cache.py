"""The operator's view of the cluster: Flows and runner pods as the two watches last saw them.

Every replica keeps it warm (informer.py feeds `flow_event` and `pod_event`); the state API asks it
which pod is a Flow's running attempt and what a warm pod is waiting for, without a request to the
API server; `controller.Controller` reads it to reconcile, and is woken by it (``wake``) to queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from flowkube_api import constants as c
from flowkube_operator import projections, selfmetrics
from flowkube_operator.flows.reconcile.forks import kept
from flowkube_operator.kube.client import Kube, flow_path, ns_path
from flowkube_operator.kube.informer import Informer
from flowkube_operator.meta import PodView

Body = dict[str, Any]
Key = tuple[str, str]  # (namespace, flow name)
# Told of every change of a cached Flow: (key, the Flow as cached), or (key, None) once it is gone.
FlowListener = Callable[[Key, Body | None], None]


def compact(body: Body) -> bytes:
    """A Flow as the cache keeps it: its JSON in a bytes object of exactly its size. orjson's own
    answer keeps the buffer it grew while writing (8.2 kB of memory for 3.0 kB of JSON, measured):
    at 10,000 Flows the difference was 40 MB of the operator's memory."""
    return memoryview(orjson.dumps(body)).tobytes()


def _rv(body: Body) -> int:
    try:
        return int(body.get("metadata", {}).get("resourceVersion", 0))
    except (TypeError, ValueError):
        return 0


class FlowCache:
    """The cached Flows and runner pods; ``listeners`` hear every change of a cached Flow, ``wake``
    every change a Flow's reconcile reads (the Flow, or one of its pods), ``stale_warm`` of a warm pod
    waiting on something the cached status does not show yet (its report should be read)."""

    def __init__(self, listeners: Sequence[FlowListener] = (), *, wake: Callable[[Key], None] = lambda key: None,
                 stale_warm: Callable[[Key], None] = lambda key: None,
                 labels: Callable[[str], frozenset[str]] = lambda namespace: frozenset()) -> None:
        # Flows are kept as compact JSON: a parsed status is ~10x larger as Python objects, and
        # most cached Flows are finished ones that are rarely read again.
        self.flows: dict[Key, tuple[int, str, bytes]] = {}  # (resourceVersion, uid, JSON)
        self.pods: dict[Key, dict[str, PodView]] = {}
        self._active: dict[Key, str] = {}  # Flow -> the pod of its running attempt
        self._active_pods: dict[tuple[str, str], tuple[str, str]] = {}  # (ns, pod) -> (flow, flow uid)
        self._pod_seen: dict[tuple[str, str], float] = {}  # (namespace, pod) -> monotonic time of its last event
        self._listeners = tuple(listeners)
        self._changed: dict[Key, asyncio.Event] = {}  # set when the Flow changes: wakes the long polls
        self._wake, self._stale_warm = wake, stale_warm
        self._labels = labels  # per namespace, the label keys kept beyond the operator's own (quota selectors')

    def informers(self, kube: Callable[[], Kube | None], namespaces: list[str]) -> list[Informer]:
        """The two watches that feed the caches: Flows and runner pods, cluster-wide or per namespace.
        Every replica runs them (followers serve the state API and metrics from the same caches)."""
        runner_pods = f"{c.LABEL_MANAGED_BY}={c.MANAGED_BY},{c.LABEL_COMPONENT}={c.COMPONENT_RUNNER}"
        out = []
        for ns in namespaces or [""]:
            flows = flow_path(ns) if ns else f"/apis/{c.GROUP}/{c.VERSION}/{c.PLURAL}"
            pods = ns_path(ns, "pods") if ns else "/api/v1/pods"
            out.append(Informer(kube, flows, c.API_VERSION, c.KIND, self.flow_event))
            out.append(Informer(kube, pods, "v1", "Pod", self.pod_event, label_selector=runner_pods))
        return out

    def flow_event(self, event_type: str, body: Body) -> None:
        """A Flow's watch event (or our own write's answer): kept as its projection (projections.flow),
        which is also what the listeners hear."""
        body = projections.flow(body, self._labels(str((body.get("metadata") or {}).get("namespace") or "")))
        meta = body["metadata"]
        key = (meta.get("namespace", ""), meta.get("name", ""))
        cached = self.flows.get(key)
        if event_type == "DELETED":
            if cached is not None and cached[1] != meta.get("uid"):
                return  # an earlier Flow of this name, deleted (its late DELETED after a relist)
            self.flows.pop(key, None)
            self.pods.pop(key, None)
            self._track_active(key, "", None)
            self._tell(key, None)
        else:
            rv = _rv(body)
            if cached is not None and (cached[0] > rv or (cached[0] == rv != 0 and cached[1] == meta.get("uid"))):
                # Older than what we know: a late answer to our own write, or a late event of an
                # earlier Flow of this name (resourceVersions are comparable across objects here).
                # The same: the watch's echo of our own status write, already taken from its answer.
                return
            self.flows[key] = (rv, meta.get("uid", ""), compact(body))
            self._track_active(key, meta.get("uid", ""), body)
            self._tell(key, body)
            self._wake(key)
        changed = self._changed.pop(key, None)
        if changed is not None:
            changed.set()
        selfmetrics.FLOWS_CACHED.set(len(self.flows))

    def pod_event(self, event_type: str, body: Body) -> None:
        meta = body.get("metadata") or {}
        flow = (meta.get("labels") or {}).get(c.LABEL_FLOW)
        if not flow:
            return
        key = (meta.get("namespace", ""), flow)
        pods = self.pods.setdefault(key, {})
        if event_type == "DELETED":
            pods.pop(meta.get("name", ""), None)
            self._pod_seen.pop((key[0], meta.get("name", "")), None)
            if not pods:
                self.pods.pop(key, None)
        else:
            self._pod_seen[(key[0], meta.get("name", ""))] = time.monotonic()
            view = PodView.from_pod(body)
            known = pods.get(view.name)
            if known is not None and known.resource_version > view.resource_version:
                return  # older than what we know (our own create's answer can lag the watch)
            pods[view.name] = view
            if known is not None and dataclasses.replace(known, resource_version=view.resource_version) == view:
                return  # nothing the reconcile reads changed (the scheduler's binding, a new IP)
        if key in self.flows:
            self._wake(key)

    def silent_pods(self, seconds: float, limit: int) -> list[tuple[Key, PodView]]:
        """The running pods of active runs the watch has said nothing of for ``seconds``, the longest
        silent first (at most ``limit``)."""
        now, due = time.monotonic(), []
        for key, pod_name in self._active.items():
            view = self.pods.get(key, {}).get(pod_name)
            seen = self._pod_seen.get((key[0], pod_name))
            if view is not None and not view.terminated and seen is not None and now - seen >= seconds:
                due.append((seen, key, view))
        return [(key, view) for _, key, view in sorted(due, key=lambda d: d[0])[:limit]]

    def flow(self, key: Key) -> Body | None:
        """The cached Flow, parsed (a copy: the caller may change it)."""
        cached = self.flows.get(key)
        return orjson.loads(cached[2]) if cached is not None else None

    def checkpoints_kept(self, namespace: str, flow: str) -> int:
        """The cached Flow's ``spec.checkpoints.keep`` (a checkpoint's slot in its ring)."""
        body = self.flow((namespace, flow))
        return kept((body or {}).get("spec"))

    def _tell(self, key: Key, body: Body | None) -> None:
        for listener in self._listeners:
            listener(key, body)

    async def changed(self, key: Key, seconds: float) -> None:
        """Wait until the cached Flow changes, for at most ``seconds`` (the state API's long polls)."""
        event = self._changed.setdefault(key, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), seconds)

    def _track_active(self, key: Key, uid: str, body: Body | None) -> None:
        """Which pod is each Flow's running attempt (the unfinished last run), for the state API."""
        runs = ((body or {}).get("status") or {}).get("runs") or []
        pod = runs[-1].get("pod") if runs and isinstance(runs[-1], dict) and not runs[-1].get("finishedAt") else None
        old = self._active.pop(key, None)
        if old is not None:
            self._active_pods.pop((key[0], old), None)
        if pod:
            self._active[key] = pod
            self._active_pods[(key[0], pod)] = (key[1], uid)

    def active_run(self, namespace: str, pod: str) -> tuple[str, str, str] | None:
        """(flow, flow uid, pod uid or "" if its watch event is not in yet) when `pod` is a Flow's
        running attempt; None otherwise. O(1): the state API asks on every request."""
        hit = self._active_pods.get((namespace, pod))
        if hit is None:
            return None
        flow, uid = hit
        view = self.pods.get((namespace, flow), {}).get(pod)
        return flow, uid, view.uid if view is not None and view.owner_uid == uid else ""

    def _warm_status(self, namespace: str, flow: str, pod: str) -> tuple[Body | None, Body | None]:
        """(the Flow's cached status, None) while ``pod`` is its running attempt; else (None, why)."""
        cached = self.flows.get((namespace, flow))
        if cached is None:
            return None, {"message": f"flow {namespace}/{flow} is gone"}
        status: Body = orjson.loads(cached[2]).get("status") or {}
        runs = status.get("runs") or []
        if not runs or runs[-1].get("pod") != pod or runs[-1].get("finishedAt"):
            return None, {"message": f"the run of pod {pod} is closed"}
        if status.get("phase") in c.TERMINAL_PHASES:
            return None, {"message": f"the flow is {status.get('phase')}"}
        return status, None

    def message_for(self, namespace: str, flow: str, pod: str, after: int) -> tuple[int, Body | None]:
        """A warm pod's long poll, from the cache: (200, the message after ``after``) once it is accepted
        for this pod; (204, None) while there is none; (410, why) when none will come to this pod."""
        status, gone = self._warm_status(namespace, flow, pod)
        if status is None:
            return 410, gone
        conv = status.get("conversation") or {}
        if conv.get("ended"):
            return 410, {"message": "the conversation has ended"}
        pending = conv.get("pending") or {}
        if pending.get("turn") == after + 1:
            return 200, {"turn": after + 1, "text": pending.get("text", ""), "sender": pending.get("sentBy")}
        turns = int(conv.get("turns") or 0)
        if turns > after:
            return 410, {"message": f"message {after + 1} was answered already"}
        if turns < after or not conv.get("sessionId"):
            self._stale_warm((namespace, flow))
        return 204, None

    def answer_for(self, namespace: str, flow: str, pod: str, request_id: str) -> tuple[int, Body | None]:
        """A warm paused pod's long poll: (200, the answer to ``request_id``) once it is accepted;
        (204, None) while the request pends; (410, why) when no answer will come to this pod."""
        status, gone = self._warm_status(namespace, flow, pod)
        if status is None:
            return 410, gone
        fb = status.get("feedback") or {}
        if (fb.get("request") or {}).get("id") == request_id:
            return 204, None
        answer = next((h for h in fb.get("history") or [] if h.get("requestId") == request_id), None)
        if answer is None:
            self._stale_warm((namespace, flow))
            return 204, None
        return 200, {"requestId": request_id, "text": answer.get("response") or "",
                     "timedOut": bool(answer.get("timedOut")), "outcome": answer.get("outcome")}
