"""`./dev demo`: what a new user sees in their first five minutes, on the running local stack.

Applies examples/flows/inline-feedback.yaml, shows it pause for feedback, answers with the raw
`kubectl patch`, and shows it finish with its usage, the matching /metrics lines and its one trace.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from flowkube_devstack.jaeger import Span, read_spans, waterfall

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "flows" / "inline-feedback.yaml"
NAMESPACE = "demo"
FLOW = "release-notes"
PATCH = '{"status":{"feedback":{"response":{"text":"approved"}}}}'


class Demo:
    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info
        self.kubectl_bin = info["bins"]["kubectl"]
        self.kubeconfig = info["kubeconfig"]
        self.metrics_url = info["metrics"]
        self.metrics_token = Path(info["metrics_token_file"]).read_text().strip()

    def kubectl(self, *args: str, show: bool = True, check: bool = True, stdin: str | None = None) -> str:
        if show:
            print(f"\n$ kubectl {' '.join(shlex.quote(a) for a in args)}", flush=True)
        out = subprocess.run([self.kubectl_bin, "--kubeconfig", self.kubeconfig, *args],
                             capture_output=True, text=True, input=stdin, timeout=120)
        if show:
            sys.stdout.write(out.stdout + out.stderr)
        if check and out.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {out.stderr}")
        return out.stdout

    def status(self) -> dict[str, Any]:
        raw = self.kubectl("get", "flow", FLOW, "-n", NAMESPACE, "-o", "json", show=False)
        st: dict[str, Any] = json.loads(raw).get("status") or {}
        return st

    def wait_phase(self, phase: str, timeout: float = 300) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if st.get("phase") == phase:
                return st
            if st.get("phase") == "Failed" or time.monotonic() > deadline:
                raise RuntimeError(f"{FLOW} is {st.get('phase')} ({st.get('message')}), expected {phase}")
            time.sleep(0.5)

    def run(self) -> int:
        print(f"\n== A Flow with a human-feedback step ({EXAMPLE.relative_to(REPO)})")
        if self.kubectl("get", "namespace", NAMESPACE, show=False, check=False) == "":
            self.kubectl("create", "namespace", NAMESPACE)
        # A rerun replaces the Flow under the same name. Deleted in the background, its pods are
        # left to the garbage collector, which can miss that deletion for good: its informer
        # relists (after a watch break, e.g. the operator's chart updating the CRD right after a
        # restart) and sees only an update of demo/release-notes to the new uid. The new Flow then
        # waits forever for the old pods. In the foreground, the old Flow is not gone until the GC
        # has removed its pods and state ConfigMap; anything left by an earlier, missed deletion
        # (every object with this label now belongs to a deleted Flow) is deleted here.
        self.kubectl("delete", "flow", FLOW, "-n", NAMESPACE, "--ignore-not-found", "--cascade=foreground",
                     "--wait=true", "--timeout=100s", show=False)
        self.kubectl("delete", "pods,configmaps", "-n", NAMESPACE, "-l", f"flowkube.io/flow={FLOW}",
                     "--ignore-not-found", "--wait=true", "--timeout=100s", show=False)
        # The example reads its model key from this Secret; the local stack's model is a stub.
        secret = self.kubectl("create", "secret", "generic", "openai-api", "-n", NAMESPACE,
                              "--from-literal=OPENAI_API_KEY=stub-key", "--dry-run=client", "-o", "yaml",
                              show=False)
        self.kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=secret, show=False)
        self.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLE))

        st = self.wait_phase("AwaitingFeedback")
        self.kubectl("get", "flows", "-n", NAMESPACE)
        req = st["feedback"]["request"]
        print(f"\nThe flow paused in `{req['method']}` and asks: {req['message']!r}")
        print(f"allowed outcomes: {req.get('emit')}; the draft it wants approved: {req.get('output', '')[:200]!r}")
        print("No runner pod runs while it waits:")
        self.kubectl("get", "pods", "-n", NAMESPACE, "-l", f"flowkube.io/flow={FLOW}")

        print("\n== Answer it by patching the Flow's status (the feedback inbox)")
        self.kubectl("patch", "flow", FLOW, "-n", NAMESPACE, "--subresource=status", "--type=merge", "-p", PATCH)
        st = self.wait_phase("Succeeded")
        self.kubectl("get", "flows", "-n", NAMESPACE)
        print("\nRuns, feedback history and usage (summed over every run, each once):")
        print(json.dumps({k: st.get(k) for k in ("runs", "usage")} | {"feedback": st.get("feedback")}, indent=2))

        print(f"\n== The same numbers on the operator's /metrics ({self.metrics_url})")
        request = urllib.request.Request(self.metrics_url, headers={"Authorization": f"Bearer {self.metrics_token}"})
        with urllib.request.urlopen(request, timeout=10) as r:
            lines = [ln for ln in r.read().decode().splitlines() if f'flow="{FLOW}"' in ln
                     and (ln.startswith("flowkube_flow_tokens_total") or ln.startswith("flowkube_flow_runs_total")
                          or ln.startswith("flowkube_flow_llm_requests_total"))]
        print("\n".join(lines))
        self.show_trace(st)
        print("\nThe stack keeps running: `./dev status` shows how to point kubectl at it; `./dev down` stops it.")
        return 0


    def show_trace(self, st: dict[str, Any]) -> None:
        """The Flow's one trace, read back from the local Jaeger's query API (it has no web UI here)."""
        query, trace_id = self.info.get("jaeger"), (st.get("trace") or {}).get("traceId")
        if not query or not trace_id:
            return
        url = f"{query}/api/traces/{trace_id}"
        print(f"\n== The Flow's one trace (status.trace.traceId {trace_id}), from Jaeger: {url}")
        spans: list[Span] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the operator sends its spans within a second of its write
            spans = read_spans(query, trace_id)
            if any(not s.parent_id for s in spans):
                break
            time.sleep(0.5)
        print(waterfall(spans))


def demo(info: dict[str, Any]) -> int:
    try:
        return Demo(info).run()
    except RuntimeError as e:
        print(f"flowkube: demo failed: {e}", file=sys.stderr)
        return 1
