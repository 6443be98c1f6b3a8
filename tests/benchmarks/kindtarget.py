"""`bench_apply --kind NAME`: the same bursts on a throwaway kind cluster, the operator as the chart
runs it (a pod, two replicas, webhooks on), kube-controller-manager as kubeadm runs it.

Only a cluster made by `KEEP_CLUSTER=1 CLUSTER=NAME hack/kind-e2e.sh` is accepted: its kubeconfig is
the one that script keeps under the user's cache directory, with the context `kind-NAME`. The benchmark
cordons the cluster's node (the bench's pods go to a stand-in Node, as on the local stack, and never
run), creates and deletes hundreds of objects and restarts kube-controller-manager with other flags:
delete the cluster afterwards (`kind delete cluster --name NAME`).

The processes are found in this host's /proc by the node container's cgroup (the engine runs them on
this kernel), so CPU is read the same way as on the local stack. The operator's figure is its leader's
(the replica holding the Lease); the follower's own CPU is printed beside it.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from flowkube_devstack import kind
from tests.benchmarks import jobpeer

NAMESPACE = "flowkube-system"  # hack/kind-e2e.sh's
PROCESSES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd")
MANIFEST = "/etc/kubernetes/manifests/kube-controller-manager.yaml"


def kubeconfig_path(name: str) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "flowkube" / "kind" / f"{name}.kubeconfig"


class NotThrowaway(SystemExit):
    pass


@dataclass
class KindTarget:
    name: str
    engine: str
    server: str
    ctx: ssl.SSLContext
    container: str  # the node container's full id

    @property
    def node(self) -> str:
        return f"{self.name}-control-plane"

    @classmethod
    def open(cls, name: str, tmp: Path) -> KindTarget:
        path = kubeconfig_path(name)
        refuse = (f"bench_apply --kind {name}: refused: it creates and deletes hundreds of objects, so it runs only "
                  f"on a throwaway cluster made by `KEEP_CLUSTER=1 CLUSTER={name} hack/kind-e2e.sh`")
        if not path.is_file():
            raise NotThrowaway(f"{refuse} (no kubeconfig at {path})")
        cfg = yaml.safe_load(path.read_text())
        if cfg.get("current-context") != f"kind-{name}":
            raise NotThrowaway(f"{refuse} ({path} is for {cfg.get('current-context')!r}, not kind-{name})")
        cluster, user = cfg["clusters"][0]["cluster"], cfg["users"][0]["user"]
        files = {}
        for key, field in (("ca", "certificate-authority-data"), ("crt", "client-certificate-data"),
                           ("key", "client-key-data")):
            files[key] = tmp / f"kind.{key}"
            files[key].write_bytes(base64.b64decode(cluster[field] if key == "ca" else user[field]))
        ctx = ssl.create_default_context(cafile=str(files["ca"]))
        ctx.load_cert_chain(str(files["crt"]), str(files["key"]))
        for engine in ("podman", "docker"):
            out = subprocess.run([engine, "inspect", "--format", "{{.Id}}", f"{name}-control-plane"],
                                 capture_output=True, text=True, env=kind.engine_env(engine), check=False)
            if out.returncode == 0 and out.stdout.strip():
                return cls(name, engine, cluster["server"], ctx, out.stdout.strip())
        raise NotThrowaway(f"{refuse} (no node container {name}-control-plane in podman or docker)")

    # -- the API server ------------------------------------------------------------------------------

    def api(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method,
                                     headers={"Content-Type": content_type})
        with urllib.request.urlopen(req, context=self.ctx, timeout=30) as r:
            raw = r.read()
        return json.loads(raw) if raw[:1] == b"{" else raw.decode()

    def cordon(self) -> None:
        """The bench's pods go to the stand-in Node only: the real kubelet never runs them."""
        self.api("PATCH", f"/api/v1/nodes/{self.node}", {"spec": {"unschedulable": True}},
                 "application/merge-patch+json")

    # -- processes -----------------------------------------------------------------------------------

    def _processes(self) -> list[tuple[int, list[str], str]]:
        """(pid, argv, HOSTNAME) of every process in the node container, from this host's /proc."""
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if self.container not in (entry / "cgroup").read_text():
                    continue
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            host = next((e[9:].decode() for e in env if e.startswith(b"HOSTNAME=")), "")
            out.append((int(entry.name), [a.decode(errors="replace") for a in argv if a], host))
        return out

    def pids(self) -> dict[str, int]:
        """The control plane's processes and the operator's replicas: `operator` is the one holding the
        Lease, `operator follower` the other."""
        procs = self._processes()
        found: dict[str, int] = {}
        for pid, argv, _ in procs:
            base = Path(argv[0]).name if argv else ""
            if base in PROCESSES:
                found[base] = pid
        leader = self._leader()
        for pid, argv, host in procs:
            if any("flowkube-operator" in a or "flowkube_operator" in a for a in argv[:2]):
                found["operator" if host == leader else "operator follower"] = pid
        missing = [p for p in (*PROCESSES, "operator") if p not in found]
        if missing:
            raise RuntimeError(f"not found in {self.node}'s processes: {', '.join(missing)}")
        return found

    def _leader(self) -> str:
        leases = self.api("GET", f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases")["items"]
        selector = "labelSelector=app.kubernetes.io/component%3Doperator"
        pods = {p["metadata"]["name"]
                for p in self.api("GET", f"/api/v1/namespaces/{NAMESPACE}/pods?{selector}")["items"]}
        return next((lease["spec"].get("holderIdentity", "") for lease in leases
                     if lease["spec"].get("holderIdentity") in pods), "")

    def restart_controller_manager(self, flags: Sequence[str], timeout: float = 180.0) -> int:
        """kubeadm's static pod with `flags` added: the kubelet restarts it. Returns its new pid."""
        old = self.pids()["kube-controller-manager"]
        env = kind.engine_env(self.engine)
        manifest = subprocess.run([self.engine, "exec", self.node, "cat", MANIFEST], capture_output=True,
                                  text=True, check=True, env=env).stdout
        anchor = "    - kube-controller-manager\n"
        if anchor not in manifest:
            raise RuntimeError(f"{MANIFEST} in {self.node} has no `{anchor.strip()}` line to add flags after")
        manifest = manifest.replace(anchor, anchor + "".join(f"    - {f}\n" for f in flags), 1)
        # Written outside the manifests directory, then moved in: the kubelet sees one whole file.
        subprocess.run([self.engine, "exec", "-i", self.node, "sh", "-c",
                        f"cat > /tmp/kcm.yaml && mv /tmp/kcm.yaml {MANIFEST}"],
                       input=manifest, text=True, check=True, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pid, argv, _ in self._processes():
                if argv and Path(argv[0]).name == "kube-controller-manager" and pid != old \
                        and all(f in argv for f in flags):
                    return pid
            time.sleep(0.5)  # polling /proc for the kubelet's restart, with a deadline
        raise TimeoutError(f"kube-controller-manager did not come back with {' '.join(flags)} in {timeout:.0f} s")

    def operator_metrics(self) -> str:
        leader = self._leader()
        text: str = self.api("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{leader}:9090/proxy/metrics")
        return text

    def template(self) -> dict[str, Any]:
        """A Job's pod template like the runner pod the chart's operator makes (never run here)."""
        return jobpeer.runner_template(f"flowkube-operator.{NAMESPACE}.svc", 8443, "")
