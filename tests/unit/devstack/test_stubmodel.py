"""The stub model: deterministic replies, usage, ledger, and failure modes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from flowkube_devstack.stubmodel import Rules, StubModel, count_tokens, running


def chat(stub: StubModel, text: str, model: str = "m1", **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": text}]}
    return httpx.post(f"{stub.base_url}/chat/completions", json={**body, **extra}, timeout=10)


def test_rules_default_usage_and_ledger(tmp_path: Path) -> None:
    ledger_file = tmp_path / "ledger.jsonl"
    rules = Rules.from_json({"default": "plain", "rules": [{"contains": "approve", "reply": "approved"}]})
    with running(rules, ledger_file) as stub:
        first = chat(stub, "please approve this").json()
        second = chat(stub, "something else", model="m2").json()
        assert first["choices"][0]["message"]["content"] == "approved"
        assert second["choices"][0]["message"]["content"] == "plain"
        assert second["model"] == "m2"
        usage = first["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["completion_tokens"] == count_tokens("approved") + 1
        assert chat(stub, "please approve this").json()["usage"] == usage  # deterministic
        served = httpx.get(f"{stub.url}/ledger").json()
    assert [e["model"] for e in served] == ["m1", "m2", "m1"]
    assert [json.loads(line) for line in ledger_file.read_text().splitlines()] == served


def test_structured_output_is_wrapped_to_the_schema() -> None:
    schema = {"type": "object", "properties": {"outcome": {"type": "string"}}, "required": ["outcome"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "X", "schema": schema}}
    with running(Rules.from_json({"default": "approved"})) as stub:
        content = chat(stub, "x", response_format=fmt).json()["choices"][0]["message"]["content"]
    assert json.loads(content) == {"outcome": "approved"}


def test_times_limits_a_rule_and_status_failures() -> None:
    rules = Rules.from_json({"default": "ok", "rules": [{"contains": "x", "fail": 500, "times": 1}]})
    with running(rules) as stub:
        assert chat(stub, "x").status_code == 500
        assert chat(stub, "x").status_code == 200
        assert len(stub.ledger()) == 1  # failures are not served calls


def test_drop_closes_the_connection_without_an_answer() -> None:
    with running(Rules.from_json({"rules": [{"fail": "drop"}]})) as stub, pytest.raises(httpx.TransportError):
        chat(stub, "anything")


def test_hold_keeps_a_call_in_flight_until_released() -> None:
    with running(Rules.from_json({"default": "late", "rules": [{"contains": "slow", "hold": True}]})) as stub:
        answers: list[str] = []
        caller = threading.Thread(target=lambda: answers.append(chat(stub, "slow").json()["model"]))
        caller.start()
        assert stub.wait_held(1, timeout=10)
        assert stub.ledger() == []
        stub.release_held()
        caller.join(timeout=10)
        assert answers == ["m1"] and len(stub.ledger()) == 1


def test_cli_prints_its_url(tmp_path: Path) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"default": "from file"}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowkube_devstack.stubmodel", "--port", "0", "--rules", str(rules)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        reply = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": []}, timeout=10)
        assert reply.json()["choices"][0]["message"]["content"] == "from file"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
