"""Admission decisions, without a cluster: what humans may write to status, and definition checks."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from flowkube_operator.webhook import Validator, review_status_write

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
    from flowkube_operator.webhook import template_problem, template_spec_problem

    tspec = {"parameters": [{"name": "topic", "required": True, "type": "string"}],
             "template": {"flowRef": "pkg.mod:Article"}}
    asked: list[Any] = []

    async def lookup(key: Any) -> dict[str, Any] | None:
        asked.append(key)
        return {"spec": tspec} if key == ("FlowTemplate", "team", "article") else None

    def check(spec: dict[str, Any], status: dict[str, Any] | None = None) -> tuple[dict[str, Any], str | None]:
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
    assert template_spec_problem({"parameters": [{"name": "n", "type": "integer", "default": "three"}]}) == (
        "spec.parameters[n].default: must be integer")
    assert template_spec_problem({"parameters": [{"name": "n", "type": "integer", "default": 3}]}) is None


def test_a_template_too_big_to_copy_into_its_flows_status_is_refused() -> None:
    from flowkube_operator.webhook import template_spec_problem

    big = {"parameters": [{"name": "n", "default": "x" * (300 * 1024)}], "template": {"flowRef": "a:B"}}
    problem = template_spec_problem(big)
    assert problem is not None and "a template's limit is 262144" in problem
    deep: Any = 1
    for _ in range(40):
        deep = [deep]
    nested = template_spec_problem({"parameters": [{"name": "d", "default": deep}]})
    assert nested is not None and "spec.parameters[d].default nests" in nested
