"""What a fork's first reconcile reads of its origin (`flows.checkpoints.fork_source`), each way it can
be refused, and the copy into the fork's own state."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from flowkube_api import constants as c
from flowkube_operator.flows import checkpoints
from flowkube_operator.flows.reconcile.forks import ForkSource

ENTRY = {"id": 7, "method": "review", "kind": "Paused", "time": "2026-11-28T07:00:00Z",
         "usage": {"totalTokens": 120, "cost": "0.02"}}


class Kube:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}

    async def get(self, path: str) -> dict[str, Any] | None:
        return self.objects.get(path)

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        at = f"{path}/{body['metadata']['name']}"
        if at in self.objects:
            return None
        self.objects[at] = {**body, "metadata": {**body["metadata"], "uid": "cm-uid"}}
        return self.objects[at]

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.objects[path]["binaryData"] = patch["binaryData"]
        return self.objects[path]


def origin_world(keep: int = 5, held: int = 7, owner: str = "o-uid") -> Kube:
    kube = Kube()
    kube.objects["/apis/flowkube.io/v1alpha1/namespaces/team/flows/origin"] = {
        "metadata": {"name": "origin", "namespace": "team", "uid": "o-uid"},
        "spec": {"checkpoints": {"keep": keep}}, "status": {"checkpoints": [ENTRY]}}
    kube.objects[f"/api/v1/namespaces/team/configmaps/origin-cp-{7 % keep}"] = {
        "metadata": {"name": f"origin-cp-{7 % keep}", "namespace": "team", "uid": "x",
                     "annotations": {c.CHECKPOINT_ANNOTATION: str(held)},
                     "ownerReferences": [{"kind": "Flow", "name": "origin", "uid": owner, "controller": True}]},
        "binaryData": {c.STATE_KEY: base64.b64encode(b"the state at 7").decode()}}
    return kube


def fork(into: str = "team", **ref: Any) -> dict[str, Any]:
    return {"metadata": {"name": "f", "namespace": into, "uid": "f-uid"},
            "spec": {"forkFrom": {"name": "origin", "checkpoint": 7, **ref}}}


def read(kube: Kube, body: dict[str, Any], across: bool = True) -> ForkSource | None:
    return asyncio.run(checkpoints.fork_source(kube, body, across_namespaces=across))  # type: ignore[arg-type]


def test_a_fork_reads_the_checkpoint_its_origin_lists_and_copies_it_into_its_own_state() -> None:
    kube = origin_world()
    source = read(kube, fork())
    assert source is not None and source.problem is None
    assert source.entry is not None and source.entry.usage.total_tokens == 120
    assert (source.uid, source.data) == ("o-uid", b"the state at 7")
    asyncio.run(checkpoints.copy_into_state(kube, fork(), b"the state at 7"))  # type: ignore[arg-type]
    state = kube.objects["/api/v1/namespaces/team/configmaps/f-state"]
    assert state["metadata"]["ownerReferences"][0]["uid"] == "f-uid"
    assert base64.b64decode(state["binaryData"][c.STATE_KEY]) == b"the state at 7"
    # Copied already (status.forkedFrom set): nothing is read again.
    assert read(kube, {**fork(), "status": {"forkedFrom": {"checkpoint": 7}}}) is None


def test_a_fork_is_refused_naming_what_is_missing_or_not_its_own() -> None:
    def problem(kube: Kube, body: dict[str, Any], across: bool = True) -> str:
        source = read(kube, body, across)
        assert source is not None and source.problem is not None and source.data is None
        return str(source.problem)

    assert "does not exist" in problem(Kube(), fork())
    assert "spec.forkFrom.uid" in problem(origin_world(), fork(uid="another"))
    assert "has no checkpoint 8 (it lists: 7)" in problem(origin_world(), fork(checkpoint=8))
    # The slot holds a later checkpoint now, or belongs to another Flow of that name: never copied.
    assert "no longer kept" in problem(origin_world(held=12), fork())
    assert "no longer kept" in problem(origin_world(owner="earlier"), fork())
    # From another namespace only with the webhook, which checks the creator may get the origin.
    assert "another namespace" in problem(origin_world(), fork("mine", namespace="team"), across=False)
    assert read(origin_world(), fork("mine", namespace="team"), across=True) is not None


def test_a_fork_the_operator_may_not_read_fails_saying_so_and_an_ended_fork_reads_nothing() -> None:
    from flowkube_operator.kube.client import ApiError

    class Forbidden(Kube):
        async def get(self, path: str) -> dict[str, Any] | None:
            raise ApiError(403, {"message": "forbidden"}, "GET", path)

    source = read(Forbidden(), fork())
    assert source is not None and "may not read Flow team/origin" in str(source.problem)
    # Failed (its origin was gone) or started already: nothing is looked up again at later reconciles.
    assert read(Forbidden(), {**fork(), "status": {"phase": "Failed"}}) is None
    assert read(Forbidden(), {**fork(), "status": {"runs": [{"pod": "f-0"}]}}) is None
