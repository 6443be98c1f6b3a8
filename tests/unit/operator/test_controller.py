"""The controller's caches and queue, without a cluster: ordering and de-duplication."""

from __future__ import annotations

import asyncio
from typing import Any

from flowkube_operator.flows.controller import Controller
from flowkube_operator.kube.workqueue import WorkQueue, merge_patch
from flowkube_operator.settings import Settings


def pod(phase: str, rv: int) -> dict[str, Any]:
    return {"metadata": {"name": "f-0", "namespace": "ns", "resourceVersion": str(rv),
                         "labels": {"flowkube.io/flow": "f"}},
            "status": {"phase": phase}}


def flow(rv: int, phase: str) -> dict[str, Any]:
    return {"metadata": {"name": "f", "namespace": "ns", "uid": "u", "resourceVersion": str(rv),
                         "managedFields": [{"manager": "kubectl"}]},
            "spec": {"flowRef": "a:B"}, "status": {"phase": phase}}


def test_a_late_answer_to_our_own_create_does_not_overwrite_what_the_watch_said() -> None:
    ctl = Controller(Settings())
    ctl.cache.pod_event("MODIFIED", pod("Running", 7))
    ctl.cache.pod_event("ADDED", pod("Pending", 5))  # the POST's response, delivered after the watch event
    assert ctl.cache.pods[("ns", "f")]["f-0"].phase == "Running"
    ctl.cache.pod_event("DELETED", pod("Running", 9))
    assert ("ns", "f") not in ctl.cache.pods


def test_older_flow_events_are_ignored_and_managed_fields_are_not_kept() -> None:
    seen: list[Any] = []
    ctl = Controller(Settings(), listeners=[lambda k, b: seen.append(b)])
    ctl.cache.flow_event("MODIFIED", flow(10, "Running"))
    ctl.cache.flow_event("MODIFIED", flow(8, "Pending"))
    assert len(seen) == 1 and b"Running" in ctl.cache.flows[("ns", "f")][2]
    assert b"managedFields" not in ctl.cache.flows[("ns", "f")][2]
    ctl.cache.flow_event("DELETED", flow(11, "Running"))
    assert ("ns", "f") not in ctl.cache.flows and seen[-1] is None


def test_late_events_of_an_earlier_flow_of_the_same_name_leave_the_new_one_alone() -> None:
    # kopf handles each uid on its own, so a deleted Flow's last events can come after its
    # namesake's: they must not replace it in the caches (nor, through them, its pods or state).
    ctl = Controller(Settings())
    new = flow(20, "Running")
    new["metadata"]["uid"] = "new"
    new["status"]["runs"] = [{"pod": "f-0", "trigger": "kickoff"}]
    ctl.cache.flow_event("ADDED", new)
    ctl.cache.flow_event("MODIFIED", flow(12, "Succeeded"))  # the earlier Flow "u", late
    ctl.cache.flow_event("DELETED", flow(13, "Succeeded"))
    assert ctl.cache.flows[("ns", "f")][1] == "new"
    assert ctl.cache.active_run("ns", "f-0") == ("f", "new", "")


def test_merge_patch_sets_changes_and_nulls_removals() -> None:
    old = {"phase": "Running", "feedback": {"request": {"id": "r"}, "response": {"text": "x"}}, "runs": [1]}
    new = {"phase": "Running", "feedback": {"history": [{"id": "r"}]}, "runs": [1, 2]}
    assert merge_patch(old, new) == {"feedback": {"request": None, "response": None, "history": [{"id": "r"}]},
                                     "runs": [1, 2]}


def test_work_queue_hands_a_key_to_one_worker_and_requeues_changes_made_meanwhile() -> None:
    async def scenario() -> list[tuple[str, str]]:
        q = WorkQueue()
        q.add(("ns", "a"))
        q.add(("ns", "a"))  # de-duplicated
        key = await q.get()
        q.add(("ns", "a"))  # changed while being processed: marked dirty, not handed out twice
        assert q._queue.qsize() == 0
        q.done(key)
        again = await asyncio.wait_for(q.get(), 1)
        q.done(again)
        return [key, again]

    assert asyncio.run(scenario()) == [("ns", "a"), ("ns", "a")]


def test_a_follower_keeps_its_caches_but_queues_nothing_until_it_leads() -> None:
    async def scenario() -> None:
        ctl = Controller(Settings())
        ctl.cache.flow_event("ADDED", flow(3, "Pending"))
        ctl.cache.pod_event("ADDED", pod("Running", 4))
        assert ("ns", "f") in ctl.cache.flows and ctl.cache.pods[("ns", "f")]
        assert not ctl.shell.queue._queued and not ctl.leading  # a follower writes nothing, so queues nothing
        ctl.attach(object())  # type: ignore[arg-type]  # no request is made before the first await
        ctl.start()  # leading begins: everything cached is reconciled once (level-based)
        assert ctl.leading and ctl.shell.queue._queued == {("ns", "f")}
        await ctl.stop()
        assert not ctl.leading

    asyncio.run(scenario())


def test_a_late_report_that_arrives_during_a_reconcile_stays_queued_for_the_next() -> None:
    from flowkube_api.constants import Reason, RunResult, Trigger
    from flowkube_api.report import RunReport, Usage

    ctl = Controller(Settings())
    ctl.shell.leading = True
    ctl.cache.flow_event("MODIFIED", flow(10, "Running"))

    def report(tokens: int) -> RunReport:
        return RunReport(pod="f-0", trigger=Trigger.KICKOFF, result=RunResult.FAILED,
                         reason=Reason.RUN_INTERRUPTED, exit_code=3, usage=Usage(total_tokens=tokens))

    first, newer = report(5), report(9)
    ctl.late_report("ns", "f", first)
    taken = dict(ctl._late[("ns", "f")])  # what a reconcile folds in
    ctl.late_report("ns", "f", newer)  # the pod reported again while that reconcile awaited
    ctl._forget_late(("ns", "f"), taken)
    assert ctl._late[("ns", "f")] == {"f-0": newer}
    ctl._forget_late(("ns", "f"), {"f-0": newer})
    assert ("ns", "f") not in ctl._late


def test_the_watch_echo_of_our_own_status_write_queues_no_second_reconcile() -> None:
    seen: list[Any] = []
    ctl = Controller(Settings(), listeners=[lambda k, b: seen.append(b)])
    ctl.cache.flow_event("MODIFIED", flow(10, "Running"))  # the answer to our status write
    ctl.cache.flow_event("MODIFIED", flow(10, "Running"))  # the watch delivering the same version
    assert len(seen) == 1, "one change, one reconcile"
    other = flow(10, "Running")
    other["metadata"]["uid"] = "another"  # same version number, another object: not an echo
    ctl.cache.flow_event("MODIFIED", other)
    assert len(seen) == 2


def test_a_running_pod_the_watch_never_said_was_deleted_is_found_gone_by_the_recheck() -> None:
    """After an API server restart kopf's watch re-lists and sends no DELETED for pods removed in
    the gap (found by the chaos run): the cache would show the run's pod running for ever."""

    class Gone:
        async def get(self, path: str) -> None:
            self.path = path

    async def scenario() -> None:
        ctl = Controller(Settings(pod_recheck_seconds=5))
        running = flow(3, "Running")
        running["status"]["runs"] = [{"pod": "f-0", "trigger": "kickoff", "startedAt": "2026-11-23T00:00:00Z"}]
        ctl.cache.flow_event("ADDED", running)
        live = pod("Running", 4)
        live["metadata"]["uid"] = "p1"
        ctl.cache.pod_event("ADDED", live)
        kube = Gone()
        ctl.attach(kube)  # type: ignore[arg-type]
        assert await ctl.recheck_pods() == 0, "heard of just now: not read again"
        ctl.cache._pod_seen[("ns", "f-0")] -= 6  # the watch has been silent for longer than the period
        assert await ctl.recheck_pods() == 1 and kube.path == "/api/v1/namespaces/ns/pods/f-0"
        assert "f-0" not in ctl.cache.pods.get(("ns", "f"), {}), "gone from the cache: the run is looked at again"

    asyncio.run(scenario())


def test_a_warm_report_that_arrives_during_a_reconcile_stays_for_the_next() -> None:
    from flowkube_api.constants import Reason, RunResult, Trigger
    from flowkube_api.report import RunReport

    newer = RunReport(pod="f-0", trigger=Trigger.KICKOFF, result=RunResult.PAUSED, reason=Reason.RUN_PAUSED,
                      exit_code=0, warm=True)

    async def scenario() -> None:
        ctl = Controller(Settings())
        ctl.shell.leading = True
        running = flow(10, "Running")
        running["status"]["runs"] = [{"pod": "f-0", "trigger": "kickoff", "startedAt": "2026-11-23T00:00:00Z"}]
        ctl.cache.flow_event("MODIFIED", running)
        live = pod("Running", 4)
        live["metadata"]["ownerReferences"] = [{"kind": "Flow", "name": "f", "uid": "u", "controller": True}]
        ctl.cache.pod_event("ADDED", live)

        class Kube:
            async def get(self, path: str) -> None:  # the report's ConfigMap: the pod reports again meanwhile
                ctl.running_report("ns", "f", newer)

            async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
                return {**running, "metadata": {**running["metadata"], "resourceVersion": "11"}}

            async def create(self, path: str, body: dict[str, Any]) -> None:
                return None

        ctl.attach(Kube())  # type: ignore[arg-type]
        assert ctl.cache.message_for("ns", "f", "f-0", 0) == (204, None)  # a poll: the status lacks the session
        assert ctl._warm[("ns", "f")] is None, "read the pod's report"
        await ctl.reconcile(("ns", "f"))
        assert ctl._warm[("ns", "f")] is newer, "the report that came during the reconcile is kept for the next"

    asyncio.run(scenario())


class RecordingKube:
    """The API server's side of one reconcile: what was written, in order."""

    def __init__(self, create_error: int | None = None) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.create_error = create_error

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        from flowkube_operator.kube.client import ApiError

        self.calls.append(("POST", path, body))
        if self.create_error is not None and path.endswith("/pods"):
            raise ApiError(self.create_error, {"message": "exceeded quota"}, "POST", path)
        return {**body, "metadata": {**body["metadata"], "uid": "p1", "resourceVersion": "12",
                                     "creationTimestamp": "2026-11-24T01:02:03Z"}}

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("PATCH", path, patch))
        return {"metadata": {"name": "f", "namespace": "ns", "uid": "u", "resourceVersion": "13"},
                "spec": {"flowRef": "a:B"}, "status": patch["status"]}


def test_a_kickoff_costs_its_pod_and_one_status_write_that_records_the_run_with_its_start() -> None:
    async def scenario(kube: RecordingKube) -> None:
        ctl = Controller(Settings())
        ctl.shell.leading = True
        new = flow(10, "Pending")
        del new["status"]
        ctl.cache.flow_event("ADDED", new)
        ctl.attach(kube)  # type: ignore[arg-type]
        try:
            await ctl.reconcile(("ns", "f"))
        finally:
            await ctl.writes.settled()

    kube = RecordingKube()
    asyncio.run(scenario(kube))
    writes = [(verb, path) for verb, path, _ in kube.calls if not path.endswith("/events")]
    assert writes == [("POST", "/api/v1/namespaces/ns/pods"),
                      ("PATCH", "/apis/flowkube.io/v1alpha1/namespaces/ns/flows/f/status")]
    assert kube.calls[1][2]["status"]["runs"] == [
        {"pod": "f-0", "trigger": "kickoff", "startedAt": "2026-11-24T01:02:03Z"}]

    # A pod that cannot be made: the run is still recorded (Pending, no start) and the event says why.
    refused = RecordingKube(create_error=403)
    try:
        asyncio.run(scenario(refused))
    except Exception as e:
        assert "exceeded quota" in str(e)
    else:
        raise AssertionError("the failed create is raised for the worker's backoff")
    patches = [body for verb, _, body in refused.calls if verb == "PATCH"]
    assert patches and patches[0]["status"]["runs"] == [{"pod": "f-0", "trigger": "kickoff"}]
    events = [body for verb, path, body in refused.calls if path.endswith("/events")]
    assert events and events[0]["reason"] == "FailedCreate"


def test_a_pod_change_the_reconcile_does_not_read_queues_nothing() -> None:
    queued: list[Any] = []
    ctl = Controller(Settings())
    ctl.shell.leading = True
    ctl.cache.flow_event("ADDED", flow(10, "Pending"))
    ctl.cache._wake = queued.append
    ctl.cache.pod_event("ADDED", pod("Pending", 11))
    assert queued == [("ns", "f")]
    bound = pod("Pending", 12)
    bound["spec"] = {"nodeName": "node-1"}  # the scheduler's binding: nothing a plan looks at
    ctl.cache.pod_event("MODIFIED", bound)
    assert queued == [("ns", "f")] and ctl.cache.pods[("ns", "f")]["f-0"].resource_version == 12
    ctl.cache.pod_event("MODIFIED", pod("Running", 13))
    assert queued == [("ns", "f")] * 2, "a phase change is planned for"


class _StateKube:
    """GET of the Flow's state ConfigMap, as the API server returns it."""

    def __init__(self, reports: dict[str, bytes]) -> None:
        import base64

        self.cm = {"metadata": {"name": "f-state", "ownerReferences": [{"uid": "u", "controller": True}]},
                   "binaryData": {k: base64.b64encode(v).decode() for k, v in reports.items()}}

    async def get(self, path: str) -> dict[str, Any]:
        return self.cm


def _load(reports: dict[str, bytes], message: str | None) -> Any:
    import datetime as dt

    from flowkube_operator.flows.reports import load_report
    from flowkube_operator.meta import PodView

    view = PodView(name="f-0", phase="Succeeded", created_at=dt.datetime.now(dt.UTC), exit_code=0, message=message)
    return asyncio.run(load_report(_StateKube(reports), "ns", "f", "u", "f-0", view))  # type: ignore[arg-type]


def _report(result: str, reason: str, calls: int, **kw: Any) -> Any:
    from flowkube_api.report import RunReport, TokenUsage, Usage

    t = TokenUsage(total_tokens=10 * calls, prompt_tokens=10 * calls, successful_requests=calls)
    return RunReport(pod="f-0", trigger="kickoff", result=result, reason=reason, exit_code=0,
                     usage=Usage(**t.model_dump(), by_model={"gpt-4o-mini": t}), **kw)


def test_a_gzip_bomb_in_the_state_configmap_is_an_unreadable_report_not_an_oom() -> None:
    from flowkube_api.constants import STATE_LIMIT
    from flowkube_api.report import REPORT_LIMIT
    from tests.abuse import gzip_bomb

    bomb = gzip_bomb(900 << 20)  # what someone who may edit ConfigMaps can write: re-read by every leader
    assert len(bomb) <= STATE_LIMIT
    import tracemalloc

    tracemalloc.start()
    summary = _report("Succeeded", "RunSucceeded", 2).termination_summary()
    got = _load({"report.f-0.json.gz": bomb}, summary)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 8 * REPORT_LIMIT  # gzip.decompress made 900 MiB here
    assert got is not None and got.usage.total_tokens == 20  # the termination summary still counts


def test_the_summary_wins_when_it_is_further_along_than_the_stored_report() -> None:
    """The state API was unreachable for the run's last calls: the stored report is an interim one
    with 2 calls, the termination summary has the outcome and all 5."""
    stored = _report("Failed", "RunInterrupted", 2)
    summary = _report("Succeeded", "RunSucceeded", 5).termination_summary()
    got = _load({"report.f-0.json.gz": stored.encode()}, summary)
    assert got.result == "Succeeded" and got.usage.successful_requests == 5 and got.usage.total_tokens == 50
    assert got.usage.by_model["gpt-4o-mini"].total_tokens == 50  # the split still sums to the totals
    # The stored report at the same count, interim: the outcome from the summary, the split as stored.
    got = _load({"report.f-0.json.gz": stored.encode()}, _report("Succeeded", "RunSucceeded", 2).termination_summary())
    assert got.result == "Succeeded" and got.usage == stored.usage
    # A final stored report is not replaced by a summary that says no more.
    final = _report("Succeeded", "RunSucceeded", 5, output="the whole output")
    got = _load({"report.f-0.json.gz": final.encode()}, summary)
    assert got.output == "the whole output"


class ApiServerDeletes:
    """The API server's DELETE as far as uids go: an object is deleted only while its uid matches the
    precondition (409 otherwise), and a DELETE without one is recorded (none may be sent)."""

    def __init__(self, objects: dict[str, str]) -> None:
        self.objects = objects  # path -> uid of the object there now
        self.sent: list[tuple[str, Any]] = []

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        from flowkube_operator.kube.client import ApiError

        assert method == "DELETE"
        self.sent.append((path, body))
        uid = ((body or {}).get("preconditions") or {}).get("uid")
        if path not in self.objects:
            raise ApiError(404, {"message": "not found"}, method, path)
        if uid is not None and uid != self.objects[path]:
            raise ApiError(409, {"message": f"Precondition failed: UID in precondition: {uid}"}, method, path)
        del self.objects[path]

    async def delete(self, path: str, body: Any = None) -> None:
        from flowkube_operator.kube.client import Kube

        await Kube.delete(self, path, body)  # type: ignore[arg-type]


def _stop_and_expire(pods: list[dict[str, Any]], objects: dict[str, str]) -> ApiServerDeletes:
    """Apply, with the pod cache holding ``pods`` at delete time, the plan a reconcile made when it
    saw runner pod f-0 with uid pod-uid-old running in a finished Flow (stop it) past its TTL."""
    from flowkube_api.models import FlowStatus
    from flowkube_operator.flows.reconcile import plan
    from flowkube_operator.meta import PodView

    body = flow(4, "Succeeded")
    body["spec"]["ttlSecondsAfterFinished"] = 0
    body["status"] = {"phase": "Succeeded", "finishedAt": "2026-11-22T12:00:00Z"}
    seen = {"f-0": PodView(name="f-0", phase="Running", created_at=None, uid="pod-uid-old")}
    p = plan(body, seen)
    body["status"] = FlowStatus.model_validate(body["status"]).dump()
    p.status = FlowStatus.model_validate(body["status"])
    ctl = Controller(Settings())
    kube = ApiServerDeletes(objects)
    ctl.kube = kube  # type: ignore[assignment]
    for running in pods:
        ctl.cache.pod_event("ADDED", running)
    asyncio.run(ctl.writer.apply(("ns", "f"), body, p))
    return kube


def test_a_pod_the_cache_lost_is_deleted_by_the_uid_the_plan_saw() -> None:
    """The plan decides with the uid it saw; the cache may have dropped the pod by delete time (its
    DELETED event raced the reconcile): the DELETE still carries the plan's uid, never none."""
    pods, flows = "/api/v1/namespaces/ns/pods/f-0", "/apis/flowkube.io/v1alpha1/namespaces/ns/flows/f"
    kube = _stop_and_expire([], {pods: "pod-uid-old", flows: "u"})
    assert [(path, b["preconditions"]) for path, b in kube.sent] == [
        (pods, {"uid": "pod-uid-old"}), (flows, {"uid": "u"})]
    assert kube.objects == {}


def test_a_pod_made_again_under_the_name_is_not_deleted_by_a_plan_about_the_old_one() -> None:
    """A Flow re-created under the same name (GitOps) must not lose its new pod, or itself, to a
    reconcile that still holds the old body: the cache and the API server hold the new pod (uid
    pod-uid-new) and the new Flow; the DELETEs carry the old uids, the API server's 409 for a
    namesake is not an error, and both new objects stay."""
    pods, flows = "/api/v1/namespaces/ns/pods/f-0", "/apis/flowkube.io/v1alpha1/namespaces/ns/flows/f"
    new_pod = pod("Running", 3)
    new_pod["metadata"]["uid"] = "pod-uid-new"
    kube = _stop_and_expire([new_pod], {pods: "pod-uid-new", flows: "u-new"})
    assert [b["preconditions"] for _, b in kube.sent] == [{"uid": "pod-uid-old"}, {"uid": "u"}]
    assert kube.objects == {pods: "pod-uid-new", flows: "u-new"}


def test_a_resume_of_a_template_flow_makes_its_pod_from_the_template_after_the_status_write() -> None:
    """A resume is recorded first and its pod made from the Flow as written: that answer holds only the
    Flow's own spec (templateRef, inputs), so the pod must come from the template copy in its status."""
    taken = {"kind": "FlowTemplate", "name": "tpl", "generation": 1,
             "spec": {"template": {"flowRef": "pkg.mod:Tpl", "image": "runner:tpl"}}}
    paused = flow(10, "AwaitingFeedback")
    paused["spec"] = {"templateRef": {"name": "tpl"}, "inputs": {"topic": "x"}}
    paused["status"] = {
        "phase": "AwaitingFeedback", "template": taken, "startedAt": "2026-11-24T01:00:00Z",
        "runs": [{"pod": "f-0", "trigger": "kickoff", "result": "Paused", "startedAt": "2026-11-24T01:00:00Z",
                  "finishedAt": "2026-11-24T01:01:00Z"}],
        "feedback": {"request": {"id": "r1", "method": "review", "message": "ok?",
                                 "requestedAt": "2026-11-24T01:01:00Z"},
                     "response": {"text": "approved"}}}

    class Kube(RecordingKube):
        async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
            self.calls.append(("PATCH", path, patch))
            return {"metadata": {**paused["metadata"], "resourceVersion": "13"}, "spec": paused["spec"],
                    "status": merge(paused["status"], patch["status"])}

    def merge(old: Any, patch: Any) -> Any:
        if not isinstance(old, dict) or not isinstance(patch, dict):
            return patch
        out = dict(old)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = merge(old.get(k), v)
        return out

    async def scenario(kube: Kube) -> None:
        ctl = Controller(Settings())
        ctl.shell.leading = True
        ctl.cache.flow_event("ADDED", paused)
        ctl.attach(kube)  # type: ignore[arg-type]
        try:
            await ctl.reconcile(("ns", "f"))
        finally:
            await ctl.writes.settled()

    kube = Kube()
    asyncio.run(scenario(kube))
    writes = [(verb, path.rsplit("/", 1)[-1]) for verb, path, _ in kube.calls if not path.endswith("/events")]
    assert writes == [("PATCH", "status"), ("POST", "pods")]
    pod_body = next(body for verb, path, body in kube.calls if verb == "POST" and path.endswith("/pods"))
    container = pod_body["spec"]["containers"][0]
    assert container["image"] == "runner:tpl"
    spec_env = next(e["value"] for e in container["env"] if e["name"] == "FLOWKUBE_SPEC")
    assert "pkg.mod:Tpl" in spec_env and '"topic":"x"' in spec_env.replace(" ", "")
