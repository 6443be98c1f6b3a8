"""The definition validator (``flowkube-runner validate-server``): crewAI's verdict, by JSON path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from flowkube_devstack.cluster import free_port, wait_for
from flowkube_runner.validate import make_server

EXPR = {"call": "expression", "expr": "1"}
WRITER = {"role": "Writer", "goal": "Write", "backstory": "Careful.", "settings": {"llm": "gpt-4o-mini"}}


def flow(**methods: Any) -> dict[str, Any]:
    return {"schema": "crewai.flow/v1", "name": "Checked", "methods": methods}


VALID = flow(
    draft={"start": True, "do": {"call": "agent", "with": {**WRITER, "input": "Draft ${state.topic}"}}},
    review={
        "listen": "draft",
        "do": {"call": "expression", "expr": "outputs.draft.raw"},
        "human_feedback": {"message": "OK?", "emit": ["approved", "rejected"], "default_outcome": "rejected",
                           "llm": "gpt-4o-mini"},
    },
    publish={"listen": "approved", "do": {"call": "agent", "with": {**WRITER, "input": "${outputs.draft.raw}"}}},
)


@pytest.fixture(scope="module")
def validator() -> Iterator[str]:
    server = make_server("127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def post(url: str, body: bytes | None, path: str = "/") -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url + path, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def check(url: str, definition: Any) -> dict[str, Any]:
    status, answer = post(url, json.dumps(definition).encode())
    assert status == 200, answer
    assert set(answer) == {"valid", "errors", "message"}
    return answer


def test_a_valid_definition(validator: str) -> None:
    assert check(validator, VALID) == {"valid": True, "errors": [], "message": "the definition is valid"}


@pytest.mark.parametrize(
    ("definition", "loc", "msg"),
    [
        pytest.param(
            flow(again={"start": True, "listen": "again", "do": EXPR}),
            ["methods", "again", "listen"],
            "A listener triggered by its own completion creates an infinite loop",
            id="model-level error: the path comes out of crewAI's message",
        ),
        pytest.param(
            flow(a={"start": True, "do": {"call": "expression", "expr": "nothere.x"}}),
            ["methods", "a", "do", "expr"],
            "unknown CEL root at methods.a.do.expr: 'nothere'",
            id="CEL root",
        ),
        pytest.param(
            flow(a={"start": True, "do": EXPR, "human_feedback": {
                "message": "m", "emit": ["yes", "no"], "default_outcome": "maybe", "llm": "gpt-4o-mini"}}),
            ["methods", "a", "human_feedback", "default_outcome"],
            "default_outcome must be one of human_feedback.emit",
            id="an issue crewAI only logs",
        ),
        pytest.param(
            {**flow(a={"start": True, "do": EXPR}), "state": {"type": "dict", "default": 3}},
            ["state", "default"],
            "Input should be a valid dictionary",
            id="tagged union: no tag in the path",
        ),
        pytest.param(
            flow(a={"start": True, "do": {"call": "agent", "with": {**WRITER}}}),
            ["methods", "a", "do", "with", "input"],
            "Field required",
            id="missing field of the member the call tag chose",
        ),
    ],
)
def test_crewai_errors_name_the_place(validator: str, definition: Any, loc: list[Any], msg: str) -> None:
    answer = check(validator, definition)
    assert answer["valid"] is False
    assert [e["loc"] for e in answer["errors"]] == [loc], answer
    assert msg in answer["errors"][0]["msg"]
    assert answer["message"].startswith(f"1 problem: {'.'.join(loc)}: ")


def test_a_listen_nothing_emits_or_routes_to_is_refused_naming_it(validator: str) -> None:
    """crewAI accepted a method listening to a label no method emits or routes to ("aproved" for
    "approved"), and the Flow finished without ever running it."""
    typo = flow(**{**VALID["methods"], "publish": {**VALID["methods"]["publish"], "listen": "aproved"}})
    (error,) = check(validator, typo)["errors"]
    assert error["loc"] == ["methods", "publish", "listen"]
    assert error["msg"].startswith("listens to 'aproved', which no method emits or routes to: it would never run")
    assert "approved" in error["msg"]  # the labels that exist
    either = flow(**{**VALID["methods"], "publish": {**VALID["methods"]["publish"],
                                                    "listen": {"or": ["aproved", "approved"]}}})
    assert check(validator, either)["valid"] is True  # one branch can run it
    both = flow(**{**VALID["methods"], "publish": {**VALID["methods"]["publish"],
                                                  "listen": {"and": ["draft", "aproved"]}}})
    assert check(validator, both)["errors"][0]["loc"] == ["methods", "publish", "listen"]
    dynamic = flow(pick={"start": True, "router": True, "do": EXPR}, later={"listen": "anything", "do": EXPR})
    assert check(validator, dynamic)["valid"] is True  # a router without `emit` may return any label


def test_a_misspelt_call_is_one_error_listing_the_choices(validator: str) -> None:
    answer = check(validator, flow(a={"start": True, "do": {"call": "agnet"}}, b={"listen": "a", "do": EXPR}))
    (error,) = answer["errors"]
    assert error["loc"] == ["methods", "a", "do", "call"]
    assert error["msg"].startswith("Input should be 'code', 'tool', ") and "'agent'" in error["msg"]


def test_not_an_object(validator: str) -> None:
    answer = check(validator, ["methods"])
    assert answer["valid"] is False
    assert answer["errors"] == [{"loc": [], "msg": "a flow definition must be a JSON object"}]


def test_unusable_requests_are_http_errors(validator: str) -> None:
    assert post(validator, b"{not json")[0] == 400
    status, answer = post(validator, None)
    assert status == 400 and "empty request body" in answer["message"]
    assert post(validator, b"{}", path="/elsewhere")[0] == 404
    with urllib.request.urlopen(validator + "/healthz", timeout=10) as response:
        assert response.status == 200


def test_the_operator_webhook_turns_a_verdict_into_a_field_named_refusal(validator: str) -> None:
    from tests.unit.operator.test_webhook import definition_problem

    spec = {"definition": flow(again={"start": True, "listen": "again", "do": EXPR})}
    problem = definition_problem(spec, validator)
    assert problem is not None, "the webhook admitted an invalid definition"
    assert problem.startswith("invalid crewAI flow definition: spec.definition.methods.again.listen: ")
    assert definition_problem({"definition": VALID}, validator) is None


@pytest.mark.slow
def test_cli_serves_until_sigterm(tmp_path: Any) -> None:
    port = free_port()
    env = {**os.environ, "HOME": str(tmp_path), "CREWAI_DISABLE_TELEMETRY": "true", "OTEL_SDK_DISABLED": "true"}
    proc = subprocess.Popen([sys.executable, "-m", "flowkube_runner", "validate-server", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    try:
        wait_for(healthy, 120, "validate-server /healthz")
        assert check(url, VALID)["valid"] is True
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
