"""``flowkube-runner validate-server``: crewAI's verdict on inline flow definitions, over HTTP.

The operator's admission webhook asks this server (the runner image, as a sidecar or its own
Deployment) whether ``spec.definition`` is a valid crewAI flow, so that the operator itself never
imports crewAI. ``POST /`` (or ``/validate``) takes the definition as JSON and answers::

    {"valid": false,
     "errors": [{"loc": ["methods", "review", "human_feedback", "default_outcome"],
                 "msg": "default_outcome must be one of human_feedback.emit"}],
     "message": "1 problem: methods.review.human_feedback.default_outcome: default_outcome must be ..."}

``loc`` is a path into the posted definition. A verdict is always HTTP 200; 4xx means the request
itself was unusable (not JSON, too large), which the webhook treats like an unreachable validator.
``GET /healthz`` answers 200 once crewAI is loaded.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine.definitions import DefinitionProblem

log = logging.getLogger("flowkube_runner.validate")

MAX_BODY = 4 * 1024 * 1024  # well above what etcd stores in one object (1.5 MiB by default)
MAX_ERRORS = 20  # an admission message is read by a person


def verdict(problems: list[DefinitionProblem]) -> dict[str, Any]:
    if not problems:
        return {"valid": True, "errors": [], "message": "the definition is valid"}
    shown = problems[:MAX_ERRORS]
    more = f" (and {len(problems) - len(shown)} more)" if len(problems) > len(shown) else ""
    count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}"
    return {
        "valid": False,
        "errors": [{"loc": list(p.loc), "msg": p.msg} for p in shown],
        "message": f"{count}: " + "; ".join(p.render() for p in shown) + more,
    }


def validate(definition: Any) -> dict[str, Any]:
    from .engine.definitions import check_definition

    _, problems = check_definition(definition)
    return verdict(problems)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "flowkube-validator"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refuse(self, status: int, message: str) -> None:
        self._send(status, {"valid": False, "errors": [{"loc": [], "msg": message}], "message": message})

    def do_GET(self) -> None:
        if self.path.rstrip("/") in ("/healthz", "/readyz"):
            self._send(200, {"status": "ok"})
        else:
            self._send(404, {"message": f"no route {self.path}; POST a flow definition to /"})

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] not in ("/", "/validate"):
            self._send(404, {"message": f"no route {self.path}; POST a flow definition to /"})
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length <= 0:
            self.close_connection = True
            self._refuse(400, "empty request body: POST the flow definition as JSON")
            return
        if length > MAX_BODY:
            self.close_connection = True  # the body stays unread
            self._refuse(413, f"request body of {length} bytes is over the {MAX_BODY}-byte limit")
            return
        try:
            definition = json.loads(self.rfile.read(length))
        except ValueError as e:
            self._refuse(400, f"request body is not JSON: {e}")
            return
        try:
            answer = validate(definition)
        except Exception:
            log.exception("validating a definition failed")
            self._refuse(500, "the validator failed on this definition; see its log")
            return
        self._send(200, answer)


def make_server(host: str, port: int) -> ThreadingHTTPServer:
    from .engine import definitions  # crewAI loads here, before the port opens: listening means ready

    del definitions
    server = ThreadingHTTPServer((host, port), _Handler)
    server.daemon_threads = True
    return server


def serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="flowkube-runner validate-server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")  # noqa: S104
    parser.add_argument("--port", type=int, default=8081, help="port (default: 8081; 0 picks a free one)")
    args = parser.parse_args(argv)
    server = make_server(args.host, args.port)
    host, port = server.server_address[:2]
    log.info("validating flow definitions on http://%s:%s/", host, port)

    def stop(_signum: int, _frame: FrameType | None) -> None:
        # shutdown() waits for serve_forever to return, so it cannot run on serve_forever's thread.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0
