"""A scripted stand-in for the runner, for operator lifecycle tests only (not shipped, not crewAI).

It behaves as the Flow's `spec.inputs.plan[run index]` says — sleep, exit code, result, tokens,
feedback request — and reports exactly like the real runner: a gzip RunReport in the Flow's state
ConfigMap, written with the pod's own service-account token through the standard in-cluster config.
The real runner is exercised end to end by the runner and feedback tests.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from flowkube_api import constants as c
from flowkube_api.report import FeedbackRequest, RunReport, TokenUsage, Usage

SA = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def api(method: str, path: str, body: object, content_type: str = "application/merge-patch+json") -> None:
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    ctx = ssl.create_default_context(cafile=str(SA / "ca.crt"))
    req = urllib.request.Request(
        f"https://{host}:{port}{path}", data=json.dumps(body).encode(), method=method,
        headers={"Authorization": f"Bearer {(SA / 'token').read_text()}", "Content-Type": content_type})
    # Ride out an API server restart and RBAC that is not in force yet, as the real runner does.
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=10):
                return
        except urllib.error.HTTPError as e:
            if (e.code < 500 and e.code not in (401, 403, 429)) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main() -> int:
    pod = os.environ[c.ENV_POD_NAME]
    ns = os.environ[c.ENV_NAMESPACE]
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
        key = c.report_key(pod)
        data = base64.b64encode(report.encode()).decode()
        api("PATCH", f"/api/v1/namespaces/{ns}/configmaps/{os.environ[c.ENV_STATE_CONFIGMAP]}",
            {"binaryData": {key: data}})
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
