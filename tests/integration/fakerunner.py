"""A scripted runner for operator lifecycle tests only (not shipped, not crewAI).

It behaves as the Flow's `spec.inputs.plan[run index]` says — sleep (with an interim report every
`interim` seconds, one more token each, as after each LLM call), exit code, result, tokens (of `model`,
`stub-model` unless given), cost (a decimal string) and unpriced tokens,
feedback request — and reports exactly like the real runner: a gzip RunReport in the Flow's state,
written through the operator's state API with the pod's bound token (the runner's own client).
The real runner is exercised end to end by the runner and feedback tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import zlib
from decimal import Decimal
from pathlib import Path
from typing import Any

from flowkube_api import constants as c
from flowkube_api.report import FeedbackRequest, RunReport, TokenUsage, Usage
from flowkube_runner.store import StateApiStore, StateTooLarge, StoreError


def _stop(*_: object) -> None:
    sys.exit(143)


def _abuse(store: StateApiStore, pod: str, step: dict[str, Any]) -> None:
    """What an abusive runner (its own image, or a script step) sends before its real report."""
    if step.get("bomb"):
        # An abusive runner (its own image, or a script step): a gzip bomb under the value limit as
        # its report, `bomb` MiB of zeros. The state API's answer goes to the log for the test.
        out = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        zeros = bytes(1 << 20)
        bomb = b"".join([*(out.compress(zeros) for _ in range(int(step["bomb"]))), out.flush()])
        try:
            store.put(c.report_key(pod), bomb)
            print("bomb: stored", flush=True)
        except (StoreError, StateTooLarge) as e:
            print(f"bomb: refused: {type(e).__name__}: {e}", flush=True)
    if step.get("raw_report"):
        # A runner that sends what it likes as its report (its own image): the state API's answer
        # goes to the log for the test, and the run goes on to its real report.
        raw = {"pod": pod, "trigger": os.environ[c.ENV_TRIGGER], "result": "Failed", "reason": "FlowError",
               "exitCode": 1, **step["raw_report"]}
        try:
            store.put(c.report_key(pod), zlib.compress(json.dumps(raw).encode(), wbits=16 + zlib.MAX_WBITS))
            print("raw: stored", flush=True)
        except (StoreError, StateTooLarge) as e:
            print(f"raw: refused: {type(e).__name__}: {e}", flush=True)


def main() -> int:
    # As the real runner, it stops on SIGTERM. It is its container's PID 1, which ignores a signal it
    # has no handler for: a deleted pod would have waited out its whole 30 s grace period.
    signal.signal(signal.SIGTERM, _stop)
    pod = os.environ[c.ENV_POD_NAME]
    index = int(pod.rsplit("-", 1)[1])
    spec = json.loads(os.environ[c.ENV_SPEC])
    plan = (spec.get("inputs") or {}).get("plan") or [{}]
    step = plan[min(index, len(plan) - 1)]
    if step.get("touch"):
        Path(step["touch"]).write_text(pod)
    store = StateApiStore.from_environment()
    tokens = int(step.get("tokens", 0))
    _abuse(store, pod, step)
    if step.get("interim"):
        # As the real runner after each LLM call: the usage so far, as an interrupted run's report.
        deadline = time.monotonic() + float(step.get("sleep", 0))
        at_term: int | None = None
        if step.get("finish_on_term"):
            # Stopped mid-call, a runner still completes (and reports) what is in flight, then exits.
            def finish(*_: object) -> None:
                nonlocal deadline, at_term
                at_term = tokens
                deadline = min(deadline, time.monotonic() + float(step["finish_on_term"]))

            signal.signal(signal.SIGTERM, finish)
        while time.monotonic() < deadline:
            time.sleep(float(step["interim"]))
            tokens += 1
            t = TokenUsage(prompt_tokens=tokens, total_tokens=tokens, successful_requests=tokens)
            store.put(c.report_key(pod), RunReport(
                pod=pod, flow=os.environ[c.ENV_FLOW_NAME], trigger=os.environ[c.ENV_TRIGGER], result="Failed",
                reason=c.Reason.RUN_INTERRUPTED, message="interrupted", exit_code=c.EXIT_RETRYABLE,
                usage=Usage(**t.model_dump(), by_model={"stub-model": t})).encode())
        if at_term is not None:
            # What the model "charged" in all, and before the stop, for the test (the termination
            # message outlives the container's log).
            line = f"calls={tokens} at_term={at_term}"
            print(line, flush=True)
            with contextlib.suppress(OSError):
                Path("/dev/termination-log").write_text(line)
            return 143
    elif step.get("sleep"):
        time.sleep(float(step["sleep"]))
    t = TokenUsage(prompt_tokens=tokens, total_tokens=tokens, successful_requests=1 if tokens else 0,
                   cost=Decimal(step.get("cost", "0")), unpriced_tokens=int(step.get("unpriced", 0)))
    result = step.get("result", "Succeeded")
    exit_code = int(step.get("exit", 0 if result != "Failed" else c.EXIT_RETRYABLE))
    fr = FeedbackRequest(**step["feedback"]) if result == "Paused" else None
    report = RunReport(
        pod=pod, flow=os.environ[c.ENV_FLOW_NAME], trigger=os.environ[c.ENV_TRIGGER], result=result,
        reason=step.get("reason", {"Succeeded": "RunSucceeded", "Paused": "RunPaused"}.get(result, "FlowError")),
        message=step.get("message", f"fake {result}; feedback={os.environ.get(c.ENV_FEEDBACK, '')}"),
        exit_code=exit_code,
        usage=Usage(**t.model_dump(), by_model={step.get("model", "stub-model"): t} if tokens else {}),
        output=step.get("output"), feedback_request=fr,
    )
    if not step.get("no_report"):
        store.put(c.report_key(pod), report.encode())
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
