"""A scripted stand-in for the runner, for operator lifecycle tests only (not shipped, not crewAI).

It behaves as the Flow's `spec.inputs.plan[run index]` says — sleep, exit code, result, tokens,
feedback request — and reports exactly like the real runner: a gzip RunReport in the Flow's state,
written through the operator's state API with the pod's bound token (the runner's own client).
The real runner is exercised end to end by the runner and feedback tests.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from flowkube_api import constants as c
from flowkube_api.report import FeedbackRequest, RunReport, TokenUsage, Usage
from flowkube_runner.store import StateApiStore


def main() -> int:
    pod = os.environ[c.ENV_POD_NAME]
    index = int(pod.rsplit("-", 1)[1])
    spec = json.loads(os.environ[c.ENV_SPEC])
    plan = (spec.get("inputs") or {}).get("plan") or [{}]
    step = plan[min(index, len(plan) - 1)]
    if step.get("touch"):
        Path(step["touch"]).write_text(pod)
    if step.get("sleep"):
        time.sleep(float(step["sleep"]))
    tokens = int(step.get("tokens", 0))
    t = TokenUsage(prompt_tokens=tokens, total_tokens=tokens, successful_requests=1 if tokens else 0)
    result = step.get("result", "Succeeded")
    exit_code = int(step.get("exit", 0 if result != "Failed" else c.EXIT_RETRYABLE))
    fr = FeedbackRequest(**step["feedback"]) if result == "Paused" else None
    report = RunReport(
        pod=pod, flow=os.environ[c.ENV_FLOW_NAME], trigger=os.environ[c.ENV_TRIGGER], result=result,
        reason=step.get("reason", {"Succeeded": "RunSucceeded", "Paused": "RunPaused"}.get(result, "FlowError")),
        message=step.get("message", f"fake {result}; feedback={os.environ.get(c.ENV_FEEDBACK, '')}"),
        exit_code=exit_code, usage=Usage(**t.model_dump(), by_model={"stub-model": t} if tokens else {}),
        output=step.get("output"), feedback_request=fr,
    )
    if not step.get("no_report"):
        StateApiStore.from_environment().put(c.report_key(pod), report.encode())
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
