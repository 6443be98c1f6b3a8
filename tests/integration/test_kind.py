"""The kind quickstart, run for real: hack/kind-e2e.sh with whichever engine this machine has (podman here:
kind's podman provider, the node image assembled locally, the project's images from the local build).

It is the one test of the quickstart, so it runs the script exactly as a user does and checks what a
user sees: it passes, and it leaves no cluster behind. Its budget holds a cold node image (about 1.5
minutes) and cold builds of kind and kubeadm; with warm caches the script takes about 2 minutes.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import pytest

from flowkube_devstack import kind
from flowkube_devstack.cluster import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT_BUDGET = 1080  # seconds: the script's own deadline, inside the test's
PROVIDER = kind.choose_provider(os.environ, kind.engine_works)


def _clusters(env: dict[str, str]) -> list[str]:
    out = subprocess.run([str(kind.kind_binary()), "get", "clusters"], capture_output=True, text=True, env=env,
                         check=True)
    return out.stdout.split()


def failure_report(text: str, budget: int = 6000) -> str:
    """What a failed run says, in the order a reader needs it: the script's FAILED line (its step,
    and the command or the reason), the failing step's own output, then the diagnostics, cut to fit."""
    lines = text.splitlines()
    failed = [line for line in lines if line.startswith("kind-e2e: FAILED")]
    end = next((i for i, line in enumerate(lines) if line.startswith("=== failed")), len(lines))
    start = max((i for i, line in enumerate(lines[:end]) if line.startswith("=== ")), default=0)
    step = "\n".join(lines[start:end])[-budget // 2:]
    rest = "\n".join(line for line in lines[end:] if not line.startswith("kind-e2e: FAILED"))
    head = "\n".join([*(failed or ["kind-e2e: the script did not say what failed"]), "--- the failing step", step])
    return f"{head}\n--- after it\n{rest[:max(0, budget - len(head))]}"


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_BUDGET + 120)
@pytest.mark.skipif(PROVIDER is None, reason="neither a Docker daemon nor podman answers")
def test_kind_e2e_script_passes_and_leaves_no_cluster(tmp_path: Path) -> None:
    assert PROVIDER is not None
    name = f"flowkube-e2e-{secrets.token_hex(3)}"
    env = {**kind.engine_env(PROVIDER), "CLUSTER": name, "KIND_KUBECONFIG": str(tmp_path / "kubeconfig"),
           "METRICS_PORT": str(free_port()), "KIND_EXPERIMENTAL_PROVIDER": PROVIDER}
    env.pop("OPENAI_API_KEY", None)  # the stub model answers: no key, no cost, the same answers every run
    env.pop("KEEP_CLUSTER", None)
    log = tmp_path / "kind-e2e.log"
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen([str(REPO / "hack" / "kind-e2e.sh")], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=SCRIPT_BUDGET)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the script's trap deletes the cluster
            rc = proc.wait(timeout=60)
    elapsed = time.monotonic() - started
    text = log.read_text()
    left = _clusters(env)
    if name in left:  # only when the script could not clean up: never leave it behind, but say so
        subprocess.run([str(kind.kind_binary()), "delete", "cluster", "--name", name], env=env, capture_output=True)
    print(f"hack/kind-e2e.sh ({PROVIDER}): exit {rc} in {elapsed:.0f} s")
    print("\n".join(line for line in text.splitlines() if line.startswith("kind-e2e: ")))
    assert rc == 0 and "kind-e2e: passed" in text, failure_report(text)
    assert name not in left, f"the script left cluster {name} behind"
