"""The local cluster's node: containerd + runc, kubelet, kube-proxy, the CNI bridge and CoreDNS.

Nothing here is a stand-in: kubelet and kube-proxy are built from the same Kubernetes module as
the control plane, CoreDNS from its own module, containerd, runc and the CNI plugins are Debian's.
What this machine kind needs of them (cgroup v1 in hybrid mode, no CAP_SYS_RESOURCE, no systemd):

- containerd: ``restrict_oom_score_adj`` (else every sandbox fails: it asks for oom_score_adj -998),
  the runc runtime with cgroupfs, its own root, state and socket, the locally built pause image.
- kubelet: ``failCgroupV1: false`` (1.36 refuses cgroup v1 otherwise), the cgroupfs driver under a
  cgroup root of its own (two nodes on one host must not share one), no swap check, relaxed
  eviction thresholds (a shared disk), no read-only port.
- kube-proxy in iptables mode, CoreDNS serving ``cluster.local`` on the node's address (the
  kubelet's ``clusterDNS``), both with client certificates bound to their usual RBAC.

Everything runs in the cluster's network namespace (``netns``); mounts and cgroups are the host's,
so containerd sees the volumes kubelet mounts. A node left behind by a killed run is reaped before
the next start: every process in its cgroups is killed and its mounts are undone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from flowkube_devstack import procs
from flowkube_devstack.netns import Netns

NODE_NAME = "flowkube-local-node"
CNI_BIN_DIR = "/usr/lib/cni"
CGROUP_FS = Path("/sys/fs/cgroup")

class NodeError(RuntimeError):
    pass


def missing_tools() -> list[str]:
    tools = {"containerd": "containerd", "ctr": "containerd", "runc": "runc", "iptables": "iptables",
             "conntrack": "conntrack", "nsenter": "util-linux", "podman": "podman",
             "mmdebstrap": "mmdebstrap", "skopeo": "skopeo", "gcc": "gcc"}
    missing = [pkg for tool, pkg in tools.items() if shutil.which(tool) is None]
    if not Path(CNI_BIN_DIR, "bridge").exists():
        missing.append("containernetworking-plugins")
    if not Path("/usr/lib/x86_64-linux-gnu/libc.a").exists() and not list(Path("/usr/lib").glob("*/libc.a")):
        missing.append("libc6-dev")  # the pause image is a static binary
    return sorted(set(missing))


def _hierarchies() -> list[Path]:
    """The mounted cgroup v1 hierarchies (cpu, memory, pids, ...), as kubelet's cgroupfs driver uses them."""
    return [p for p in CGROUP_FS.iterdir() if p.is_dir() and not p.is_symlink()]


def _cgroup_tasks(group: Path) -> list[int]:
    pids: list[int] = []
    for f in group.rglob("cgroup.procs"):
        with contextlib.suppress(OSError, ValueError):
            pids += [int(x) for x in f.read_text().split()]
    return pids


def reap(cgroup_name: str, root: Path) -> list[int]:
    """Kill every process of a node's cgroups (containers, shims, containerd) and undo its mounts."""
    killed: list[int] = []
    for h in _hierarchies():
        for pid in _cgroup_tasks(h / cgroup_name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    unmount_under(root)
    return killed


def unmount_under(root: Path) -> None:
    prefix = str(root.resolve()) + "/"
    mounts = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefix):
                mounts.append(point)
    for point in sorted(set(mounts), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def _make_cgroup_root(name: str) -> None:
    for h in _hierarchies():
        d = h / name
        d.mkdir(exist_ok=True)
        if h.name == "cpuset":  # a new cpuset takes no tasks until it has cpus and mems
            for f in ("cpuset.cpus", "cpuset.mems"):
                if not (d / f).read_text().strip():
                    (d / f).write_text((h / f).read_text())


def _remove_cgroup_root(name: str) -> None:
    for h in _hierarchies():
        group = h / name
        if not group.is_dir():
            continue
        for d in sorted((p for p in group.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            group.rmdir()


class Node:
    """containerd, kubelet, kube-proxy and CoreDNS of one local cluster, under ``root``."""

    def __init__(self, root: Path, ns: Netns, bins: dict[str, Path], *, spawn: Callable[..., Any]) -> None:
        self.root = root
        self.ns = ns
        self.bins = bins
        self._spawn = spawn  # the cluster's spawner: procs.spawn inside the namespace, tracked for stop()
        self.cgroup_name = f"flowkube-{ns.slot}"
        self.containerd_dir = root / "containerd"
        self.kubelet_dir = root / "kubelet"
        self.socket = self.containerd_dir / "containerd.sock"
        self._containerd_log_start = 0

    @property
    def containerd_address(self) -> str:
        return str(self.socket)

    # -- containerd -------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Reap what a killed run under this root or cgroup left, then make the node's directories."""
        reap(self.cgroup_name, self.root)
        _remove_cgroup_root(self.cgroup_name)
        for d in (self.containerd_dir, self.kubelet_dir, self.root / "cni"):
            shutil.rmtree(d, ignore_errors=True)
        _make_cgroup_root(self.cgroup_name)

    def start_containerd(self, pause_image: str) -> subprocess.Popen[bytes]:
        d = self.containerd_dir
        (d / "root").mkdir(parents=True, exist_ok=True)
        net_d = self.root / "cni" / "net.d"
        net_d.mkdir(parents=True, exist_ok=True)
        (net_d / "10-flowkube.conflist").write_text(json.dumps(self._cni_config(), indent=2))
        cri = "io.containerd.grpc.v1.cri"
        config = f"""version = 2
root = "{d / 'root'}"
state = "{d / 'state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{self.socket}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d / 'opt'}"
[plugins."{cri}"]
  sandbox_image = "{pause_image}"
  restrict_oom_score_adj = true
  enable_selinux = false
  # Pod network namespaces under the node's own state, so a stop or a reap undoes them too.
  netns_mounts_under_state_dir = true
  [plugins."{cri}".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."{cri}".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."{cri}".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."{cri}".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{net_d}"
"""
        (d / "config.toml").write_text(config)
        log = procs.log_path(self.root, "containerd")
        self._containerd_log_start = log.stat().st_size if log.exists() else 0  # the log is appended to
        proc: subprocess.Popen[bytes] = self._spawn("containerd", ["containerd", "--config", str(d / "config.toml")])
        # containerd and the shims it starts live in the node's cgroups, so a reap finds them all.
        for h in _hierarchies():
            if h.name in ("pids", "memory", "cpu"):
                runtime = h / self.cgroup_name / "runtime"
                runtime.mkdir(exist_ok=True)
                with contextlib.suppress(OSError):
                    (runtime / "cgroup.procs").write_text(str(proc.pid))
        return proc

    def ctr(self, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["ctr", "--address", self.containerd_address, "-n", "k8s.io", *args],
                              capture_output=True, input=input)

    def containerd_ready(self) -> bool:
        """containerd answers and its CRI too: the CRI plugin answers "server is not initialized yet"
        for a moment after containerd itself does (it first recovers its state), and a kubelet
        started then exits. Containerd 1.6 logs its last step before it serves the CRI."""
        if not (self.socket.exists() and self.ctr("version").returncode == 0):
            return False
        with procs.log_path(self.root, "containerd").open("rb") as log:
            log.seek(self._containerd_log_start)
            return b'msg="Start streaming server"' in log.read()

    def _cni_config(self) -> dict[str, Any]:
        return {
            "cniVersion": "0.4.0",
            "name": "flowkube",
            "plugins": [
                {"type": "bridge", "bridge": f"fkbr{self.ns.slot}", "isGateway": True, "ipMasq": True,
                 "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": self.ns.pod_cidr}]],
                          "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(self.root / "cni" / "ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }

    # -- kubelet ----------------------------------------------------------------------------------

    def start_kubelet(self, kubeconfig: Path, ca: Path, serving_cert: Path,
                      serving_key: Path) -> subprocess.Popen[bytes]:
        d = self.kubelet_dir
        d.mkdir(parents=True, exist_ok=True)
        resolv = d / "resolv.conf"  # pods get the cluster DNS; nothing upstream (there is no network)
        resolv.write_text("")
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{self.cgroup_name}",
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "address": self.ns.node_ip,
            "port": 10250,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": 10248,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(ca)}},
            "authorization": {"mode": "Webhook"},
            "tlsCertFile": str(serving_cert),
            "tlsPrivateKeyFile": str(serving_key),
            "clusterDomain": "cluster.local",
            "clusterDNS": [self.ns.node_ip],
            "resolvConf": str(resolv),
            # A shared development disk: evict only when it is really full.
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 99,
            "imageGCLowThresholdPercent": 98,
            "podLogsDir": str(self.root / "pod-logs"),
            "serializeImagePulls": False,
            "maxPods": 250,
            "shutdownGracePeriod": "0s",
            "nodeStatusReportFrequency": "1m",
        }
        (d / "config.yaml").write_text(yaml.safe_dump(config))
        argv = [str(self.bins["kubelet"]), f"--config={d / 'config.yaml'}", f"--kubeconfig={kubeconfig}",
                f"--root-dir={d / 'root'}", f"--hostname-override={NODE_NAME}", f"--node-ip={self.ns.node_ip}",
                "--v=1"]
        proc: subprocess.Popen[bytes] = self._spawn("kubelet", argv)
        return proc

    # -- kube-proxy and DNS -----------------------------------------------------------------------

    def start_kube_proxy(self, kubeconfig: Path) -> subprocess.Popen[bytes]:
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "mode": "iptables",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "hostnameOverride": NODE_NAME,
            "clusterCIDR": self.ns.pod_cidr,
            "healthzBindAddress": "127.0.0.1:10256",
            "metricsBindAddress": "127.0.0.1:10249",
            # Leave the kernel's conntrack sizing alone (a shared host; the namespace inherits it).
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        }
        path = self.root / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(config))
        proc: subprocess.Popen[bytes] = self._spawn(
            "kube-proxy", [str(self.bins["kube-proxy"]), f"--config={path}", "--v=1"])
        return proc

    def start_coredns(self, kubeconfig: Path) -> subprocess.Popen[bytes]:
        corefile = self.root / "Corefile"
        corefile.write_text(f""".:53 {{
    bind {self.ns.node_ip}
    errors
    ready 127.0.0.1:8181
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} flowkube-local
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
}}
""")
        proc: subprocess.Popen[bytes] = self._spawn("coredns", [str(self.bins["coredns"]), "-conf", str(corefile)])
        return proc

    def stop_leftovers(self) -> None:
        """After the processes are stopped: pods' containers and shims, mounts, cgroups."""
        reap(self.cgroup_name, self.root)
        _remove_cgroup_root(self.cgroup_name)


# RBAC a kubeadm cluster has and a bare control plane does not: the API server's client of the
# kubelet API (logs, exec, port-forward) and CoreDNS.
BOOTSTRAP_RBAC = [
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
     "metadata": {"name": "flowkube:apiserver-kubelet-client"},
     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:kubelet-api-admin"},
     "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "kube-apiserver-kubelet-client"}]},
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
     "metadata": {"name": "system:coredns"},
     "rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
                "verbs": ["list", "watch"]},
               {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}]},
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
     "metadata": {"name": "system:coredns"},
     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
     "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "system:coredns"}]},
]


def wrap_spawn(ns: Netns, root: Path, track: dict[str, subprocess.Popen[bytes]]) -> Callable[..., Any]:
    def spawn(name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        proc = procs.spawn(name, ns.wrap(argv), root=root, env=env if env is not None else dict(os.environ))
        track[name] = proc
        return proc

    return spawn
