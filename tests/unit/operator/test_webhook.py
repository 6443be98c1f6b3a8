"""Admission decisions, without a cluster: what humans may write to status, and definition checks."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from flowkube_operator.serve.webhook import Validator, review_status_write

PENDING = {"status": {"phase": "AwaitingFeedback", "feedback": {"request": {"id": "r1", "method": "review"}}}}


def definition_problem(spec: dict[str, Any], url: str) -> str | None:
    """What the Flow webhook says of ``spec``'s definition, asking the validator at ``url``."""
    async def ask() -> str | None:
        validator = Validator(url)
        try:
            return await validator.problem(spec)
        finally:
            await validator.close()

    return asyncio.run(ask())


def with_response(resp: dict[str, Any], base: dict[str, Any] = PENDING) -> dict[str, Any]:
    new: dict[str, Any] = json.loads(json.dumps(base))
    new["status"].setdefault("feedback", {})["response"] = resp
    return new


def test_a_valid_answer_is_admitted() -> None:
    assert review_status_write(PENDING, with_response({"text": "ok", "requestId": "r1"}), by_operator=False) is None


@pytest.mark.parametrize(("resp", "expected"), [
    ({"text": "ok", "requestId": "r0"}, "is not the pending request"),
    ({"text": ""}, "non-empty"),
    ({"text": "ok", "extra": 1}, "unknown field"),
    ({"text": 5}, "must be a string"),
])
def test_bad_answers_are_refused(resp: dict[str, Any], expected: str) -> None:
    problem = review_status_write(PENDING, with_response(resp), by_operator=False)
    assert problem is not None and expected in problem


def test_nothing_pending_is_refused_and_other_fields_are_the_operators() -> None:
    idle = {"status": {"phase": "Running"}}
    assert "no feedback request is pending" in (review_status_write(idle, with_response({"text": "x"}, idle),
                                                                     by_operator=False) or "")
    forged = {"status": {**PENDING["status"], "phase": "Succeeded"}}
    assert "only status.feedback.response" in (review_status_write(PENDING, forged, by_operator=False) or "")
    assert review_status_write(PENDING, forged, by_operator=True) is None


@pytest.fixture
def validator() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ok = bool(body.get("methods"))
            verdict = {"valid": ok, "errors": [] if ok else [{"loc": ["methods"], "msg": "at least one method"}]}
            data = json.dumps(verdict).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/validate"
    server.shutdown()


def test_definition_problems_name_the_field(validator: str) -> None:
    assert definition_problem({"definition": {"name": "x", "methods": [{"name": "a"}]}}, validator) is None
    problem = definition_problem({"definition": {"name": "x", "methods": []}}, validator)
    assert problem == "invalid crewAI flow definition: spec.definition.methods: at least one method"


def test_an_unreachable_validator_admits(validator: str) -> None:
    assert definition_problem({"definition": {"name": "x"}}, "http://127.0.0.1:9/validate") is None
    assert definition_problem({"flowRef": "a:B"}, validator) is None


def test_responded_by_cannot_be_forged() -> None:
    forged = with_response({"text": "ok", "respondedBy": "the-boss"})
    problem = review_status_write(PENDING, forged, by_operator=False, username="mallory")
    assert problem is not None and "recorded by flowkube" in problem
    honest = with_response({"text": "ok", "respondedBy": "mallory"})  # as the mutating webhook sets it
    assert review_status_write(PENDING, honest, by_operator=False, username="mallory") is None


def test_a_second_answer_before_the_first_is_applied_is_refused_and_names_the_first() -> None:
    """Two reviewers answer at once (two consoles): the second patch reaches the API server while the
    first answer still waits for the operator. It is refused; the first answer stands."""
    first = with_response({"text": "approved", "requestId": "r1", "respondedBy": "alice"})
    second = with_response({"text": "rejected", "requestId": "r1"}, first)
    problem = review_status_write(first, second, by_operator=False, username="bob")
    assert problem and "answered already by alice" in problem
    # An answer left over for an earlier request does not block the pending one.
    stale = with_response({"text": "old", "requestId": "r0", "respondedBy": "alice"})
    assert review_status_write(stale, with_response({"text": "new", "requestId": "r1"}, stale),
                               by_operator=False, username="bob") is None


# -- templates ---------------------------------------------------------------------------------------

def test_a_flow_of_a_template_is_checked_against_the_template_or_the_copy_its_status_took() -> None:
    from flowkube_operator.serve.webhook import template_problem, template_spec_problem

    tspec = {"parameters": [{"name": "topic", "required": True, "type": "string"}],
             "template": {"flowRef": "pkg.mod:Article"}}
    asked: list[Any] = []

    async def lookup(key: Any) -> dict[str, Any] | None:
        asked.append(key)
        return {"spec": tspec} if key == ("FlowTemplate", "team", "article") else None

    def check(spec: dict[str, Any], status: dict[str, Any] | None = None) -> tuple[dict[str, Any] | None, str | None]:
        return asyncio.run(template_problem(spec, "team", status, lookup))

    ok = {"templateRef": {"name": "article"}, "inputs": {"topic": "x"}}
    assert check(ok) == ({"flowRef": "pkg.mod:Article", "inputs": {"topic": "x"}}, None)
    assert check({"templateRef": {"name": "article"}})[1] == 'spec.inputs.topic: required by FlowTemplate "article" ' \
        'in namespace "team"'
    assert check({"templateRef": {"name": "gone"}})[1] == ('spec.templateRef: FlowTemplate "gone" in namespace "team" '
                                                           "not found (create the template first)")
    assert check({"templateRef": {"name": "x", "kind": "ClusterFlowTemplate"}})[1] == (
        'spec.templateRef: ClusterFlowTemplate "x" not found (create the template first)')
    # An update of a Flow that took its template is checked against that copy, never looked up again.
    asked.clear()
    taken = {"template": {"kind": "FlowTemplate", "name": "gone", "spec": tspec}}
    assert check({"templateRef": {"name": "gone"}, "inputs": {"topic": 1}}, taken)[1] == (
        'spec.inputs.topic: must be string (a parameter of FlowTemplate "gone" in namespace "team"), not integer')
    assert asked == []
    # One that took a snapshot is checked against the snapshot's spec (read through the operator's LRU).
    ref = {"template": {"kind": "FlowTemplate", "name": "gone", "snapshot": "gone-0123456789abcdef", "hash": "h"}}

    async def snapshot(namespace: str, taken: Any) -> dict[str, Any] | None:
        asked.append((namespace, taken["snapshot"]))
        return tspec if taken["snapshot"] == "gone-0123456789abcdef" else None

    def check_snapshot(spec: dict[str, Any], status: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
        return asyncio.run(template_problem(spec, "team", status, lookup, snapshot))

    assert check_snapshot({"templateRef": {"name": "gone"}, "inputs": {"topic": 1}}, ref)[1] == (
        'spec.inputs.topic: must be string (a parameter of FlowTemplate "gone" in namespace "team"), not integer')
    assert asked == [("team", "gone-0123456789abcdef")]
    # A snapshot that cannot be read: the Flow's own bytes were checked; the reconcile fails it, naming it.
    unreadable = {"template": {**ref["template"], "snapshot": "gone-ffffffffffffffff"}}
    assert check_snapshot({"templateRef": {"name": "gone"}, "inputs": {"topic": 1}}, unreadable) == (None, None)
    assert template_spec_problem({"parameters": [{"name": "n", "type": "integer", "default": "three"}]}) == (
        "spec.parameters[n].default: must be integer")
    assert template_spec_problem({"parameters": [{"name": "n", "type": "integer", "default": 3}]}) is None


def test_a_template_too_big_to_copy_into_its_flows_status_is_refused() -> None:
    from flowkube_operator.serve.webhook import template_spec_problem

    big = {"parameters": [{"name": "n", "default": "x" * (300 * 1024)}], "template": {"flowRef": "a:B"}}
    problem = template_spec_problem(big)
    assert problem is not None and "a template's limit is 262144" in problem
    deep: Any = 1
    for _ in range(40):
        deep = [deep]
    nested = template_spec_problem({"parameters": [{"name": "d", "default": deep}]})
    assert nested is not None and "spec.parameters[d].default nests" in nested


# -- the admission server: no client can hold it ------------------------------------------------------

def _admission_server(body_seconds: float) -> tuple[Any, list[int]]:
    """The real FlowkubeWebhookServer._serve on a bare aiohttp app (kopf's route), with a review
    function that allows everything and records the size of each review it decoded."""
    from aiohttp import web

    from flowkube_operator.serve.webhook import FlowkubeWebhookServer

    server = FlowkubeWebhookServer(body_seconds=body_seconds)
    decoded: list[int] = []

    async def fn(data: Any, **_: Any) -> dict[str, Any]:
        decoded.append(len(json.dumps(data)))
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "response": {"uid": data["request"]["uid"], "allowed": True}}

    async def serve(request: web.Request) -> web.Response:
        return await server._serve(fn, request)  # type: ignore[arg-type]

    app = web.Application()
    app.router.add_post("/{id:.*}", serve)
    return (server, app), decoded


def _review(size: int) -> bytes:
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": {"uid": "u1", "object": {"spec": {"pad": "x" * size}}}}).encode()


def test_a_stalled_chunked_review_neither_holds_a_large_one_up_nor_stays_open_past_its_deadline() -> None:
    """One client opens a chunked review and sends one chunk, then nothing; another sends a 1 MiB
    review. Before, every review over 256 KiB or chunked waited for one process-wide slot that the
    stalled one held with no deadline: the large one was never answered."""
    from aiohttp.test_utils import TestClient, TestServer

    (server, app), decoded = _admission_server(body_seconds=1.0)
    receiving = asyncio.Event()
    reserve = server._budget.acquire

    async def acquire(client: str, n: int) -> None:
        await reserve(client, n)
        receiving.set()

    server._budget.acquire = acquire

    async def scenario() -> None:
        async with TestClient(TestServer(app)) as client:
            reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
            writer.write(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n10\r\n{\"request\": {\"ui\r\n")
            await writer.drain()
            stalled = asyncio.ensure_future(reader.read())  # its whole answer, up to the server's close
            async with asyncio.timeout(5):
                await receiving.wait()  # its bytes reserved: its body is being received
            async with asyncio.timeout(0.9):  # inside the stalled one's deadline
                large = await client.post("/validate", data=_review(1024 * 1024),
                                          headers={"Content-Type": "application/json"})
                assert large.status == 200 and (await large.json())["response"]["allowed"] is True
            assert not stalled.done()  # answered while the stalled one is still open
            async with asyncio.timeout(5):
                answer = await stalled
            assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer
            assert reader.at_eof()  # and its connection closed
            writer.close()
            assert server._budget.free == server._budget.total  # what it held is free again
            assert len(decoded) == 1

    asyncio.run(scenario())


def test_the_byte_budget_serves_in_order_and_keeps_room_beyond_one_clients_share() -> None:
    from flowkube_operator.serve.webhook import ByteBudget

    async def scenario() -> None:
        budget = ByteBudget(total=10, per_client=6)
        await budget.acquire("a", 6)
        held_back = asyncio.ensure_future(budget.acquire("a", 1))  # over a's share: waits
        other = asyncio.ensure_future(budget.acquire("b", 4))  # passes a's waiter: there is room for b
        await asyncio.sleep(0)
        assert other.done() and not held_back.done() and budget.free == 0
        big = asyncio.ensure_future(budget.acquire("c", 3))
        small = asyncio.ensure_future(budget.acquire("d", 1))
        budget.release("b", 4)
        await asyncio.sleep(0)
        assert big.done() and small.done() and not held_back.done()  # in order, within the free bytes
        budget.release("a", 6)
        await asyncio.sleep(0)
        assert held_back.done()
        gone = asyncio.ensure_future(budget.acquire("e", 6))  # waits, then its client gives up
        await asyncio.sleep(0)
        gone.cancel()
        for client, n in (("a", 1), ("c", 3), ("d", 1)):
            budget.release(client, n)
        await asyncio.sleep(0)
        assert budget.free == budget.total and not budget._held and not budget._waiting

    asyncio.run(scenario())
