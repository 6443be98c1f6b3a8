"""The state API's decisions and its ConfigMap writes, against a fake API server (no cluster).

The real thing (TokenReview, bound tokens, a deleted pod's token) is exercised by
tests/integration/test_lifecycle.py::test_runner_credentials_reach_only_their_own_flows_state.
"""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from flowkube_api import constants as c
from flowkube_operator import tls
from flowkube_operator.kube import ApiError
from flowkube_operator.stateapi import Caller, StateApi, StateError, Target, caller_from_review, target_of_pod

FLOW_UID = "flow-uid"
POD = Target(namespace="ns", flow="demo", flow_uid=FLOW_UID, pod="demo-0", pod_uid="pod-uid")


def review(authenticated: bool = True, audiences: tuple[str, ...] = (c.STATE_AUDIENCE,),
           pod: str = "demo-0", uid: str = "pod-uid") -> dict[str, Any]:
    return {"status": {"authenticated": authenticated, "audiences": list(audiences), "user": {
        "username": "system:serviceaccount:ns:default",
        "extra": {"authentication.kubernetes.io/pod-name": [pod], "authentication.kubernetes.io/pod-uid": [uid]}}}}


def test_caller_from_review_needs_an_authenticated_pod_bound_token_for_our_audience() -> None:
    assert caller_from_review(review()) == Caller(namespace="ns", pod="demo-0", pod_uid="pod-uid")
    assert caller_from_review(review(authenticated=False)) is None
    assert caller_from_review(review(audiences=("https://kubernetes.default.svc",))) is None
    unbound = review()
    unbound["status"]["user"]["extra"] = {}
    assert caller_from_review(unbound) is None
    user = review()
    user["status"]["user"]["username"] = "alice"
    assert caller_from_review(user) is None


def runner_pod(**labels: str) -> dict[str, Any]:
    return {"metadata": {"name": "demo-0", "namespace": "ns", "uid": "pod-uid",
                         "labels": {c.LABEL_MANAGED_BY: c.MANAGED_BY, c.LABEL_COMPONENT: c.COMPONENT_RUNNER,
                                    c.LABEL_FLOW: "demo", **labels},
                         "ownerReferences": [{"apiVersion": c.API_VERSION, "kind": c.KIND, "name": "demo",
                                              "uid": FLOW_UID, "controller": True}]}}


def test_target_of_pod_is_the_flow_that_controls_a_runner_pod() -> None:
    assert target_of_pod(runner_pod()) == POD
    assert target_of_pod(runner_pod(**{c.LABEL_COMPONENT: "other"})) is None
    assert target_of_pod(runner_pod(**{c.LABEL_FLOW: "someone-else"})) is None  # label and owner disagree
    orphan = runner_pod()
    orphan["metadata"]["ownerReferences"] = []
    assert target_of_pod(orphan) is None


class FakeKube:
    """TokenReviews by token, one pod, and ConfigMaps with JSON merge patch and uid preconditions."""

    def __init__(self) -> None:
        self.reviews = {"good": review(), "other-pod": review(pod="x-0", uid="x")}
        self.pods: dict[str, dict[str, Any]] = {"demo-0": runner_pod()}
        self.configmaps: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        self.calls.append((method, path))
        assert path.endswith("/tokenreviews")
        return self.reviews.get(body["spec"]["token"], {"status": {"authenticated": False}})

    async def get(self, path: str) -> dict[str, Any] | None:
        self.calls.append(("GET", path))
        kind, name = path.split("/")[-2:]
        return (self.pods if kind == "pods" else self.configmaps).get(name)

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        self.calls.append(("POST", path))
        name = body["metadata"]["name"]
        if name in self.configmaps:
            return None
        self.configmaps[name] = {**body, "metadata": {**body["metadata"], "uid": f"cm-{len(self.calls)}"}}
        return self.configmaps[name]

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("PATCH", path))
        cm = self.configmaps.get(path.rsplit("/", 1)[1])
        if cm is None:
            raise ApiError(404, {"message": "not found"}, "PATCH", path)
        if patch["metadata"]["uid"] != cm["metadata"]["uid"]:
            raise ApiError(409, {"message": "Precondition failed: UID in precondition"}, "PATCH", path)
        cm.setdefault("binaryData", {}).update(patch["binaryData"])
        return cm


def api(kube: FakeKube, cached: dict[tuple[str, str], Target] | None = None) -> StateApi:
    return StateApi(lambda: kube, lambda ns, pod: (cached or {}).get((ns, pod)))  # type: ignore[arg-type,return-value]


def test_authentication_reviews_a_token_once_and_again_when_its_pod_is_gone() -> None:
    kube = FakeKube()
    cache = {("ns", "demo-0"): POD}
    state = api(kube, cache)

    async def scenario() -> None:
        assert await state.authenticate("Bearer good") == POD
        assert await state.authenticate("Bearer good") == POD
        assert [m for m, _ in kube.calls] == ["POST"]  # one review; the pod came from the cache
        cache.clear()
        del kube.pods["demo-0"]
        with pytest.raises(StateError) as refused:
            await state.authenticate("Bearer good")
        assert refused.value.status == 403
        for header, status in (("", 401), ("Basic x", 401), ("Bearer forged", 401), ("Bearer other-pod", 403)):
            with pytest.raises(StateError) as e:
                await state.authenticate(header)
            assert e.value.status == status, header

    asyncio.run(scenario())


def test_put_creates_the_owned_configmap_then_patches_only_its_key() -> None:
    kube = FakeKube()
    state = api(kube)

    async def scenario() -> None:
        assert await state.get(POD, c.STATE_KEY) is None
        await state.put(POD, c.STATE_KEY, b"one")
        await state.put(POD, "report.demo-0.json.gz", b"two")
        cm = kube.configmaps["demo-state"]
        assert cm["metadata"]["ownerReferences"][0]["uid"] == FLOW_UID
        assert {k: base64.b64decode(v) for k, v in cm["binaryData"].items()} == {
            c.STATE_KEY: b"one", "report.demo-0.json.gz": b"two"}
        assert await state.get(POD, c.STATE_KEY) == b"one"
        # An earlier Flow's ConfigMap of the same name is never written: a conflict, retried later.
        kube.configmaps["demo-state"]["metadata"]["ownerReferences"][0]["uid"] = "earlier-flow"
        state.forget_flow(FLOW_UID)
        with pytest.raises(StateError) as e:
            await state.put(POD, c.STATE_KEY, b"three")
        assert e.value.status == 409
        assert base64.b64decode(kube.configmaps["demo-state"]["binaryData"][c.STATE_KEY]) == b"one"

    asyncio.run(scenario())


def test_the_ca_survives_restarts_and_the_serving_certificate_names_every_host(tmp_path: Path) -> None:
    ca = tls.ca_from_dir(str(tmp_path))
    assert tls.ca_from_dir(str(tmp_path)) == ca  # a restart keeps it: running pods trust it
    assert oct((tmp_path / tls.CA_KEY).stat().st_mode & 0o777) == "0o600"
    serving = tls.issue(ca, str(tmp_path / "serving"), ["127.0.0.1", "operator.example"], "flowkube-system/fk")
    cert = x509.load_pem_x509_certificate(Path(serving.certfile).read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(n.value) for n in sans} == {"127.0.0.1", "operator.example", "fk.flowkube-system.svc",
                                            "fk.flowkube-system.svc.cluster.local"}
    assert cert.issuer == x509.load_pem_x509_certificate(ca.cert_pem).subject
