"""A deterministic OpenAI-compatible stand-in model for tests and the local devstack.

Serves ``POST /v1/chat/completions`` (on loopback unless told otherwise). Replies come from rules (first match wins)
or a default; token usage is derived from message lengths so runs are reproducible; every answered
call goes to a ledger (``GET /ledger``, optionally a JSONL file) that tests compare with reported
usage. Not a model: it never interprets anything.

Rules file (JSON)::

    {
      "default": "stub reply",
      "rules": [
        {"contains": "approve", "reply": "approved"},
        {"contains": "slow step", "hold": true, "times": 1},
        {"contains": "flaky", "fail": "drop"},
        {"contains": "broken", "fail": 500, "model": "gpt-4o-mini"}
      ]
    }

- ``contains``: substring of the last user message (``anywhere: true``: of any message);
  omitted matches every call. ``model``: only calls for that model.
- ``reply``: the assistant text. For a structured-output request (``response_format`` json_schema)
  a non-JSON reply is wrapped as ``{"<sole property>": reply}``.
- ``fail``: ``"drop"`` closes the connection without answering; an integer answers with that
  HTTP status. ``hold: true`` keeps the request open until :meth:`StubModel.release_held` or
  shutdown, so a test can act while a call is in flight.
- ``times``: the rule applies to its first N matching calls only, then is skipped.
- A conversational flow's router call (its last user message is crewAI's JSON routing context, with
  ``current_user_message`` and ``available_routes``) is matched on the user's message, not the JSON;
  with no matching rule it is answered ``{"intent": "converse"}``.
- ``structured``: true matches only structured-output requests (a conversational flow's router asking
  for ``{"intent": ...}``), false only plain ones. ``raw: true`` sends ``reply`` as is, even to a
  structured-output request (an answer the caller cannot parse, which the provider still bills).

Point crewAI at it through its normal OpenAI provider: ``OPENAI_BASE_URL=<url>/v1`` and
``OPENAI_API_KEY=stub`` (crewAI 1.15.30 reads ``OPENAI_BASE_URL``, then ``OPENAI_API_BASE``).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from flowkube_api.report import Usage

DEFAULT_REPLY = "stub reply"


def count_tokens(text: str) -> int:
    """Deterministic approximation of a tokenizer: about four characters per token."""
    return (len(text) + 3) // 4


@dataclass
class Rule:
    reply: str | None = None
    contains: str | None = None
    anywhere: bool = False
    model: str | None = None
    fail: str | int | None = None
    hold: bool = False
    times: int | None = None
    structured: bool | None = None
    raw: bool = False
    # Bills every token the request allows, as a worst-case model would: prompt tokens = the request
    # body's bytes, completion tokens = its max_tokens (a spend quota's worst case, met exactly).
    greedy: bool = False
    used: int = 0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Rule:
        known = {"reply", "contains", "anywhere", "model", "fail", "hold", "times", "structured", "raw", "greedy"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown rule keys: {sorted(unknown)}")
        return cls(**data)

    def matches(self, model: str, messages: list[dict[str, Any]], structured: bool = False) -> bool:
        if self.times is not None and self.used >= self.times:
            return False
        if self.structured is not None and self.structured != structured:
            return False
        if self.model is not None and self.model != model:
            return False
        if self.contains is None:
            return True
        if self.anywhere:
            return any(self.contains in _content_text(m) for m in messages)
        users = [m for m in messages if m.get("role") == "user"]
        if not users:
            return False
        text = _content_text(users[-1])
        return self.contains in (_routed_message(text) or text)


@dataclass
class Rules:
    default: str = DEFAULT_REPLY
    rules: list[Rule] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Rules:
        return cls(
            default=str(data.get("default", DEFAULT_REPLY)),
            rules=[Rule.from_json(r) for r in data.get("rules", [])],
        )

    @classmethod
    def load(cls, path: Path) -> Rules:
        return cls.from_json(json.loads(path.read_text(encoding="utf-8")))


def _content_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def _routed_message(text: str) -> str | None:
    """The user's message inside a conversational router's JSON context, or None for other calls."""
    if not text.startswith("{") or "current_user_message" not in text:
        return None
    try:
        context = json.loads(text)
    except ValueError:
        return None
    message = context.get("current_user_message") if isinstance(context, dict) else None
    return message if isinstance(message, str) and "available_routes" in context else None


def _structured_reply(reply: str, response_format: Any) -> str:
    """Make ``reply`` satisfy a json_schema response format when it is not JSON already."""
    if not isinstance(response_format, dict) or response_format.get("type") != "json_schema":
        return reply
    try:
        json.loads(reply)
    except ValueError:
        schema = response_format.get("json_schema", {}).get("schema", {})
        properties = list(schema.get("properties", {}))
        key = properties[0] if len(properties) == 1 else "result"
        return json.dumps({key: reply})
    return reply


class StubModel:
    """The server; use as a context manager in tests, or ``serve_forever`` from the CLI."""

    def __init__(
        self,
        rules: Rules | None = None,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        ledger_path: Path | None = None,
    ) -> None:
        self.rules = rules or Rules()
        self.ledger_path = ledger_path
        self._ledger: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._stopping = False
        self._held = 0
        self._held_changed = threading.Condition(self._lock)
        self._server = ThreadingHTTPServer((host, port), _handler_for(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def port(self) -> int:
        port: int = self._server.server_address[1]
        return port

    @property
    def base_url(self) -> str:
        """What to put in ``OPENAI_BASE_URL``."""
        return f"{self.url}/v1"

    def start(self) -> StubModel:
        self._thread = threading.Thread(target=self._server.serve_forever, name="stubmodel", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        self._release.set()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> StubModel:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def set_rules(self, rules: Rules) -> None:
        with self._lock:
            self.rules = rules

    def ledger(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._ledger)

    @property
    def held(self) -> int:
        with self._lock:
            return self._held

    def wait_held(self, count: int = 1, timeout: float = 30.0) -> bool:
        """Block until ``count`` requests are held, or the timeout passes."""
        with self._held_changed:
            return self._held_changed.wait_for(lambda: self._held >= count, timeout=timeout)

    def release_held(self) -> None:
        """Answer the held calls, and every later call of a ``hold`` rule at once (see `arm_holds`)."""
        self._release.set()

    def arm_holds(self) -> None:
        """``hold`` rules hold calls again (after an earlier `release_held`)."""
        self._release.clear()

    def _pick(self, model: str, messages: list[dict[str, Any]], structured: bool) -> Rule | None:
        with self._lock:
            for rule in self.rules.rules:
                if rule.matches(model, messages, structured):
                    rule.used += 1
                    return rule
            return None

    def _record(self, entry: dict[str, Any]) -> None:
        with self._lock:
            entry["seq"] = len(self._ledger) + 1
            self._ledger.append(entry)
            if self.ledger_path is not None:
                with self.ledger_path.open("a", encoding="utf-8") as fh:
                    fh.write(json.dumps(entry) + "\n")

    def _hold(self) -> bool:
        """Wait for release; False when the server is stopping (the call is then dropped)."""
        with self._held_changed:
            self._held += 1
            self._held_changed.notify_all()
        self._release.wait()
        with self._held_changed:
            self._held -= 1
            return not self._stopping

    def complete(self, body: dict[str, Any], size: int = 0) -> tuple[int, dict[str, Any] | None]:
        """Answer one chat completion request: (HTTP status, body); body None means drop. ``size``:
        the request body's bytes (the ledger keeps them: a quota's worst case of the call is made of them)."""
        received = time.time()
        model = str(body.get("model", "stub"))
        messages = [m for m in body.get("messages", []) if isinstance(m, dict)]
        response_format = body.get("response_format")
        structured = isinstance(response_format, dict) and response_format.get("type") == "json_schema"
        rule = self._pick(model, messages, structured)
        if rule is not None and rule.hold and not self._hold():
            return 0, None
        if rule is not None and rule.fail == "drop":
            return 0, None
        if rule is not None and isinstance(rule.fail, int):
            return rule.fail, {"error": {"message": "stub failure", "type": "server_error", "code": None}}
        reply = rule.reply if rule is not None and rule.reply is not None else self.rules.default
        users = [m for m in messages if m.get("role") == "user"]
        if rule is None and structured and users and _routed_message(_content_text(users[-1])) is not None:
            reply = "converse"  # a router call no rule routes: the built-in chat route
        if rule is None or not rule.raw:
            reply = _structured_reply(reply, response_format)

        prompt_tokens = sum(count_tokens(_content_text(m)) + 4 for m in messages)
        completion_tokens = count_tokens(reply) + 1
        if rule is not None and rule.greedy and isinstance(body.get("max_tokens"), int):
            prompt_tokens, completion_tokens = size, body["max_tokens"]
        cached = prompt_tokens // 4
        reasoning = completion_tokens // 2
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": reasoning},
        }
        last_user = next((_content_text(m) for m in reversed(messages) if m.get("role") == "user"), "")
        self._record({"time": time.time(), "received": received, "model": model, "usage": usage,
                      "lastUser": last_user[:2000], "bytes": size, "maxTokens": body.get("max_tokens")})
        return 200, {
            "id": f"chatcmpl-stub-{prompt_tokens}-{completion_tokens}",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "system_fingerprint": "stub",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": reply, "refusal": None},
                    "finish_reason": "stop",
                    "logprobs": None,
                }
            ],
            "usage": usage,
        }


def _handler_for(stub: StubModel) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: the ledger is the record."""

        def _send(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/ledger":
                self._send(200, stub.ledger())
            elif self.path.rstrip("/") in ("/healthz", "/v1/models"):
                self._send(200, {"object": "list", "data": [{"id": "stub", "object": "model"}]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._send(404, {"error": {"message": f"stub serves only chat completions, not {self.path}"}})
                return
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                self._send(400, {"error": {"message": "body is not JSON"}})
                return
            status, payload = stub.complete(body, len(raw))
            if payload is None:
                # Lost connection as the client sees it: no status line at all.
                self.close_connection = True
                with suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)
                return
            self._send(status, payload)

    return Handler


@contextmanager
def running(rules: Rules | None = None, ledger_path: Path | None = None) -> Iterator[StubModel]:
    """An in-process stub on a free loopback port, for the duration of a ``with`` block."""
    stub = StubModel(rules, ledger_path=ledger_path).start()
    try:
        yield stub
    finally:
        stub.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flowkube_devstack.stubmodel", description=__doc__)
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    parser.add_argument("--rules", type=Path, help="JSON rules file (see module docs)")
    parser.add_argument("--ledger", type=Path, help="append every answered call here (JSONL)")
    args = parser.parse_args(argv)
    rules = Rules.load(args.rules) if args.rules else Rules()
    stub = StubModel(rules, port=args.port, host=args.host, ledger_path=args.ledger)
    print(stub.url, flush=True)
    stub.start()
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        stub.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())


def ledger_cost(entry: dict[str, Any]) -> Decimal | None:
    """What the genai-prices table (the version the runner pins) says one served call cost, in USD at
    the time it was served: cached prompt tokens at the model's cache-read price; None for a model the
    table does not know. Independent of the runner's pricing code, so tests can hold it to this."""
    from genai_prices import Usage as CallUsage
    from genai_prices import calc_price

    u = entry["usage"]
    call = CallUsage(input_tokens=u["prompt_tokens"], output_tokens=u["completion_tokens"],
                     cache_read_tokens=u["prompt_tokens_details"]["cached_tokens"])
    try:
        return calc_price(call, entry["model"], provider_id="litellm",
                          genai_request_timestamp=datetime.fromtimestamp(entry["time"], UTC)).total_price
    except LookupError:
        return None


def ledger_usage(entries: list[dict[str, Any]]) -> Usage:
    """What the stub says it served, in status.usage terms (crewAI's total = prompt + completion),
    each call priced by ``ledger_cost`` (or its tokens unpriced)."""
    total = Usage()
    for entry in entries:
        u = entry["usage"]
        cost = ledger_cost(entry)
        one = {
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens": u["prompt_tokens"],
            "completion_tokens": u["completion_tokens"],
            "cached_prompt_tokens": u["prompt_tokens_details"]["cached_tokens"],
            "reasoning_tokens": u["completion_tokens_details"]["reasoning_tokens"],
            "successful_requests": 1,
            "cost": cost or Decimal(0),
            "unpriced_tokens": 0 if cost is not None else u["prompt_tokens"] + u["completion_tokens"],
        }
        total = total + Usage(**one, by_model={entry["model"]: Usage(**one).totals()})
    return total
