"""`kubectl flow`: a kubectl plugin over the same patch and reads a person would type.

    kubectl flow feedback NAME TEXT [--request-id ID] [-n NAMESPACE]
    kubectl flow get NAME [-n NAMESPACE]

It calls `kubectl` itself, so contexts, namespaces and credentials behave exactly as in kubectl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any


def _kubectl(args: list[str], namespace: str | None) -> subprocess.CompletedProcess[str]:
    cmd = [os.environ.get("KUBECTL", "kubectl"), *args]
    if namespace:
        cmd += ["-n", namespace]
    return subprocess.run(cmd, capture_output=True, text=True)


def feedback_patch(text: str, request_id: str | None) -> dict[str, Any]:
    response: dict[str, Any] = {"text": text}
    if request_id:
        response["requestId"] = request_id
    return {"status": {"feedback": {"response": response}}}


def describe(flow: dict[str, Any]) -> str:
    st = flow.get("status") or {}
    name = flow["metadata"]["name"]
    lines = [f"Flow {flow['metadata'].get('namespace', '')}/{name}: {st.get('phase', 'Pending')}"
             f" ({st.get('definition', '')}) - {st.get('message', '')}"]
    req = (st.get("feedback") or {}).get("request")
    if req:
        lines.append(f"\nFeedback requested by {req['method']} (request {req['id']}):")
        lines.append(f"  {req.get('message', '')}")
        if req.get("emit"):
            lines.append(f"  outcomes: {', '.join(req['emit'])}"
                         + (f" (default {req['defaultOutcome']})" if req.get("defaultOutcome") else ""))
        if req.get("deadline"):
            lines.append(f"  deadline: {req['deadline']}")
        if req.get("output"):
            lines.append("  output:\n    " + req["output"].replace("\n", "\n    "))
        lines.append(f'  answer: kubectl flow feedback {name} "<text>" --request-id {req["id"]}')
    runs = st.get("runs") or []
    if runs:
        lines.append("\nRuns:")
        for r in runs:
            tokens = (r.get("usage") or {}).get("totalTokens", 0)
            lines.append(f"  {r['pod']:<30} {r['trigger']:<8} {r.get('result', 'Running'):<10} "
                         f"{tokens:>8} tokens  {r.get('reason', '')}")
    usage = st.get("usage") or {}
    if usage:
        lines.append(f"\nUsage: {usage.get('totalTokens', 0)} tokens ({usage.get('promptTokens', 0)} prompt, "
                     f"{usage.get('completionTokens', 0)} completion), {usage.get('successfulRequests', 0)} requests")
        for model, u in sorted((usage.get("byModel") or {}).items()):
            lines.append(f"  {model}: {u.get('totalTokens', 0)} tokens, {u.get('successfulRequests', 0)} requests")
    for h in (st.get("feedback") or {}).get("history") or []:
        who = f" by {h['respondedBy']}" if h.get("respondedBy") else ""
        what = "timed out" if h.get("timedOut") else repr(h.get("response"))
        lines.append(f"  answered {h['requestId']} ({h['method']}){who}: {what}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubectl flow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--namespace")
    sub = parser.add_subparsers(dest="cmd", required=True)
    fb = sub.add_parser("feedback", help="answer a Flow's pending feedback request")
    fb.add_argument("name")
    fb.add_argument("text")
    fb.add_argument("--request-id", help="refuse unless this is the pending request")
    get = sub.add_parser("get", help="pending request, runs and usage of a Flow")
    get.add_argument("name")
    args = parser.parse_args(argv)

    if args.cmd == "feedback":
        patch = json.dumps(feedback_patch(args.text, args.request_id), separators=(",", ":"))
        out = _kubectl(["patch", "flow", args.name, "--subresource=status", "--type=merge", "-p", patch],
                       args.namespace)
        sys.stdout.write(out.stdout)
        sys.stderr.write(out.stderr)
        return out.returncode
    out = _kubectl(["get", "flow", args.name, "-o", "json"], args.namespace)
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        return out.returncode
    print(describe(json.loads(out.stdout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
