"""What a runner does before its first model call: nothing that serves no one in a pod.

Each check runs in a fresh process, as a pod would: celpy's parser and crewAI's settings are
process-wide.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowkube_api import constants as c
from flowkube_devstack.stubmodel import Rules, StubModel
from flowkube_runner.engine.celcache import CACHE_ENV

from .test_runner_flows import RULES, WRITER, Harness, succeeded

pytestmark = pytest.mark.slow

TEMPLATED = {
    "schema": "crewai.flow/v1",
    "name": "Templated",
    "methods": {
        "draft": {"start": True, "do": {"call": "agent", "with": {**WRITER, "input": "Draft ${state.topic}"}}},
        "check": {"listen": "draft", "do": {"call": "expression", "expr": "outputs.draft.raw != '' && true"}},
    },
}
BROKEN = {**TEMPLATED, "methods": {"draft": {"start": True, "do": {"call": "agent", "with": {
    **WRITER, "input": "Draft ${state.topic"}}}}}

CHECK = """
import json, logging, sys
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record.getMessage())
import lark  # it sets its logger's level when imported
lark_log = logging.getLogger("lark")
lark_log.setLevel(logging.DEBUG)
lark_log.addHandler(Keep())
from flowkube_runner.engine.definitions import check_definition
verdicts = []
for raw in json.loads(sys.argv[1]):
    definition, problems = check_definition(raw)
    verdicts.append([definition is not None, [p.render() for p in problems]])
print(json.dumps({"verdicts": verdicts, "from_cache": any("from cache" in r for r in records)}))
"""


def check(definitions: list[object], env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", CHECK, json.dumps(definitions)], capture_output=True, text=True,
                         env=env, timeout=300, check=True)
    result: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_the_cel_parser_cached_at_image_build_gives_crewais_verdicts(tmp_path: Path) -> None:
    cache = tmp_path / "cel-parser.cache"
    subprocess.run([sys.executable, "-m", "flowkube_runner.engine.celcache", str(cache)], check=True, timeout=300)
    assert cache.is_file()
    env = {k: v for k, v in os.environ.items() if k != CACHE_ENV}
    built = check([TEMPLATED, BROKEN], env)
    cached = check([TEMPLATED, BROKEN], {**env, CACHE_ENV: str(cache)})
    assert cached["from_cache"] is True and built["from_cache"] is False
    assert cached["verdicts"] == built["verdicts"]
    assert built["verdicts"][0] == [True, []]  # type: ignore[index]
    assert built["verdicts"][1][0] is False and "unterminated" in str(built["verdicts"][1][1])  # type: ignore[index]


class ProxyLog:
    """A proxy that answers nobody and notes who came: the runner's HTTPS traffic is sent to it."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.seen: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.seen.append(conn.recv(200))
                except OSError:
                    self.seen.append(b"")


@pytest.fixture
def proxy() -> Iterator[ProxyLog]:
    log = ProxyLog()
    log.thread.start()
    try:
        yield log
    finally:
        log.server.close()


def test_a_runner_asks_no_one_but_its_model_before_and_after_the_call(tmp_path: Path, proxy: ProxyLog) -> None:
    """crewAI's version check (pypi.org) and first-run trace are off unless the pod's env turns them
    on: every pod is a first run with a fresh $HOME, and no one reads an upgrade hint in its log."""
    definition = {"name": "One", "methods": {"draft": {"start": True, "do": {
        "call": "agent", "with": {**WRITER, "input": "DRAFT about cats"}}}}}
    with StubModel(Rules.from_json(RULES)) as stub:
        harness = Harness(tmp_path, stub)
        pod = harness.next_pod()
        env = harness.env(pod, c.Trigger.KICKOFF, {"definition": definition},
                          extra_env={"HTTPS_PROXY": f"http://127.0.0.1:{proxy.port}", "NO_PROXY": "127.0.0.1"})
        env.pop("CREWAI_TRACING_ENABLED")  # as in the runner image: crewAI's defaults
        with (tmp_path / f"{pod}.stderr").open("w") as stderr:
            proc = subprocess.Popen([sys.executable, "-m", "flowkube_runner"], env=env, stdout=subprocess.DEVNULL,
                                    stderr=stderr, text=True)
        report = succeeded(harness.finish(pod, proc))
        assert report.usage.successful_requests == len(stub.ledger()) == 1
    assert proxy.seen == []
