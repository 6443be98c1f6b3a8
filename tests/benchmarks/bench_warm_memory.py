"""Benchmark: one warm runner process answering a long session. Prints figures.

    .venv/bin/python -m tests.benchmarks.bench_warm_memory [--messages 1000] [--chars 500]

``python -m flowkube_runner`` (the runner a pod runs) opens a conversation with the integration
tests' SUPPORT definition and stays warm; ``--messages`` messages of ``--chars`` characters are
handed to it one after another (through the file store's stand-in for the operator's long poll),
each answered by the stub model with a reply as long. Along the way: the process's resident memory
(/proc), the transcript's size in the saved state (JSON, and gzip as stored), and each turn's time
from message written to warm report. The question it answers: does a warm pod's memory grow with
the session beyond the transcript itself?

No operator here: the state API and the status are measured by ``bench_conversation``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flowkube_api import constants as c
from flowkube_api.report import RunReport
from flowkube_devstack.cluster import wait_for
from flowkube_devstack.stubmodel import Rules, StubModel, ledger_usage
from flowkube_runner.store import FileStore, decode_json
from tests.integration.realrunner import MODEL
from tests.unit.runner.test_runner_flows import Harness

SUPPORT = {
    "schema": "crewai.flow/v1",
    "name": "Support",
    "conversational": {"llm": MODEL, "system_prompt": "You are a support agent."},
}


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--chars", type=int, default=500)
    args = parser.parse_args()
    body = ("lorem ipsum dolor sit amet " * (args.chars // 27 + 1))[: args.chars]
    with tempfile.TemporaryDirectory(prefix="flowkube-bench-warm-") as tmp, \
            StubModel(Rules.from_json({"default": body[: args.chars]})) as stub:
        harness = Harness(Path(tmp), stub, flow="warm")
        store: FileStore = harness.store
        pod, proc = harness.spawn(c.Trigger.KICKOFF, {"definition": SUPPORT},
                                  extra_env={c.ENV_KEEP_WARM_SECONDS: "600"})
        key = c.report_key(pod)

        def warm_at(turn: int) -> bool:
            data = store.get(key)
            if proc.poll() is not None:
                raise RuntimeError(f"the runner ended: {harness.stderr(pod)[-2000:]}")
            if not data:
                return False
            report = RunReport.decode(data)
            return report.warm and report.conversation is not None and report.conversation.turn == turn

        try:
            wait_for(lambda: warm_at(0), 180, "the session to open", interval=0.01)
            rows = [(0, rss(proc.pid), 0, 0)]
            seconds = []
            for i in range(1, args.messages + 1):
                path = harness.state_dir / f"message.{i}.json"
                tmp_path = path.with_suffix(".tmp")
                tmp_path.write_text(json.dumps({"turn": i, "text": f"[{i}] {body}"[: args.chars]}))
                started = time.perf_counter()
                tmp_path.replace(path)
                wait_for(lambda turn=i: warm_at(turn), 120, f"message {i}", interval=0.005)  # type: ignore[misc]
                seconds.append(time.perf_counter() - started)
                path.unlink()
                if i in (1, 10) or i % 100 == 0:
                    raw = store.get(c.STATE_KEY) or b""
                    state = decode_json(raw, "state")
                    rows.append((i, rss(proc.pid), len(json.dumps(state["state"]["messages"])), len(raw)))
                    print(f"  {i} messages: RSS {rows[-1][1] / 2**20:.0f} MiB", flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        report = RunReport.decode(store.get(key) or b"")
        usage_ok = report.usage.totals() == ledger_usage(stub.ledger()).totals()
    print(f"\none warm runner process, {args.messages} messages of {args.chars} characters "
          f"(replies as long), python {sys.version.split()[0]}")
    print("messages | RSS MiB | RSS growth since 10 msgs MiB | transcript JSON KiB | state gzip KiB")
    base = next(r for r in rows if r[0] == 10)[1] if any(r[0] == 10 for r in rows) else rows[0][1]
    for n, mem, transcript, stored in rows:
        print(f"{n:8d} | {mem / 2**20:7.0f} | {(mem - base) / 2**20:28.1f} | {transcript / 1024:19.0f} | "
              f"{stored / 1024:14.0f}")
    first, last = rows[1], rows[-1]
    grew, text = last[1] - first[1], last[2] - first[2]
    print(f"RSS grew {grew / 2**20:.1f} MiB from message {first[0]} to {last[0]}, while the transcript grew "
          f"{text / 2**20:.2f} MiB of JSON: {grew / text:.1f} bytes of memory per byte of transcript")
    ms = sorted(s * 1000 for s in seconds)
    print(f"message written -> warm report: p50 {statistics.median(ms):.0f} ms, "
          f"p99 {ms[max(0, round(0.99 * len(ms)) - 1)]:.0f} ms, "
          f"first 10 p50 {statistics.median(seconds[:10]) * 1000:.0f} ms, "
          f"last 100 p50 {statistics.median([s * 1000 for s in seconds[-100:]]):.0f} ms")
    calls = len(stub.ledger())
    print(f"usage in the last report equals the stub ledger ({calls} calls): {'yes' if usage_ok else 'NO'}")
    if not usage_ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
