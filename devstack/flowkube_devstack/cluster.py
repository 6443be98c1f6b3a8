"""A real Kubernetes cluster on this host: etcd, the control plane and a real node.

Binaries come from `build.control_plane()` (built from the Kubernetes Go modules). The cluster lives
in a network namespace of its own (`netns`): the API server is at https://10.234.<slot>.2:6443, pods
and ClusterIPs are routed from the host. Authentication is by client certificates from a throwaway
CA; authorization is Node,RBAC; PodSecurity, ServiceAccount and NodeRestriction admission are on.
The node (`kubenode`) is kubelet with containerd and runc, the CNI bridge, kube-proxy and CoreDNS;
its images are built here (`images`), since no registry is reachable.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from flowkube_devstack import build, images, imageseed, kubenode, netns, pki, procs
from flowkube_devstack.kubenode import NODE_NAME

APISERVER_PORT = 6443
ETCD_PORT = 2379


class ClusterError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def http_ok(url: str | urllib.request.Request, context: ssl.SSLContext | None = None) -> bool:
    """True when url answers 200 now; a refused or failing endpoint is simply not ready yet."""
    try:
        with urllib.request.urlopen(url, context=context, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:  # URLError and HTTPError are OSErrors
        return False


def write_kubeconfig(path: Path, server: str, ca: Path, client: pki.KeyPair, user: str) -> Path:
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "flowkube-local", "cluster": {"server": server,
                                                             "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"client-certificate": str(client.cert),
                                          "client-key": str(client.key)}}],
        "contexts": [{"name": "flowkube-local", "context": {"cluster": "flowkube-local", "user": user}}],
        "current-context": "flowkube-local",
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    path.chmod(0o600)
    return path


class LocalCluster:
    """Start with `start()`, stop with `stop()`; state, certificates and logs live under root."""

    def __init__(self, root: Path, *, with_node: bool = True, fsync: bool = False,
                 controller_manager_args: Sequence[str] = ()) -> None:
        self.root = root.resolve()
        self.with_node = with_node
        self.fsync = fsync
        # Extra kube-controller-manager flags, after the stack's own (a repeated flag: the last wins).
        self.controller_manager_args = list(controller_manager_args)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.bins: dict[str, Path] = {}
        self.apiserver_port = APISERVER_PORT
        self.pki_dir = self.root / "pki"
        self.kubeconfig = self.root / "admin.kubeconfig"
        self._apiserver_argv: list[str] = []
        self.ns: netns.Netns | None = None
        self.node: kubenode.Node | None = None
        self.images: images.Images | None = None

    # -- public -----------------------------------------------------------------------------------

    @property
    def netns(self) -> netns.Netns:
        if self.ns is None:
            raise ClusterError("the cluster is not started")
        return self.ns

    @property
    def node_ip(self) -> str:
        """The cluster's address: API server, kubelet, CoreDNS; the host reaches it over a veth."""
        return self.netns.node_ip

    @property
    def host_ip(self) -> str:
        """This host as pods see it (for processes of the host that pods must reach)."""
        return self.netns.host_ip

    @property
    def server(self) -> str:
        return f"https://{self.node_ip}:{self.apiserver_port}"

    def start(self, timeout: float = 300.0) -> LocalCluster:
        if self.with_node and (missing := kubenode.missing_tools()):
            raise ClusterError(f"the local node needs Debian packages that are missing: {', '.join(missing)} "
                               "(./dev installs them when run as root)")
        self.bins = build.control_plane(node=self.with_node)
        if self.with_node:
            self.images = images.ensure_all()
        self.root.mkdir(parents=True, exist_ok=True)
        procs.kill_stale(self.root)
        previous = self._previous_slot()
        try:
            self.ns = netns.acquire(build.cache_root() / "netns", prefer=previous)
            if previous is not None and self.ns.slot != previous:
                # The saved cluster's addresses (its Services' ClusterIPs, the node's, the pods') are
                # another slot's, taken now by another cluster: start this one afresh.
                shutil.rmtree(self.root / "etcd", ignore_errors=True)
            self._spawn = kubenode.wrap_spawn(self.ns, self.root, self.procs)
            self._prepare_pki()
            self._start_etcd(timeout)
            self._start_apiserver(timeout)
            self._start_controllers()
            if self.with_node:
                self._start_node(timeout)
            self._wait_default_namespace(timeout)
        except BaseException:
            self.stop()
            raise
        (self.root / "cluster.json").write_text(json.dumps(self.describe(), indent=2))
        return self

    def stop(self) -> None:
        # Reverse start order: the node first, etcd last; then what the node's pods left.
        for name in reversed(list(self.procs)):
            procs.terminate(self.procs[name], grace=10.0 if name in ("kubelet", "containerd") else 5.0)
            procs.pid_file(self.root, name).unlink(missing_ok=True)
        self.procs.clear()
        if self.node is not None:
            self.node.stop_leftovers()
            self.node = None
        if self.ns is not None:
            self.ns.delete()
            self.ns = None

    def restart_apiserver(self, timeout: float = 60.0) -> None:
        """Stop and start kube-apiserver alone (same port, same etcd): clients see a real outage."""
        procs.terminate(self.procs.pop("kube-apiserver"), grace=5.0)
        self._launch_apiserver()
        wait_for(self._apiserver_ready, timeout, "kube-apiserver /readyz after restart")

    @contextlib.contextmanager
    def apiserver_stopped(self, timeout: float = 60.0) -> Iterator[None]:
        """kube-apiserver stopped inside the block (etcd, the node and the controllers keep running),
        then started again with the same flags: what changes in etcd meanwhile, no watch shows."""
        procs.terminate(self.procs.pop("kube-apiserver"), grace=5.0)
        try:
            yield
        finally:
            self._launch_apiserver()
            wait_for(self._apiserver_ready, timeout, "kube-apiserver /readyz after restart")

    def _previous_slot(self) -> int | None:
        """The network slot this cluster's saved state was made in (a restarted dev stack), if any."""
        try:
            slot = json.loads((self.root / "cluster.json").read_text()).get("slot")
        except (OSError, ValueError):
            return None
        return slot if isinstance(slot, int) else None

    def describe(self) -> dict[str, Any]:
        return {
            "slot": self.netns.slot,
            "server": self.server,
            "nodeIP": self.node_ip,
            "hostIP": self.host_ip,
            "kubeconfig": str(self.kubeconfig),
            "root": str(self.root),
            "pids": {n: p.pid for n, p in self.procs.items()},
            "bins": {n: str(p) for n, p in self.bins.items()},
        }

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.bins["kubectl"]), "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True, text=True, input=input, timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc

    def host_service(self, name: str, namespace: str, port: int) -> str:
        """A Service whose endpoint is a process of this host (at ``host_ip``:port): pods reach it by
        name, through kube-proxy and CoreDNS, exactly as a Service of pods. Returns its URL."""
        if self.kubectl("get", "namespace", namespace, check=False).returncode != 0:
            self.kubectl("create", "namespace", namespace)
        objs = [
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace},
             "spec": {"ports": [{"name": "http", "port": 80, "targetPort": port, "protocol": "TCP"}]}},
            {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
             "metadata": {"name": name, "namespace": namespace, "labels": {"kubernetes.io/service-name": name}},
             "addressType": "IPv4", "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
             "endpoints": [{"addresses": [self.host_ip], "conditions": {"ready": True}}]},
        ]
        self.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in objs))
        return f"http://{name}.{namespace}.svc"

    def api(self, method: str, path: str, body: Any = None,
            content_type: str = "application/json") -> Any:
        """A minimal admin client for the launcher's own checks (tests use kubectl or their own)."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method,
                                     headers={"Content-Type": content_type})
        with urllib.request.urlopen(req, context=self._admin_ssl, timeout=10) as resp:
            return json.loads(resp.read() or b"null")

    def get(self, path: str, **query: str) -> Any:
        """The object (or list) the API server has at ``path`` (with ``query``'s parameters), None
        when there is none (404). For what a test polls: one HTTPS request of this process costs
        about 2 ms of CPU, a kubectl process about 45 ms (both cores are shared by the whole suite)."""
        try:
            return self.api("GET", f"{path}?{urllib.parse.urlencode(query)}" if query else path)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    # -- steps ------------------------------------------------------------------------------------

    def _prepare_pki(self) -> None:
        shutil.rmtree(self.pki_dir, ignore_errors=True)
        ca = pki.CertificateAuthority(self.pki_dir)
        self.ca = ca.cert_path
        self.serving = ca.issue("apiserver", "kube-apiserver", server=True,
                                dns=("localhost", "kubernetes", "kubernetes.default",
                                     "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"),
                                ips=("127.0.0.1", self.node_ip, self.netns.kubernetes_service_ip))
        self.sa_keys = pki.service_account_keys(self.pki_dir)
        self.admin = ca.issue("admin", "flowkube-admin", orgs=("system:masters",), client=True)
        self.apiserver_kubelet_client = ca.issue(
            "apiserver-kubelet-client", "kube-apiserver-kubelet-client",
            orgs=("kubeadm:cluster-admins",), client=True)
        self.controller_manager = ca.issue("controller-manager", "system:kube-controller-manager",
                                           client=True)
        self.scheduler = ca.issue("scheduler", "system:kube-scheduler", client=True)
        self.node_client = ca.issue("node", f"system:node:{NODE_NAME}", orgs=("system:nodes",),
                                    client=True)
        self.node_serving = ca.issue("node-serving", NODE_NAME, server=True,
                                     dns=("localhost", NODE_NAME), ips=("127.0.0.1", self.node_ip))
        self.kube_proxy = ca.issue("kube-proxy", "system:kube-proxy", client=True)
        self.coredns = ca.issue("coredns", "system:coredns", client=True)
        self._admin_ssl = ssl.create_default_context(cafile=str(self.ca))
        self._admin_ssl.load_cert_chain(str(self.admin.cert), str(self.admin.key))

    def _start_etcd(self, timeout: float) -> None:
        self.etcd_url = f"http://{self.node_ip}:{ETCD_PORT}"
        peer = f"http://127.0.0.1:{ETCD_PORT + 1}"
        data = self.root / "etcd"
        argv = [
            str(self.bins["etcd"]), "--name", "default", "--data-dir", str(data),
            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"default={peer}",
            "--log-level", "warn",
        ]
        if not self.fsync:
            argv.append("--unsafe-no-fsync")  # throwaway test data; fsync dominates write latency
        self._spawn("etcd", argv)
        wait_for(lambda: self._http_ok(self.etcd_url + "/health"), timeout,
                 f"etcd on {self.etcd_url} (log: {procs.log_path(self.root, 'etcd')})",
                 )

    def _start_apiserver(self, timeout: float) -> None:
        self._apiserver_argv = [
            str(self.bins["kube-apiserver"]),
            "--bind-address=0.0.0.0", f"--secure-port={self.apiserver_port}",
            f"--advertise-address={self.node_ip}",
            f"--etcd-servers={self.etcd_url}",
            f"--cert-dir={self.root / 'apiserver-certs'}",
            f"--tls-cert-file={self.serving.cert}", f"--tls-private-key-file={self.serving.key}",
            f"--client-ca-file={self.ca}",
            f"--kubelet-client-certificate={self.apiserver_kubelet_client.cert}",
            f"--kubelet-client-key={self.apiserver_kubelet_client.key}",
            f"--kubelet-certificate-authority={self.ca}",
            "--kubelet-preferred-address-types=InternalIP",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={self.sa_keys.cert}",
            f"--service-account-signing-key-file={self.sa_keys.key}",
            f"--service-cluster-ip-range={self.netns.service_cidr}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=false",
            "--profiling=false",
            "--v=1",
        ]
        self._launch_apiserver()
        wait_for(self._apiserver_ready, timeout,
                 f"kube-apiserver /readyz (log: {procs.log_path(self.root, 'kube-apiserver')})")
        write_kubeconfig(self.kubeconfig, self.server, self.ca, self.admin, "flowkube-admin")

    def _launch_apiserver(self) -> None:
        self._spawn("kube-apiserver", self._apiserver_argv)

    def _start_controllers(self) -> None:
        self._start_controller_manager()
        sched_cfg = write_kubeconfig(self.root / "scheduler.kubeconfig", self.server, self.ca,
                                     self.scheduler, "system:kube-scheduler")
        self._spawn("kube-scheduler", [
            str(self.bins["kube-scheduler"]),
            f"--kubeconfig={sched_cfg}", f"--authentication-kubeconfig={sched_cfg}",
            f"--authorization-kubeconfig={sched_cfg}",
            "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=10259",
            "--v=1",
        ])

    @contextlib.contextmanager
    def controller_manager_stopped(self) -> Iterator[None]:
        """No garbage collection (nor any other kube-controller-manager loop) inside the block."""
        procs.terminate(self.procs.pop("kube-controller-manager"), grace=5.0)
        try:
            yield
        finally:
            self._start_controller_manager()

    def restart_controller_manager(self, args: Sequence[str] | None = None) -> None:
        """Stop kube-controller-manager and start it again, with `args` as its extra flags when given.
        Returns at once: its controllers start after their informers sync (callers wait for the effect
        they need, e.g. a Job's pod)."""
        if args is not None:
            self.controller_manager_args = list(args)
        procs.terminate(self.procs.pop("kube-controller-manager"), grace=5.0)
        self._start_controller_manager()

    def _start_controller_manager(self) -> None:
        cm_cfg = write_kubeconfig(self.root / "controller-manager.kubeconfig", self.server, self.ca,
                                  self.controller_manager, "system:kube-controller-manager")
        self._spawn("kube-controller-manager", [
            str(self.bins["kube-controller-manager"]),
            f"--kubeconfig={cm_cfg}", f"--authentication-kubeconfig={cm_cfg}",
            f"--authorization-kubeconfig={cm_cfg}",
            "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=10257",
            f"--root-ca-file={self.ca}", f"--service-account-private-key-file={self.sa_keys.key}",
            "--use-service-account-credentials=true",
            f"--cluster-signing-cert-file={self.ca}", f"--cluster-signing-key-file={self.pki_dir / 'ca.key'}",
            "--concurrent-gc-syncs=10",
            "--v=1",
            *self.controller_manager_args,
        ])

    def _start_node(self, timeout: float) -> None:
        assert self.images is not None
        node = self.node = kubenode.Node(self.root, self.netns, self.bins, spawn=self._spawn)
        node.prepare()
        # Its containerd starts with the images imported (hard links to a seed made once per set of
        # images); the import below then finds them all, or imports them where links cannot be made.
        imageseed.lay_down(node.containerd_dir / "root", self.images.all())
        node.start_containerd(self.images.pause)
        def containerd_ready() -> bool:
            self._check_alive()
            return node.containerd_ready()

        wait_for(containerd_ready, timeout, f"containerd (log: {procs.log_path(self.root, 'containerd')})")
        images.load_into_containerd(node.containerd_address, self.images.all())
        self.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in kubenode.BOOTSTRAP_RBAC))

        def kubeconfig(name: str, pair: pki.KeyPair, user: str) -> Path:
            return write_kubeconfig(self.root / f"{name}.kubeconfig", self.server, self.ca, pair, user)

        node.start_kubelet(kubeconfig("node", self.node_client, f"system:node:{NODE_NAME}"), self.ca,
                           self.node_serving.cert, self.node_serving.key)
        node.start_kube_proxy(kubeconfig("kube-proxy", self.kube_proxy, "system:kube-proxy"))
        node.start_coredns(kubeconfig("coredns", self.coredns, "system:coredns"))
        wait_for(self._node_ready, timeout,
                 f"node {NODE_NAME} Ready (log: {procs.log_path(self.root, 'kubelet')})", interval=0.2)

    def _wait_default_namespace(self, timeout: float) -> None:
        # Pods need the namespace's ServiceAccount and kube-root-ca.crt, made by the controller-manager.
        def ready() -> bool:
            try:
                self.api("GET", "/api/v1/namespaces/default/serviceaccounts/default")
                self.api("GET", "/api/v1/namespaces/default/configmaps/kube-root-ca.crt")
            except (urllib.error.URLError, OSError):
                return False
            return True

        wait_for(ready, timeout, "the default ServiceAccount and kube-root-ca.crt (controller-manager)")

    # -- probes -----------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                log = procs.log_path(self.root, name)
                tail = log.read_text(errors="replace")[-2500:] if log.exists() else ""
                raise ClusterError(f"{name} exited with code {p.returncode}; last log lines:\n{tail}")

    def _http_ok(self, url: str) -> bool:
        self._check_alive()
        return http_ok(url)

    def _apiserver_ready(self) -> bool:
        self._check_alive()
        return http_ok(self.server + "/readyz", self._admin_ssl)

    def _node_ready(self) -> bool:
        self._check_alive()
        try:
            node = self.api("GET", f"/api/v1/nodes/{NODE_NAME}")
        except (urllib.error.URLError, OSError):
            return False
        conds = node.get("status", {}).get("conditions", [])
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


@contextlib.contextmanager
def running(root: Path, **kwargs: Any) -> Any:
    cluster = LocalCluster(root, **kwargs)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
