"""`flowkube-dev`: the local stack and the project's checks.

    flowkube-dev demo      start the local stack and run the inline sample flow end to end
    flowkube-dev up        start the local stack in the background and print how to use it
    flowkube-dev down      stop it
    flowkube-dev status    is it running, and where
    flowkube-dev test      the whole test suite (lint, types, import contracts, unit + integration)
    flowkube-dev build     build (or verify) the control-plane binaries and the images
    flowkube-dev kind ...  hack/kind-e2e.sh's helpers (python -m flowkube_devstack.kind --help)
    flowkube-dev generate  rewrite every generated file (CRD, chart, dashboard, docs/configuration.md);
                           --check lists stale ones and fails
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from flowkube_devstack import build, generate, images, imageseed, kind, procs
from flowkube_devstack.demo import demo
from flowkube_devstack.stack import dev_stack

REPO = Path(__file__).resolve().parents[2]


def stack_dir() -> Path:
    return Path(os.environ.get("FLOWKUBE_DEV_DIR") or build.cache_root() / "dev-stack")


def _supervise(root: Path) -> int:
    """Runs in the background: holds the stack's processes and stops them all on SIGTERM."""
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    try:
        with dev_stack(root) as info:
            (root / "ready.json").write_text(json.dumps(info, indent=2))
            while not stop:
                time.sleep(0.5)
    except Exception as e:
        (root / "failed").write_text(f"{type(e).__name__}: {e}")
        return 1
    finally:
        (root / "ready.json").unlink(missing_ok=True)
    return 0


def _supervisor_pid(root: Path) -> int | None:
    f = root / "supervisor.pid"
    try:
        pid = int(f.read_text())
    except (OSError, ValueError):
        return None
    return pid if procs.alive(pid) else None


def up(root: Path, timeout: float = 600.0) -> int:
    if (pid := _supervisor_pid(root)) is not None and (root / "ready.json").exists():
        print(f"flowkube: the local stack is already running (pid {pid})", file=sys.stderr)
        _print_usage(root)
        return 0
    # Build in the foreground, so the user sees progress and errors.
    build_everything()
    root.mkdir(parents=True, exist_ok=True)
    for f in ("ready.json", "failed"):
        (root / f).unlink(missing_ok=True)
    log = (root / "supervisor.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowkube_devstack", "_supervise", "--dir", str(root)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    (root / "supervisor.pid").write_text(str(proc.pid))
    deadline = time.monotonic() + timeout
    while not (root / "ready.json").exists():
        if proc.poll() is not None or (root / "failed").exists():
            reason = (root / "failed").read_text() if (root / "failed").exists() else ""
            print(f"flowkube: the local stack failed to start: {reason}\n"
                  f"logs: {root / 'supervisor.log'}, {root / 'cluster' / 'logs'}", file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            print("flowkube: the local stack did not become ready in time", file=sys.stderr)
            down(root)
            return 1
        time.sleep(0.2)
    _print_usage(root)
    return 0


def _print_usage(root: Path) -> None:
    info = json.loads((root / "ready.json").read_text())
    print(f"The local stack is up: kube-apiserver {info['server']} (Kubernetes built from source),\n"
          f"a real node (kubelet, containerd, kube-proxy, CoreDNS), the operator installed by its Helm chart\n"
          f"(metrics: {info['metrics']}, with the bearer token in {info['metrics_token_file']}),\n"
          f"the stub model {info['stub']}.\n"
          f"The web console: {info.get('console', '-')} (sign in with a token: kubectl create token NAME).\n"
          f"Point kubectl at it:\n\n"
          f"  export KUBECONFIG={info['kubeconfig']}\n"
          f"  export PATH={Path(info['bins']['kubectl']).parent}:$PATH\n\n"
          f"Stop it with: ./dev down")


def down(root: Path) -> int:
    pid = _supervisor_pid(root)
    if pid is None:
        stale = procs.kill_stale(root / "cluster")
        leftovers = f" (stopped leftovers: {', '.join(stale)})" if stale else ""
        print(f"flowkube: the local stack is not running{leftovers}")
        return 0
    procs.terminate(pid, grace=30.0)
    (root / "supervisor.pid").unlink(missing_ok=True)
    print("flowkube: the local stack is stopped")
    return 0


def status(root: Path) -> int:
    pid = _supervisor_pid(root)
    if pid is None or not (root / "ready.json").exists():
        print("flowkube: the local stack is not running")
        return 1
    _print_usage(root)
    return 0


def build_everything() -> None:
    """The Go builds (they keep both cores busy) and the images (mostly downloads and file copies),
    then their containerd seed (``imageseed``), side by side: on a cold machine the images are ready
    when the Go builds end (3.5 of about 18 minutes saved). Each keeps its own locks and caches."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        built = pool.submit(lambda: imageseed.prepare(images.ensure_all().all()))
        build.control_plane(node=True)
        build.ensure(build.helm())
        build.ensure(build.jaeger())  # the trace backend the tracing tests read back from
        built.result()


def run_tests(pytest_args: list[str]) -> int:
    """Static checks first (seconds), then unit and integration tests in one pytest run."""
    py = sys.executable
    steps = [
        ["ruff", [py, "-m", "ruff", "check", "."]],
        ["mypy", [py, "-m", "mypy"]],
        ["import contracts", [str(Path(py).parent / "lint-imports")]],
        ["generated files", [py, "-m", "flowkube_devstack.generate", "--check"]],
    ]
    for name, cmd in steps:
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        if subprocess.run(cmd, cwd=REPO).returncode != 0:
            print(f"flowkube: {name} failed", file=sys.stderr)
            return 1
    # Built (or verified) before pytest, so a cold build is not charged to one test's timeout.
    if "not controlplane" not in " ".join(pytest_args):
        print("== cluster binaries and images (built from source on first use, then cached)", flush=True)
        build_everything()
        # tests/integration/test_kind.py's kind and node image; it skips where no container engine answers.
        if kind.engine_works("podman") or kind.engine_works("docker"):
            kind.kind_binary()
            kind.node_image()
    print("== pytest", flush=True)
    rc = subprocess.run([py, "-m", "pytest", *pytest_args], cwd=REPO).returncode
    if rc == 5:
        print("flowkube: pytest collected no tests", file=sys.stderr)
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowkube-dev", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("demo", "up", "down", "status", "build"):
        sub.add_parser(name)
    g = sub.add_parser("generate")
    g.add_argument("--check", action="store_true")
    t = sub.add_parser("test")
    t.add_argument("pytest_args", nargs=argparse.REMAINDER)
    k = sub.add_parser("kind")
    k.add_argument("kind_args", nargs=argparse.REMAINDER)
    s = sub.add_parser("_supervise")
    s.add_argument("--dir", type=Path, required=True)
    args, extra = parser.parse_known_args(argv)
    if extra and args.cmd not in ("test", "kind"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd == "test":
        args.pytest_args = [*extra, *args.pytest_args]
    if args.cmd == "kind":
        args.kind_args = [*extra, *args.kind_args]
    root = stack_dir()
    commands: dict[str, Callable[[], int]] = {
        "up": lambda: up(root),
        "demo": lambda: up(root) or demo(json.loads((root / "ready.json").read_text())),
        "down": lambda: down(root),
        "status": lambda: status(root),
        "build": lambda: build.main([]) or images.main([]),
        "generate": lambda: generate.main(["--check"] if args.check else []),
        "test": lambda: run_tests(args.pytest_args),
        "kind": lambda: kind.main(args.kind_args),
        "_supervise": lambda: _supervise(args.dir),
    }
    try:
        return commands[args.cmd]()
    except build.BuildError as e:
        print(f"flowkube: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
