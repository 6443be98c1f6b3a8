"""Applying a Flow's plan: the runner pod and the one status write, in the order the run's intent
says (see `flows.reconcile`'s docstring), old reports pruned, pods stopped, Events posted, the Flow
deleted when its TTL has passed. Every write goes through the shell's `Writes` (the fence first)."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from flowkube_api import constants as c
from flowkube_api import traces
from flowkube_api.base import now as now_utc
from flowkube_api.base import parse_time
from flowkube_api.traces import SpanRecord
from flowkube_operator import selfmetrics
from flowkube_operator.flows import checkpoints, resources
from flowkube_operator.flows.cache import FlowCache, Key
from flowkube_operator.flows.reconcile import Plan, RunIntent
from flowkube_operator.flows.spans import spans_of
from flowkube_operator.kube.client import ApiError, collection_path, delete_namesake_garbage, flow_path, ns_path
from flowkube_operator.kube.shell import RetryLater, Writes
from flowkube_operator.meta import owner_uid
from flowkube_operator.settings import Settings

Body = dict[str, Any]
log = logging.getLogger("flowkube.controller")


class ForeignObjectError(RetryLater):
    """An object we would create exists, owned by another Flow (an earlier one of the same name), or
    (a template snapshot) holding something else."""


class SpanSink(Protocol):
    """Where the spans of a status write go (``tracing.Traces``), tracing on."""

    def emit(self, records: list[SpanRecord]) -> None: ...

    def runner_lost(self, spans: int) -> None: ...


class PlanWriter:
    """The writes of a Flow's plan, through ``writes``; what it writes goes into ``cache`` at once."""

    def __init__(self, writes: Writes, cache: FlowCache, settings: Settings, state_ca: str,
                 spans: SpanSink | None = None) -> None:
        self.writes, self.cache, self.settings, self.state_ca = writes, cache, settings, state_ca
        self.spans = spans

    async def apply(self, key: Key, body: Body, p: Plan) -> Body:
        """Make the plan so: the pod and the one status write (in the order the intent says), old
        reports pruned, pods stopped, Events posted, the Flow deleted (TTL) or looked at again later.
        Returns the Flow as written (the caller queues it again if the plan says when)."""
        ns, name = key
        old_status = body.get("status") or {}
        intent = p.create_pod
        if p.fork_state is not None:  # a fork's own state, before the status that says it forked
            self.writes.may_write()
            await checkpoints.copy_into_state(self.writes.client(), body, p.fork_state)
        # Runner pods need nothing else made for them: their state goes through the state API (see
        # stateapi). A kickoff or retry pod comes first, then the one status write that records its
        # run and startedAt; a resume or turn is recorded first (see reconcile's docstring).
        if intent is not None and intent.first:
            await self._create_first(key, body, p, intent)
        new_status = p.status.dump()
        if self.spans is not None and "trace" not in new_status and body["metadata"].get("uid"):
            new_status["trace"] = {"traceId": traces.trace_id(str(body["metadata"]["uid"]))}
        if new_status != old_status:
            body = await self._write_status(key, body, old_status, new_status)
        if intent is not None and not intent.first:
            await self._create_runner_pod(body, p, intent)
        if p.prune_reports:
            await self._prune_reports(ns, name, p.prune_reports)
        for doomed in p.delete_pods:
            # Only the pod the plan saw, by the uid it saw (not the cache's entry now, which may be
            # gone or another pod's): a Flow re-created under the same name may have a new pod of
            # that name by now, which a reconcile still holding the old body must not delete.
            await self.writes.delete(ns_path(ns, "pods", doomed.name), doomed)
        for etype, reason, message in p.events:
            self.writes.event(body, etype, reason, message)
        if p.delete_flow is not None:
            await self.writes.delete(flow_path(ns, name), p.delete_flow)
        return body

    async def _create_first(self, key: Key, body: Body, p: Plan, intent: RunIntent) -> None:
        """A kickoff's or retry's pod, before the status write that records its run with the pod's
        creation time as startedAt."""
        try:
            created = await self._create_runner_pod(body, p, intent)
        except (ApiError, ForeignObjectError):
            # Record the run anyway (started_at unset: "recorded, never seen", created again later),
            # so `kubectl get` shows it Pending while the event says why its pod cannot be made.
            old_status, recorded = body.get("status") or {}, p.status.dump()
            if recorded != old_status:
                await self._write_status(key, body, old_status, recorded)
            raise
        run = p.status.runs[intent.index] if p.status.runs else None
        if run is not None and run.started_at is None:
            run.started_at = parse_time(created["metadata"].get("creationTimestamp")) or now_utc()

    async def _write_status(self, key: Key, body: Body, old_status: Body, new_status: Body) -> Body:
        """The one status write of a reconcile; the cache takes its answer at once."""
        body = await self.writes.status(flow_path(*key, sub="status"), body, old_status, new_status)
        self.cache.flow_event("MODIFIED", body)
        _observe_turn(key[0], old_status, new_status)
        if self.spans is not None:
            records = spans_of(body.get("metadata") or {}, old_status, new_status, now_utc())
            self.spans.emit(records)
            self.spans.runner_lost(sum(int(r.attributes.get("flowkube.run.spans_lost", 0)) for r in records))
        return body

    async def _create_runner_pod(self, flow: Body, p: Plan, intent: RunIntent) -> Body:
        """The intent's pod, with the spec the plan resolved, created, or found already there (ours):
        the pod as the API server has it."""
        assert p.spec is not None
        pod = resources.runner_pod(
            flow, p.spec, index=intent.index, trigger=intent.trigger, settings=self.settings,
            feedback=intent.feedback, message=intent.message, prior=intent.prior,
            active_deadline_seconds=intent.active_deadline_seconds, state_ca=self.state_ca,
            keep_warm_seconds=intent.keep_warm_seconds,
            feedback_keep_warm_seconds=intent.feedback_keep_warm_seconds,
        )
        self.writes.may_write()
        try:
            created, existing = await self._create_owned(pod)
        except ApiError as e:
            if e.status != 409:  # quota, an invalid podTemplate, Pod Security: say so where users look
                self.writes.event(flow, "Warning", "FailedCreate", f"runner pod {pod['metadata']['name']}: {e}")
            raise
        if created is not None:
            selfmetrics.RUN_PODS_CREATED.labels(intent.trigger.value).inc()
            self.cache.pod_event("ADDED", created)
            return created
        if existing is None:  # gone again between the AlreadyExists and the read: plan again
            raise ApiError(409, "it vanished after AlreadyExists", "POST", collection_path(pod))
        return existing

    async def _prune_reports(self, ns: str, name: str, pods: list[str]) -> None:
        """Best effort: a report left behind costs ConfigMap space, not correctness."""
        self.writes.may_write()
        try:
            await self.writes.client().merge_patch(ns_path(ns, "configmaps", c.state_configmap_name(name)),
                                                   {"binaryData": {c.report_key(pod): None for pod in pods}})
        except ApiError as e:
            if e.status != 404:
                log.warning("could not drop %d old run reports of %s/%s: %s", len(pods), ns, name, e)

    async def _create_owned(self, obj: Body) -> tuple[Body | None, Body | None]:
        """Create obj: (created, None), or (None, the existing one) when it already exists and is ours
        (deterministic names make that success). One left by an earlier Flow of the same name, not yet
        garbage-collected, raises."""
        kube = self.writes.client()
        created = await kube.create(collection_path(obj), obj)
        if created is not None:
            return created, None
        meta = obj["metadata"]
        path = f"{collection_path(obj)}/{meta['name']}"
        existing = await kube.get(path)
        mine = owner_uid(meta)
        if existing is not None and owner_uid(existing["metadata"]) != mine:
            await delete_namesake_garbage(kube, path, existing, meta["ownerReferences"][0]["name"], mine)
            raise ForeignObjectError(f"{obj['kind']} {meta['namespace']}/{meta['name']} still belongs to an "
                                     "earlier Flow of the same name; waiting for it to be gone")
        return None, existing


def _observe_turn(namespace: str, old: Body, new: Body) -> None:
    """A reply just landed in status: the message's wait, from accepted to answered."""
    before, after = old.get("conversation") or {}, new.get("conversation") or {}
    sent = parse_time((before.get("pending") or {}).get("sentAt"))
    if sent is None or after.get("turns", 0) <= before.get("turns", 0):
        return
    seconds = (now_utc() - sent).total_seconds()
    selfmetrics.TURN_SECONDS.labels(namespace, str(new.get("definition") or "")).observe(max(seconds, 0.0))
