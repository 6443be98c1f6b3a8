"""The state API's decisions and its ConfigMap writes, against a fake API server (no cluster).

The real thing (TokenReview, bound tokens, a deleted pod's token) is exercised by
tests/integration/test_lifecycle.py::test_runner_credentials_reach_only_their_own_flows_state.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from flowkube_api import constants as c
from flowkube_api.constants import Reason, RunResult, Trigger
from flowkube_api.report import RunReport, Usage
from flowkube_operator.kube import issuerkeys, tls
from flowkube_operator.kube.client import ApiError
from flowkube_operator.kube.issuerkeys import IssuerKeys
from flowkube_operator.serve.stateapi import StateApi
from flowkube_operator.serve.stateauth import (
    Caller,
    ClientLimits,
    StateError,
    Target,
    caller_from_review,
    plausible,
    target_of_pod,
)
from tests.abuse import gzip_bomb

FLOW_UID = "flow-uid"


def jwt(name: str, audience: str = c.STATE_AUDIENCE, pod: bool = True) -> str:
    """A token shaped like a pod-bound ServiceAccount token (unsigned: the TokenReview is faked)."""
    claims: dict[str, Any] = {"aud": [audience], "sub": name}
    if pod:
        claims["kubernetes.io"] = {"namespace": "ns", "pod": {"name": name, "uid": "u"}}

    def part(d: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(d).encode()).decode().rstrip("=")

    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2ln"
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
    """TokenReviews by token, pods, Flows, and ConfigMaps with JSON merge patch (a uid that does not
    match is an immutable-field error, 422, as the API server answers a PATCH)."""

    def __init__(self) -> None:
        self.reviews = {jwt("good"): review(), jwt("other-pod"): review(pod="x-0", uid="x")}
        self.pods: dict[str, dict[str, Any]] = {"demo-0": runner_pod()}
        self.flows: dict[str, dict[str, Any]] = {"demo": {"metadata": {"name": "demo", "uid": FLOW_UID},
                                                          "status": {"runs": [{"pod": "demo-0"}]}}}
        self.configmaps: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        self.calls.append((method, path))
        assert path.endswith("/tokenreviews")
        return self.reviews.get(body["spec"]["token"], {"status": {"authenticated": False}})

    async def get(self, path: str) -> dict[str, Any] | None:
        self.calls.append(("GET", path))
        kind, name = path.split("/")[-2:]
        return {"pods": self.pods, "flows": self.flows, "configmaps": self.configmaps}[kind].get(name)

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        self.calls.append(("POST", path))
        name = body["metadata"]["name"]
        if name in self.configmaps:
            return None
        self.configmaps[name] = {**body, "metadata": {**body["metadata"], "uid": f"cm-{len(self.calls)}"}}
        return self.configmaps[name]

    async def delete(self, path: str, body: dict[str, Any] | None = None) -> None:
        self.calls.append(("DELETE", path))
        name = path.rsplit("/", 1)[1]
        assert body is not None and body["preconditions"]["uid"] == self.configmaps[name]["metadata"]["uid"]
        del self.configmaps[name]

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("PATCH", path))
        cm = self.configmaps.get(path.rsplit("/", 1)[1])
        if cm is None:
            raise ApiError(404, {"message": "not found"}, "PATCH", path)
        if patch["metadata"]["uid"] != cm["metadata"]["uid"]:
            raise ApiError(422, {"message": "metadata.uid: Invalid value: field is immutable"}, "PATCH", path)
        cm.setdefault("binaryData", {}).update(patch["binaryData"])
        cm["metadata"].setdefault("annotations", {}).update(patch["metadata"].get("annotations") or {})
        return cm


class FakeRuns:
    """The controller's side, as the state API sees it: running attempts, and the late reports it hears."""

    def __init__(self, active: dict[tuple[str, str], tuple[str, str, str]] | None = None) -> None:
        self.active = active or {}
        self.late: list[tuple[str, str, RunReport]] = []

    def active_run(self, namespace: str, pod: str) -> tuple[str, str, str] | None:
        return self.active.get((namespace, pod))

    def late_report(self, namespace: str, flow: str, report: RunReport) -> None:
        self.late.append((namespace, flow, report))

    def running_report(self, namespace: str, flow: str, report: RunReport) -> bool:
        return True

    def message_for(self, namespace: str, flow: str, pod: str, after: int) -> tuple[int, dict[str, Any] | None]:
        return 410, {"message": "no warm runs here"}

    def answer_for(self, namespace: str, flow: str, pod: str, request_id: str) -> tuple[int, dict[str, Any] | None]:
        return 410, {"message": "no warm runs here"}

    async def changed(self, key: tuple[str, str], seconds: float) -> None:
        return None

    def checkpoints_kept(self, namespace: str, flow: str) -> int:
        return 3


def api(kube: FakeKube, active: dict[tuple[str, str], tuple[str, str, str]] | None = None) -> StateApi:
    runs = FakeRuns(active)
    return StateApi(lambda: kube, runs, runs)  # type: ignore[arg-type,return-value]


def test_only_plausible_tokens_reach_a_token_review() -> None:
    assert plausible(jwt("good"))
    assert not plausible(jwt("good", audience="https://kubernetes.default.svc"))
    assert not plausible(jwt("good", pod=False))
    assert not plausible("not-a-jwt") and not plausible("a.b.c")


def test_a_token_is_accepted_while_its_pod_is_a_run_of_the_flow_and_late_once_the_run_closed() -> None:
    kube = FakeKube()
    active = {("ns", "demo-0"): ("demo", FLOW_UID, "pod-uid")}
    state = api(kube, active)

    async def scenario() -> None:
        assert await state.auth.authenticate(f"Bearer {jwt('good')}") == POD
        assert await state.auth.authenticate(f"Bearer {jwt('good')}") == POD
        assert [m for m, _ in kube.calls] == ["POST"]  # one review, and the controller's caches
        active.clear()  # the run ended: the Flow's status recorded it finished; its pod still runs
        kube.flows["demo"]["status"]["runs"][0]["finishedAt"] = "2026-11-22T00:00:00Z"
        late = await state.auth.authenticate(f"Bearer {jwt('good')}")
        assert late == Target(**{**POD.__dict__, "late": True})
        kube.flows["demo"]["status"]["runs"] = [{"pod": "demo-1"}]  # a run this pod never was
        state.auth._tokens.clear()
        with pytest.raises(StateError) as refused:
            await state.auth.authenticate(f"Bearer {jwt('good')}")
        assert refused.value.status == 403
        calls = len(kube.calls)
        with pytest.raises(StateError):
            await state.auth.authenticate(f"Bearer {jwt('good')}")
        assert len(kube.calls) == calls  # a refusal is remembered briefly: no review storm
        for header, status in (("", 401), ("Basic x", 401), ("Bearer junk", 401), (f"Bearer {jwt('forged')}", 401),
                               (f"Bearer {jwt('other-pod')}", 403)):
            with pytest.raises(StateError) as e:
                await state.auth.authenticate(header)
            assert e.value.status == status, header

    asyncio.run(scenario())


def test_a_closed_runs_pod_may_write_only_its_own_report_and_the_controller_hears_of_it() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    kube = FakeKube()
    kube.flows["demo"]["status"]["runs"] = [{"pod": "demo-0", "finishedAt": "2026-11-22T00:00:00Z"},
                                            {"pod": "demo-1"}]
    runs = FakeRuns()
    state = StateApi(lambda: kube, runs, runs)  # type: ignore[arg-type,return-value]
    auth = {"Authorization": f"Bearer {jwt('good')}"}
    report = RunReport(pod="demo-0", trigger=Trigger.KICKOFF, result=RunResult.FAILED,
                       reason=Reason.RUN_INTERRUPTED, exit_code=3, usage=Usage(total_tokens=42, successful_requests=3))

    async def scenario() -> None:
        async with TestClient(TestServer(state.app())) as client:
            url = c.STATE_API_PREFIX
            assert (await client.get(url + c.STATE_KEY, headers=auth)).status == 403  # the state is the retry's
            assert (await client.put(url + c.STATE_KEY, data=b"x", headers=auth)).status == 403
            assert (await client.get(url + c.report_key("demo-0"), headers=auth)).status == 403
            ok = await client.put(url + c.report_key("demo-0"), data=report.encode(), headers=auth)
            assert ok.status == 204
            # A report about another run (a replay) or that is not a report at all is refused.
            replay = report.model_copy(update={"pod": "demo-1"}).encode()
            refused = await client.put(url + c.report_key("demo-0"), data=replay, headers=auth)
            assert refused.status == 403 and "only its own run" in (await refused.json())["message"]
            junk = await client.put(url + c.report_key("demo-0"), data=b"junk", headers=auth)
            assert junk.status == 400
            # A gzip bomb under the value limit (here 128 MiB of zeros in 128 kB) is refused at the
            # report bound, not decompressed into the operator's memory.
            bomb = await client.put(url + c.report_key("demo-0"), data=gzip_bomb(128 << 20), headers=auth)
            assert bomb.status == 413 and "more than 1048576 bytes" in (await bomb.json())["message"]

    asyncio.run(scenario())
    assert [(flow, r.pod, r.usage.total_tokens) for _, flow, r in runs.late] == [("demo", "demo-0", 42)]
    stored = kube.configmaps["demo-state"]["binaryData"][c.report_key("demo-0")]
    assert RunReport.decode(base64.b64decode(stored)) == report


def test_a_report_over_a_field_bound_is_refused_naming_the_field_and_not_stored() -> None:
    import gzip

    from aiohttp.test_utils import TestClient, TestServer

    kube = FakeKube()
    kube.flows["demo"]["status"]["runs"] = [{"pod": "demo-0", "finishedAt": "2026-11-22T00:00:00Z"}]
    runs = FakeRuns()
    state = StateApi(lambda: kube, runs, runs)  # type: ignore[arg-type,return-value]
    auth = {"Authorization": f"Bearer {jwt('good')}"}
    raw = json.loads(RunReport(pod="demo-0", trigger=Trigger.KICKOFF, result=RunResult.PAUSED,
                               reason=Reason.RUN_PAUSED, exit_code=0).to_json())

    async def put(report: dict[str, Any]) -> tuple[int, str]:
        async with TestClient(TestServer(state.app())) as client:
            answer = await client.put(c.STATE_API_PREFIX + c.report_key("demo-0"), headers=auth,
                                      data=gzip.compress(json.dumps(report).encode()))
            return answer.status, (await answer.json())["message"]

    emit = asyncio.run(put({**raw, "feedbackRequest": {"id": "r-1", "method": "review", "emit": ["x"] * 10_000}}))
    assert emit == (422, f"{c.report_key('demo-0')} is not a valid run report: "
                         "feedbackRequest.emit has 10000 items; the limit is 64")
    method = asyncio.run(put({**raw, "feedbackRequest": {"id": "r-1", "method": "m" * 5000}}))
    assert method[0] == 422 and "feedbackRequest.method is 5000 characters; the limit is 240" in method[1]
    models = asyncio.run(put({**raw, "usage": {"byModel": {f"m{i}": {} for i in range(1000)}}}))
    assert models[0] == 422 and "usage.byModel has 1000 models" in models[1]
    typed = asyncio.run(put({**raw, "exitCode": "three"}))
    assert typed[0] == 422 and typed[1].endswith("exitCode: Input should be a valid integer, unable to parse string "
                                                  "as an integer")
    assert runs.late == [] and "demo-state" not in kube.configmaps


def test_a_restarted_operator_asks_the_api_server_about_a_pod_it_has_not_seen() -> None:
    kube = FakeKube()
    state = api(kube)  # empty caches

    async def scenario() -> None:
        assert await state.auth.authenticate(f"Bearer {jwt('good')}") == POD
        assert ("GET", "/api/v1/namespaces/ns/pods/demo-0") in kube.calls

    asyncio.run(scenario())


def test_a_pod_made_before_its_run_is_recorded_is_told_to_retry_not_refused() -> None:
    kube = FakeKube()
    kube.flows["demo"]["status"]["runs"] = []  # the kickoff's pod exists; the write recording it is not in yet
    state = api(kube)

    async def scenario() -> None:
        with pytest.raises(StateError) as early:
            await state.auth.authenticate(f"Bearer {jwt('good')}")
        assert early.value.status == 503 and "not recorded yet" in str(early.value)
        kube.flows["demo"]["status"]["runs"] = [{"pod": "demo-0"}]  # recorded: no refusal was remembered
        assert await state.auth.authenticate(f"Bearer {jwt('good')}") == POD

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
        # Replaced behind our back (a restore): the stale uid is refused, looked up again, written.
        kube.configmaps["demo-state"]["metadata"]["uid"] = "restored"
        await state.put(POD, c.STATE_KEY, b"after-restore")
        assert base64.b64decode(kube.configmaps["demo-state"]["binaryData"][c.STATE_KEY]) == b"after-restore"
        # An earlier Flow's ConfigMap of the same name (the garbage collector missed it) is never
        # written into: it is deleted, and this Flow's state starts afresh.
        kube.configmaps["demo-state"]["metadata"]["ownerReferences"][0]["uid"] = "earlier-flow"
        state.forget_flow(FLOW_UID)
        assert await state.get(POD, c.STATE_KEY) is None and "demo-state" not in kube.configmaps
        await state.put(POD, c.STATE_KEY, b"fresh")
        assert kube.configmaps["demo-state"]["metadata"]["ownerReferences"][0]["uid"] == FLOW_UID
        # A ConfigMap of that name that some other controller owns is left alone: a conflict.
        kube.configmaps["demo-state"]["metadata"]["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": "Deployment", "name": "demo", "uid": "d", "controller": True}]
        state.forget_flow(FLOW_UID)
        with pytest.raises(StateError) as e:
            await state.put(POD, c.STATE_KEY, b"three")
        assert e.value.status == 409 and "demo-state" in kube.configmaps

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


def test_a_strict_verifier_accepts_the_serving_certificate(tmp_path: Path) -> None:
    # Python 3.13's default context verifies strictly (key usage, key identifiers): runner images on
    # any supported Python must accept the state API's certificate.
    import ssl

    serving = tls.issue(tls.new_ca(), str(tmp_path), ["operator.example"], "")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(serving.certfile, serving.keyfile)
    client = ssl.create_default_context(cafile=serving.cafile)
    client.verify_flags |= ssl.VERIFY_X509_STRICT
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    cli = client.wrap_bio(c_in, c_out, server_hostname="operator.example")
    srv = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for name, end, out, peer_in in (("client", cli, c_out, s_in), ("server", srv, s_out, c_in)):
            if not done[name]:
                try:
                    end.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
            peer_in.write(out.read())
        if all(done.values()):
            break
    assert all(done.values())


def test_the_http_edge_refuses_bad_requests_with_clear_statuses() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    state = api(FakeKube(), {("ns", "demo-0"): ("demo", FLOW_UID, "pod-uid")})
    auth = {"Authorization": f"Bearer {jwt('good')}"}

    async def scenario() -> None:
        async with TestClient(TestServer(state.app())) as client:
            assert (await client.get(c.STATE_API_PREFIX + c.STATE_KEY)).status == 401  # no token
            assert (await client.get(c.STATE_API_PREFIX + "bad%20key", headers=auth)).status == 400
            other = await client.put(c.STATE_API_PREFIX + c.report_key("demo-1"), data=b"x", headers=auth)
            assert other.status == 403  # another run's report
            junk = await client.put(c.STATE_API_PREFIX + c.report_key("demo-0"), data=b"x", headers=auth)
            assert junk.status == 400  # its own report key holds only a report
            big = await client.put(c.STATE_API_PREFIX + c.STATE_KEY, data=b"x" * (c.STATE_LIMIT + 1), headers=auth)
            assert big.status == 413 and "limit" in (await big.json())["message"]
            huge = await client.put(c.STATE_API_PREFIX + c.STATE_KEY, data=b"x" * (3 * 1024 * 1024), headers=auth)
            assert huge.status == 413
            ok = await client.put(c.STATE_API_PREFIX + c.STATE_KEY, data=b"fine", headers=auth)
            assert ok.status == 204
            assert await (await client.get(c.STATE_API_PREFIX + c.STATE_KEY, headers=auth)).read() == b"fine"

    asyncio.run(scenario())


def warm_flow(rv: int, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "demo", "namespace": "ns", "uid": FLOW_UID, "resourceVersion": str(rv)},
            "status": {"runs": [{"pod": "demo-0"}], **status}}


def test_a_warm_pod_long_polls_for_its_next_message_and_answer() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from flowkube_operator.flows.controller import Controller
    from flowkube_operator.settings import Settings

    ctl = Controller(Settings())
    kube = FakeKube()
    state = StateApi(lambda: kube, ctl.cache, ctl)  # type: ignore[arg-type,return-value]
    waiting: dict[str, Any] = {"phase": "AwaitingMessage", "conversation": {"sessionId": "s1", "turns": 1}}
    ctl.cache.flow_event("ADDED", warm_flow(10, **waiting))
    ctl.cache.pod_event("ADDED", {**runner_pod(), "status": {"phase": "Running"}})
    auth = {"Authorization": f"Bearer {jwt('good')}"}

    async def scenario() -> None:
        async with TestClient(TestServer(state.app())) as client:
            nothing = await client.get(c.MESSAGE_API_PREFIX + "1", params={"wait": "0.2"}, headers=auth)
            assert nothing.status == 204
            not_a_turn = await client.get(c.MESSAGE_API_PREFIX + "one", headers=auth)
            assert not_a_turn.status == 400 and "number" in (await not_a_turn.json())["message"]
            bad_wait = await client.get(c.MESSAGE_API_PREFIX + "1", params={"wait": "soon"}, headers=auth)
            assert bad_wait.status == 400 and "wait" in (await bad_wait.json())["message"]
            poll = asyncio.ensure_future(client.get(c.MESSAGE_API_PREFIX + "1", params={"wait": "10"}, headers=auth))
            await asyncio.sleep(0)  # let the poll reach its wait (ordering only: the answer is awaited below)
            accepted = {**waiting, "conversation": {**waiting["conversation"],
                                                    "pending": {"turn": 2, "text": "hi", "sentBy": "ana"}}}
            ctl.cache.flow_event("MODIFIED", warm_flow(11, **accepted))  # the status write that accepted it
            got = await asyncio.wait_for(poll, 5)
            assert got.status == 200 and await got.json() == {"turn": 2, "text": "hi", "sender": "ana"}
            stale = await client.get(c.MESSAGE_API_PREFIX + "0", params={"wait": "0"}, headers=auth)
            assert stale.status == 410  # message 1 was answered: nothing will come for it

            asked = {"phase": "AwaitingFeedback", "feedback": {"request": {"id": "r1", "method": "m", "message": "?"}}}
            ctl.cache.flow_event("MODIFIED", warm_flow(12, **asked))
            pending = await client.get(c.ANSWER_API_PREFIX + "r1", params={"wait": "0.1"}, headers=auth)
            assert pending.status == 204
            answered = {"phase": "Running", "feedback": {"history": [
                {"requestId": "r1", "method": "m", "response": "yes", "respondedAt": "2026-11-23T00:00:00Z"}]}}
            ctl.cache.flow_event("MODIFIED", warm_flow(13, **answered))
            got = await client.get(c.ANSWER_API_PREFIX + "r1", params={"wait": "5"}, headers=auth)
            assert got.status == 200 and (await got.json())["text"] == "yes"

            # A follower (not leading) stores a warm report but sends the runner to the leader.
            warm = RunReport(pod="demo-0", trigger=Trigger.KICKOFF, result=RunResult.PAUSED,
                             reason=Reason.RUN_PAUSED, exit_code=0, warm=True)
            put = await client.put(c.STATE_API_PREFIX + c.report_key("demo-0"), data=warm.encode(), headers=auth)
            assert put.status == 503 and put.headers.get("Connection") == "close"
            assert put.headers.get(c.HEADER_STORED) == "true"
            assert c.report_key("demo-0") in kube.configmaps["demo-state"]["binaryData"]
            # So is the final report; the leader takes it at once, to end the run before the pod ends.
            final = RunReport(pod="demo-0", trigger=Trigger.KICKOFF, result=RunResult.SUCCEEDED,
                              reason=Reason.RUN_SUCCEEDED, exit_code=0, final=True)
            put = await client.put(c.STATE_API_PREFIX + c.report_key("demo-0"), data=final.encode(), headers=auth)
            assert put.status == 503 and put.headers.get(c.HEADER_STORED) == "true"
            ctl.shell.leading = True
            put = await client.put(c.STATE_API_PREFIX + c.report_key("demo-0"), data=final.encode(), headers=auth)
            assert put.status == 204 and ctl._warm[("ns", "demo")] == final and ctl.shell.queue._queued
            ctl.shell.leading = False

            ctl.cache.flow_event("MODIFIED", {**warm_flow(14), "status": {"runs": [
                {"pod": "demo-0", "finishedAt": "2026-11-23T00:00:00Z"}]}})
            closed = await client.get(c.MESSAGE_API_PREFIX + "2", params={"wait": "5"}, headers=auth)
            assert closed.status == 410

    asyncio.run(scenario())


def test_a_flood_of_refused_tokens_never_evicts_a_running_pods_token() -> None:
    """Each fake token costs a TokenReview and a cache entry; a full cache of refusals used to be
    cleared with the good entries in it, sending every runner back to a TokenReview."""
    kube = FakeKube()
    state = api(kube, {("ns", "demo-0"): ("demo", FLOW_UID, "pod-uid")})
    state.auth._tokens.limit = state.auth._refused.limit = 50

    async def scenario() -> None:
        assert await state.auth.authenticate(f"Bearer {jwt('good')}") == POD
        for i in range(200):
            with pytest.raises(StateError):
                await state.auth.authenticate(f"Bearer {jwt(f'forged-{i}')}")
        reviews = len(kube.calls)
        assert await state.auth.authenticate(f"Bearer {jwt('good')}") == POD
        assert len(kube.calls) == reviews  # still cached: no TokenReview for the runner
        assert len(state.auth._refused) <= 50

    asyncio.run(scenario())


def test_one_pod_has_at_most_a_few_requests_in_flight() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from flowkube_operator.serve import stateapi

    kube = FakeKube()
    state = api(kube, {("ns", "demo-0"): ("demo", FLOW_UID, "pod-uid")})
    auth = {"Authorization": f"Bearer {jwt('good')}"}
    gate, arrived = asyncio.Event(), asyncio.Event()
    reading: list[str] = []
    real_get = kube.get

    async def slow_get(path: str) -> dict[str, Any] | None:
        if "/configmaps/" in path:
            reading.append(path)
            if len(reading) == stateapi.POD_IN_FLIGHT:
                arrived.set()
            await gate.wait()
        return await real_get(path)

    kube.get = slow_get  # type: ignore[method-assign]

    async def scenario() -> None:
        async with TestClient(TestServer(state.app())) as client:
            url = c.STATE_API_PREFIX + c.STATE_KEY
            held = [asyncio.create_task(client.get(url, headers=auth)) for _ in range(stateapi.POD_IN_FLIGHT)]
            async with asyncio.timeout(10):
                await arrived.wait()  # every held request is in its ConfigMap read
            flood = await client.get(url, headers=auth)
            assert flood.status == 429 and "in flight" in (await flood.json())["message"]
            gate.set()
            assert [(await t).status for t in held] == [404] * stateapi.POD_IN_FLIGHT
            assert state._in_flight == {}
            assert (await client.get(url, headers=auth)).status == 404  # served again

    asyncio.run(scenario())


# -- tokens checked with the issuer's keys before any TokenReview ------------------------------------

def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _int(n: int) -> str:
    return _b64(n.to_bytes((n.bit_length() + 7) // 8, "big"))


RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC_KEY = ec.generate_private_key(ec.SECP256R1())
ROTATED_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
FORGER_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def jwk(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey, kid: str) -> dict[str, Any]:
    if isinstance(key, rsa.RSAPrivateKey):
        n = key.public_key().public_numbers()
        return {"kty": "RSA", "alg": "RS256", "use": "sig", "kid": kid, "n": _int(n.n), "e": _int(n.e)}
    p = key.public_key().public_numbers()
    return {"kty": "EC", "crv": "P-256", "alg": "ES256", "use": "sig", "kid": kid,
            "x": _b64(p.x.to_bytes(32, "big")), "y": _b64(p.y.to_bytes(32, "big"))}


def signed(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey, kid: str, name: str = "demo-0",
           expires_in: float = 3600, audience: str = c.STATE_AUDIENCE) -> str:
    """A projected ServiceAccount token as the API server makes it, signed with `key`."""
    now = int(time.time())
    claims = {"aud": [audience], "exp": now + int(expires_in), "iat": now - 60, "nbf": now - 60,
              "iss": "https://kubernetes.default.svc.cluster.local", "sub": "system:serviceaccount:ns:default",
              "kubernetes.io": {"namespace": "ns", "pod": {"name": name, "uid": "pod-uid"},
                                "serviceaccount": {"name": "default", "uid": "sa-uid"}}}
    alg = "RS256" if isinstance(key, rsa.RSAPrivateKey) else "ES256"
    head = _b64(json.dumps({"alg": alg, "kid": kid}).encode()) + "." + _b64(json.dumps(claims).encode())
    if isinstance(key, rsa.RSAPrivateKey):
        sig = key.sign(head.encode(), padding.PKCS1v15(), hashes.SHA256())
    else:
        r, s = decode_dss_signature(key.sign(head.encode(), ec.ECDSA(hashes.SHA256())))
        sig = r.to_bytes(32, "big") + s.to_bytes(32, "big")
    return head + "." + _b64(sig)


class IssuerKube(FakeKube):
    """The fake API server also publishes its service-account issuer's keys (OIDC discovery), and
    counts the TokenReviews and key-set reads it answers."""

    def __init__(self, keys: list[dict[str, Any]] | None = None, readable: bool = True) -> None:
        super().__init__()
        self.jwks = {"keys": keys if keys is not None else [jwk(RSA_KEY, "rsa"), jwk(EC_KEY, "ec")]}
        self.readable = readable
        self.key_reads = 0
        self.token_reviews = 0
        self.review_gate: asyncio.Event | None = None
        self.key_gate: asyncio.Event | None = None

    async def request(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        if method == "GET":
            if not self.readable:
                raise ApiError(403, {"message": "forbidden"}, method, path)
            if path == "/.well-known/openid-configuration":
                return {"issuer": "https://kubernetes.default.svc.cluster.local",
                        "jwks_uri": "https://172.18.0.2:6443/openid/v1/jwks"}
            assert path == "/openid/v1/jwks"
            self.key_reads += 1
            if self.key_gate is not None:
                await self.key_gate.wait()
            return json.loads(json.dumps(self.jwks))
        self.token_reviews += 1
        if self.review_gate is not None:
            await self.review_gate.wait()
        return await super().request(method, path, body, **kw)


def checked_api(kube: IssuerKube, **kw: Any) -> StateApi:
    runs = FakeRuns({("ns", "demo-0"): ("demo", FLOW_UID, "pod-uid")})
    return StateApi(lambda: kube, runs, runs,  # type: ignore[arg-type,return-value]
                    issuer=IssuerKeys(lambda: kube), **kw)  # type: ignore[arg-type,return-value]


def test_a_token_the_issuer_did_not_sign_or_that_expired_is_refused_without_a_token_review() -> None:
    kube = IssuerKube()
    state = checked_api(kube)
    good_rsa, good_ec = signed(RSA_KEY, "rsa"), signed(EC_KEY, "ec")
    kube.reviews.update({good_rsa: review(), good_ec: review()})
    refused = {
        "forged": signed(FORGER_KEY, "rsa"),  # the issuer's kid, another key
        "unknown kid": signed(FORGER_KEY, "mine"),
        "expired": signed(RSA_KEY, "rsa", expires_in=-3600),
        "other audience": signed(RSA_KEY, "rsa", audience="https://kubernetes.default.svc"),
        "EC key, RSA kid": signed(EC_KEY, "rsa"),
        "unsigned claims": jwt("demo-0"),  # what used to reach a TokenReview on its claims alone
    }

    async def scenario() -> None:
        for why, token in refused.items():
            with pytest.raises(StateError) as e:
                await state.auth.authenticate(f"Bearer {token}")
            assert e.value.status == 401, why
        assert kube.token_reviews == 0
        assert "expired" in str(await _refusal(state, refused["expired"]))
        assert await state.auth.authenticate(f"Bearer {good_rsa}") == POD
        assert await state.auth.authenticate(f"Bearer {good_ec}") == POD
        assert kube.token_reviews == 2  # a signed token still gets its TokenReview (is its pod alive?)

    asyncio.run(scenario())


async def _refusal(state: StateApi, token: str) -> StateError:
    with pytest.raises(StateError) as e:
        await state.auth.authenticate(f"Bearer {token}")
    return e.value


def test_a_flood_of_forged_tokens_from_one_client_does_not_delay_a_valid_pod() -> None:
    """Before: every forged token with the right claims queued for one of the review slots (here one)
    behind a slow TokenReview; now none of them reaches one, and the pod's is answered at once."""
    from aiohttp.test_utils import TestClient, TestServer

    kube = IssuerKube()
    state = checked_api(kube, token_reviews=1, limits=ClientLimits(rate=10_000, burst=10_000, authenticating=1000))
    good = signed(RSA_KEY, "rsa")
    kube.reviews[good] = review()

    async def scenario() -> None:
        async with TestClient(TestServer(state.app())) as client:
            flood = [asyncio.ensure_future(client.get(c.STATE_API_PREFIX + c.STATE_KEY, headers={
                "Authorization": f"Bearer {signed(FORGER_KEY, 'rsa', name=f'forged-{i}')}"})) for i in range(300)]
            async with asyncio.timeout(10):
                served = await client.put(c.STATE_API_PREFIX + c.STATE_KEY, data=b"mine",
                                          headers={"Authorization": f"Bearer {good}"})
            assert served.status == 204
            answers = await asyncio.gather(*flood)
            assert {r.status for r in answers} == {401}
            assert kube.token_reviews == 1  # the pod's own, and nothing for the 300 forged tokens
            assert kube.key_reads == 1  # and the keys were read once, not once per forged token

    asyncio.run(scenario())


def test_a_rotated_key_is_fetched_once_and_made_up_key_ids_do_not_refetch() -> None:
    kube = IssuerKube(keys=[jwk(RSA_KEY, "old")])
    now = [1000.0]
    issuer = IssuerKeys(lambda: kube, clock=lambda: now[0])  # type: ignore[arg-type,return-value]

    async def scenario() -> None:
        assert await issuer.verify(signed(RSA_KEY, "old"), c.STATE_AUDIENCE)
        assert kube.key_reads == 1
        kube.jwks["keys"].append(jwk(ROTATED_KEY, "new"))  # the issuer rotates its key
        now[0] += issuerkeys.REFETCH_SECONDS
        rotated = signed(ROTATED_KEY, "new")
        assert all(await asyncio.gather(*(issuer.verify(rotated, c.STATE_AUDIENCE) for _ in range(5))))
        assert kube.key_reads == 2  # one read for five tokens with the new kid
        for i in range(50):  # made-up key ids, soon after: refused, the set is not read again
            with pytest.raises(issuerkeys.TokenRefused):
                await issuer.verify(signed(FORGER_KEY, f"made-up-{i}"), c.STATE_AUDIENCE)
        assert kube.key_reads == 2
        now[0] += issuerkeys.REFETCH_SECONDS
        with pytest.raises(issuerkeys.TokenRefused):
            await issuer.verify(signed(FORGER_KEY, "made-up-later"), c.STATE_AUDIENCE)
        assert kube.key_reads == 3  # at most one read per REFETCH_SECONDS
        # The periodic refresh: a token of a known key is checked at once, the keys read meanwhile.
        kube.key_gate = asyncio.Event()
        now[0] += issuerkeys.REFRESH_SECONDS
        async with asyncio.timeout(5):
            assert await issuer.verify(rotated, c.STATE_AUDIENCE)
        await asyncio.sleep(0)  # the background read starts (and waits on the gate)
        assert kube.key_reads == 4
        kube.key_gate.set()
        if issuer._reading is not None:
            await issuer._reading

    asyncio.run(scenario())


def test_without_the_issuer_keys_a_token_falls_back_to_the_token_review_and_the_client_limits_hold(
        caplog: pytest.LogCaptureFixture) -> None:
    """A cluster whose keys the operator may not read: today's TokenReview decides, said once in the
    log; one address then holds at most its few authentications, the rest are told 429 at once."""
    from aiohttp.test_utils import TestClient, TestServer

    kube = IssuerKube(readable=False)
    state = checked_api(kube, limits=ClientLimits(rate=10_000, burst=10_000, authenticating=3))
    good = signed(RSA_KEY, "rsa")
    kube.reviews[good] = review()

    async def scenario() -> None:
        kube.review_gate = asyncio.Event()
        async with TestClient(TestServer(state.app())) as client:
            told: list[int] = []
            all_but_three = asyncio.Event()

            async def forged(i: int) -> int:
                answer = await client.get(c.STATE_API_PREFIX + c.STATE_KEY, headers={
                    "Authorization": f"Bearer {signed(FORGER_KEY, 'rsa', name=f'forged-{i}')}"})
                told.append(answer.status)
                if len(told) == 17:
                    all_but_three.set()
                return answer.status

            flood = [asyncio.ensure_future(forged(i)) for i in range(20)]
            async with asyncio.timeout(10):
                await all_but_three.wait()  # 17 answered while 3 wait for their TokenReviews
            assert set(told) == {429} and kube.token_reviews == 3
            assert kube.review_gate is not None
            kube.review_gate.set()
            assert set(await asyncio.gather(*flood)) == {401, 429}
            ok = await client.get(c.STATE_API_PREFIX + c.STATE_KEY, headers={"Authorization": f"Bearer {good}"})
            assert ok.status == 404  # authenticated (no state yet)

    with caplog.at_level("WARNING", logger="flowkube.issuerkeys"):
        asyncio.run(scenario())
    assert len([r for r in caplog.records if "cannot be read" in r.message]) == 1


def test_one_address_has_a_rate_and_a_burst_and_others_are_not_slowed() -> None:
    now = [0.0]
    limits = ClientLimits(rate=2, burst=4, authenticating=1, clock=lambda: now[0], kept=3)
    for _ in range(4):
        limits.take("10.0.0.1")
    with pytest.raises(StateError) as e:
        limits.take("10.0.0.1")
    assert e.value.status == 429 and "10.0.0.1" in str(e.value)
    limits.take("10.0.0.2")  # another pod is not slowed
    now[0] += 0.5
    limits.take("10.0.0.1")  # refilled at the rate
    with limits.authenticating("10.0.0.1"), pytest.raises(StateError), limits.authenticating("10.0.0.1"):
        pass
    for i in range(10):  # many addresses: the table stays bounded, busy ones kept
        limits.take(f"10.1.0.{i}")
    assert len(limits._clients) <= 3


def test_a_runner_sending_any_number_of_checkpoints_leaves_at_most_keep_configmaps() -> None:
    """Checkpoints go into a ring of spec.checkpoints.keep ConfigMaps (3 here): a thousand PUTs, in any
    order, leave three, each holding the latest number of its slot; only the running attempt may PUT
    them, nobody may GET them through the state API, and the state's size bound holds."""
    from aiohttp.test_utils import TestClient, TestServer

    from flowkube_operator.serve.stateauth import ClientLimits

    kube = FakeKube()
    runs = FakeRuns({("ns", "demo-0"): ("demo", FLOW_UID, "pod-uid")})
    # The per-address rate is a bound of its own (a runner is slowed with 429s); lifted here to reach the ring's.
    state = StateApi(lambda: kube, runs, runs, limits=ClientLimits(rate=1e6, burst=10**6))  # type: ignore[arg-type,return-value]
    auth = {"Authorization": f"Bearer {jwt('good')}"}

    async def scenario() -> None:
        async with TestClient(TestServer(state.app())) as client:
            for n in [*range(1, 1001), 7, 3]:
                sent = await client.put(c.STATE_API_PREFIX + c.checkpoint_key(n), data=f"cp{n}".encode(), headers=auth)
                assert sent.status == 204
            rings = {name: cm for name, cm in kube.configmaps.items() if name.startswith("demo-cp-")}
            assert sorted(rings) == ["demo-cp-0", "demo-cp-1", "demo-cp-2"]
            held = {name: (cm["metadata"]["annotations"][c.CHECKPOINT_ANNOTATION],
                           base64.b64decode(cm["binaryData"][c.STATE_KEY])) for name, cm in rings.items()}
            # Each slot holds the latest number sent to it (what a fork checks before it copies one): a
            # checkpoint sent late never replaces a later one.
            assert held == {"demo-cp-0": ("999", b"cp999"), "demo-cp-1": ("1000", b"cp1000"),
                            "demo-cp-2": ("998", b"cp998")}
            assert all(cm["metadata"]["ownerReferences"][0]["uid"] == FLOW_UID for cm in rings.values())
            for bad in ("checkpoint.0", "checkpoint.01", "checkpoint.-1", "checkpoint.1234567890123456"):
                assert (await client.put(c.STATE_API_PREFIX + bad, data=b"x", headers=auth)).status == 403, bad
            assert (await client.get(c.STATE_API_PREFIX + c.checkpoint_key(7), headers=auth)).status == 403
            big = await client.put(c.STATE_API_PREFIX + c.checkpoint_key(5), data=b"x" * (c.STATE_LIMIT + 1),
                                   headers=auth)
            assert big.status == 413

    asyncio.run(scenario())


def test_quota_reservations_through_the_state_api_are_the_books_and_bad_bodies_are_refused() -> None:
    import datetime as dt
    from decimal import Decimal

    from aiohttp.test_utils import TestClient, TestServer

    from flowkube_api.windows import WindowSpec
    from flowkube_operator.quotas.book import Limit, QuotaBook, Refusal, Spend

    q = "FlowQuota ns/tokens"
    book = QuotaBook()
    book.set_limits(q, [Limit(q, "all", WindowSpec("Lifetime"), max_tokens=100)])
    leading = [True]
    reminded: list[Any] = []

    class Desk:
        def reserve(self, t: Any, model: str, worst: Spend, priced: bool, charges: Any, held: Any) -> Any:
            now = dt.datetime.now(dt.UTC)
            if not leading[0]:
                return None
            outcome = book.reserve([q], t.pod, model, worst, now, priced=priced)
            return outcome if isinstance(outcome, Refusal) else outcome.id

        def settle(self, t: Any, reservation: int, charges: Any, held: Any) -> Any:
            return book.settle(reservation, t.pod, charges) if leading[0] else None

        def hold(self, t: Any, charges: Any, held: Any) -> Any:
            reminded.append(held)
            return True if leading[0] else None

    runs = FakeRuns({("ns", "demo-0"): ("demo", FLOW_UID, "pod-uid")})
    auth = {"Authorization": f"Bearer {jwt('good')}"}

    async def scenario() -> None:
        state = StateApi(lambda: FakeKube(), runs, runs, quotas=Desk())  # type: ignore[arg-type,return-value]
        async with TestClient(TestServer(state.app())) as client:
            url = c.QUOTA_API_PREFIX
            ok = await client.post(url + "reserve", json={"model": "m", "tokens": 60, "cost": "0.1"}, headers=auth)
            assert ok.status == 200
            first = (await ok.json())["id"]
            refused = await client.post(url + "reserve", json={"model": "m", "tokens": 41}, headers=auth)
            assert refused.status == 402
            assert (await refused.json())["message"].startswith(f"{q}: limit all (maxTotalTokens=100, lifetime)")
            charges = [{"at": "2026-11-28T08:00:00Z", "model": "m", "totalTokens": 30, "cost": "0.05"}]
            settled = await client.post(url + "settle", json={"id": first, "charges": charges}, headers=auth)
            assert settled.status == 204
            assert book.used((q, "all"), dt.datetime.now(dt.UTC)) == Spend(30, Decimal("0.05"))
            assert book.reserved((q, "all")) == Spend()
            many_held = [{"id": i + 1, "model": "m", "tokens": 1} for i in range(65)]
            for bad, field in (({"model": "m", "tokens": -1}, "tokens"), ({"model": "m" * 600, "tokens": 1}, "model"),
                               ({"tokens": 1}, "model"), ({"model": "m", "tokens": 1, "held": many_held}, "held"),
                               ({"model": "m", "tokens": 1, "held": [{"id": 0, "model": "m", "tokens": 1}]}, "id"),
                               ({"model": "m", "tokens": 1, "cost": "1E+100000000"}, "cost"),
                               ({"model": "m", "tokens": 1, "charges": [{"at": "2026-11-28T08:00:00Z", "model": "m",
                                                                        "totalTokens": 10**1000}]}, "tokens"),
                               ({"model": "m", "tokens": 1, "charges": [{"at": "2026-11-28T08:00:00Z", "model": "m",
                                                                        "cost": "1E+100000000"}]}, "cost")):
                answer = await client.post(url + "reserve", json=bad, headers=auth)
                assert answer.status == 422 and field in (await answer.json())["message"], bad
            big = await client.post(url + "settle", data=b"x" * (600 * 1024), headers=auth)
            assert big.status == 413
            held = [{"id": 7, "model": "m", "tokens": 5, "cost": "0.01"}]
            reminder = await client.post(url + "hold", json={"charges": charges, "held": held}, headers=auth)
            assert reminder.status == 204
            assert reminded == [[(7, "m", Spend(5, Decimal("0.01")))]]
            assert (await client.post(url + "hold", json={"held": many_held}, headers=auth)).status == 422
            assert (await client.post(url + "spend", json={}, headers=auth)).status == 404
            assert (await client.post(url + "reserve", json={"model": "m", "tokens": 1})).status == 401
            leading[0] = False
            assert (await client.post(url + "reserve", json={"model": "m", "tokens": 1}, headers=auth)).status == 503
        off = StateApi(lambda: FakeKube(), runs, runs)  # type: ignore[arg-type,return-value]
        async with TestClient(TestServer(off.app())) as client:
            answer = await client.post(c.QUOTA_API_PREFIX + "reserve", json={"model": "m", "tokens": 1}, headers=auth)
            assert answer.status == 404

    asyncio.run(scenario())
