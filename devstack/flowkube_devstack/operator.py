"""The flowkube operator on a LocalCluster, two ways.

``ChartOperator`` (the default of the demo and the tests): ``helm install`` of charts/flowkube with
the locally built images; the operator runs as a pod of the chart's Deployment, with the chart's
RBAC, Services, webhooks, status policy and state API, and runner pods run from the runner image.

``OperatorProcess`` (an explicit fast path, for benchmarks that measure the operator's own CPU and
for iterating on the operator without rebuilding its image): the operator as a process of this
host, exactly as the chart would run it minus the container. The chart is rendered and its CRD,
ServiceAccount, RBAC and webhook configurations are applied; the operator logs in with a token of
the chart's ServiceAccount and serves its webhooks and state API on the host's address on the
cluster's network (the chart's `webhook.url`), where the API server and runner pods reach it.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from flowkube_api import crd
from flowkube_devstack import build, procs
from flowkube_devstack.cluster import ClusterError, LocalCluster, free_port, http_ok, wait_for

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "flowkube"
SYSTEM_NAMESPACE = "flowkube-system"
RELEASE = "flowkube"
SERVICE_ACCOUNT = "flowkube"  # the chart's fullname for release "flowkube"
WEBHOOK_CONFIGURATION = f"{RELEASE}-{SYSTEM_NAMESPACE}.flowkube.io"
_APPLIED_KINDS = {"CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                  "RoleBinding", "Secret", "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration",
                  "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "FlowSchema"}
STATUS_POLICY = f"{RELEASE}-{SYSTEM_NAMESPACE}.status.flowkube.io"


def helm_binary() -> Path:
    return build.ensure(build.helm(), quiet=True) / "helm"


def render_chart(*sets: str) -> list[dict[str, Any]]:
    args = [str(helm_binary()), "template", RELEASE, str(CHART), "--namespace", SYSTEM_NAMESPACE]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def token_kubeconfig(cluster: LocalCluster, namespace: str, sa: str, path: Path, duration: str = "48h") -> Path:
    token = cluster.kubectl("create", "token", sa, "-n", namespace, f"--duration={duration}").stdout.strip()
    cfg = {"apiVersion": "v1", "kind": "Config",
           "clusters": [{"name": "local", "cluster": {"server": cluster.server,
                                                      "certificate-authority": str(cluster.pki_dir / "ca.crt")}}],
           "users": [{"name": sa, "user": {"token": token}}],
           "contexts": [{"name": "local", "context": {"cluster": "local", "user": sa, "namespace": namespace}}],
           "current-context": "local"}
    path.write_text(yaml.safe_dump(cfg))
    path.chmod(0o600)
    return path


def install_chart_for_local_operator(cluster: LocalCluster, webhook_port: int, *values: str) -> Path:
    """Apply what the chart installs except the Deployment (``values``: more chart values, which
    the process's own environment must match); return the operator's kubeconfig."""
    objs = [o for o in render_chart(f"webhook.url=https://{cluster.host_ip}:{webhook_port}",
                                    "validator.enabled=false", *values)
            if o.get("kind") in _APPLIED_KINDS]
    if cluster.kubectl("get", "namespace", SYSTEM_NAMESPACE, check=False).returncode != 0:
        cluster.kubectl("create", "namespace", SYSTEM_NAMESPACE)
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                    input="\n---\n".join(json.dumps(o) for o in objs))
    cluster.kubectl("wait", "--for=condition=Established", *(f"crd/{p}.flowkube.io" for p in crd.PLURALS.values()),
                    "--timeout=60s")
    wait_for(lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", SYSTEM_NAMESPACE,
                                     check=False).returncode == 0, 30, "the flowkube-system namespace ready")
    return token_kubeconfig(cluster, SYSTEM_NAMESPACE, SERVICE_ACCOUNT, cluster.root / "operator.kubeconfig")


class _Operator:
    """What tests read of an operator, wherever it runs: its /metrics."""

    @property
    def metrics_target(self) -> str:
        raise NotImplementedError

    def metrics_token(self) -> str:
        """A bearer token /metrics accepts ("" when it asks for none)."""
        return ""

    def read_metrics(self, url: str) -> str:
        token = self.metrics_token()
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(request, timeout=10) as r:
            text: str = r.read().decode()
            return text

    def metrics(self) -> str:
        return self.read_metrics(f"http://{self.metrics_target}/metrics")


class OperatorProcess(_Operator):
    def __init__(self, cluster: LocalCluster, *, name: str = "operator",
                 env: Mapping[str, str] | None = None) -> None:
        self.cluster = cluster
        self.name = name
        self.extra_env = dict(env or {})
        self.metrics_port = free_port()
        self.health_port = free_port()
        self.webhook_port = free_port()
        self.state_port = free_port()
        self.cert_dir = cluster.root / f"{name}-webhook"
        self.proc: subprocess.Popen[bytes] | None = None
        self.managed = "KUBECONFIG" not in self.extra_env  # a caller with its own identity set it all up

    @property
    def log(self) -> Path:
        return procs.log_path(self.cluster.root, self.name)

    def start(self, timeout: float = 60.0) -> OperatorProcess:
        env: dict[str, str] = {
            **os.environ,
            "FLOWKUBE_BIND_ADDRESS": self.cluster.host_ip,
            "FLOWKUBE_METRICS_PORT": str(self.metrics_port),
            "FLOWKUBE_HEALTH_PORT": str(self.health_port),
            "FLOWKUBE_LOG_FORMAT": "json",
            "FLOWKUBE_RUNNER_IMAGE": "flowkube-runner:local",
            "FLOWKUBE_RUNNER_COMMAND": f"{sys.executable} -m flowkube_runner",
            # Runner pods reach this host's process at its address on the cluster's network.
            "FLOWKUBE_STATE_PORT": str(self.state_port),
            "FLOWKUBE_WEBHOOK_HOST": self.cluster.host_ip,
            "FLOWKUBE_WEBHOOK_CERT_DIR": str(self.cert_dir),
        }
        if self.managed:
            env |= {
                # The chart's RBAC for what this process does (FlowQuotas only when they are on).
                "KUBECONFIG": str(install_chart_for_local_operator(self.cluster, self.webhook_port, *(
                    ["quotas.enabled=true"] if self.extra_env.get("FLOWKUBE_QUOTAS_ENABLED") == "true" else []))),
                "FLOWKUBE_WEBHOOK_ENABLED": "true",
                "FLOWKUBE_WEBHOOK_PORT": str(self.webhook_port),
                "FLOWKUBE_TLS_SECRET": f"{SYSTEM_NAMESPACE}/{RELEASE}-ca",  # the chart's, as in a cluster
                "FLOWKUBE_WEBHOOK_CONFIGURATION": WEBHOOK_CONFIGURATION,
            }
        env |= self.extra_env
        self.proc = procs.spawn(self.name, [sys.executable, "-m", "flowkube_operator"],
                                root=self.cluster.root, env=env)
        wait_for(self._healthy, timeout, f"operator /readyz (log: {self.log})")
        if self.managed:
            wait_for(self._ca_installed, timeout, "the operator's CA in the webhook configurations")
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"operator exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        return http_ok(f"http://{self.cluster.host_ip}:{self.health_port}/readyz")

    def _ca_installed(self) -> bool:
        ca = (self.cert_dir / "ca.crt").read_bytes() if (self.cert_dir / "ca.crt").exists() else b""
        want = base64.b64encode(ca).decode()
        for kind in ("validatingwebhookconfiguration", "mutatingwebhookconfiguration"):
            out = self.cluster.kubectl("get", kind, WEBHOOK_CONFIGURATION, "-o", "json", check=False)
            if out.returncode != 0:
                return False
            hooks = json.loads(out.stdout)["webhooks"]
            if not ca or any(h.get("clientConfig", {}).get("caBundle") != want for h in hooks):
                return False
        return True

    @property
    def metrics_target(self) -> str:
        return f"{self.cluster.host_ip}:{self.metrics_port}"

    @property
    def state_url(self) -> str:
        return f"https://{self.cluster.host_ip}:{self.state_port}"

    def ca_file(self) -> Path:
        return self.cert_dir / "ca.crt"

    def stop(self) -> None:
        """Stop the operator and, as `helm uninstall` would, its webhook configurations and status
        policy: a later test's Flows must not be refused by a webhook nobody serves (flows fail
        closed), nor its status writes by a policy naming another operator."""
        if self.proc is not None:
            procs.terminate(self.proc, grace=10.0)
            self.proc = None
        if self.managed:
            for kind in ("validatingwebhookconfiguration", "mutatingwebhookconfiguration"):
                self.cluster.kubectl("delete", kind, WEBHOOK_CONFIGURATION, "--ignore-not-found", check=False)
            for kind in ("validatingadmissionpolicybinding", "validatingadmissionpolicy"):
                self.cluster.kubectl("delete", kind, STATUS_POLICY, "--ignore-not-found", check=False)

    def kill(self) -> None:
        """SIGKILL, as a crashed or OOM-killed operator: no cleanup, no goodbye."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def adopt_crd(cluster: LocalCluster, release: str, namespace: str) -> None:
    """Mark the CRDs as the release's: Helm refuses to take over an object another release (or
    none) installed, and the CRD outlives releases (``crds.keep``)."""
    want = {"meta.helm.sh/release-name": release, "meta.helm.sh/release-namespace": namespace}
    names = []
    for plural in crd.PLURALS.values():
        found = cluster.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{plural}.flowkube.io")
        meta = (found or {}).get("metadata") or {}
        if found is not None and ((meta.get("labels") or {}).get("app.kubernetes.io/managed-by") != "Helm"
                                  or any((meta.get("annotations") or {}).get(k) != v for k, v in want.items())):
            names.append(meta["name"])
    if names:  # (the same release's CRDs, the usual case after the first install, need nothing)
        cluster.kubectl("label", "crd", *names, "--overwrite", "app.kubernetes.io/managed-by=Helm")
        cluster.kubectl("annotate", "crd", *names, "--overwrite", *(f"{k}={v}" for k, v in want.items()))


class ChartOperator(_Operator):
    """The operator as users run it: ``helm install`` of the chart, the operator a pod of its image.

    ``runner_image``/``runner_command`` select what runner pods run (the runner image by default;
    tests of the lifecycle use the devstack image's scripted runner), ``runner_env`` is the chart's
    ``runner.defaultEnv``, ``values`` more ``--set`` pairs. The operator's HTTP endpoints are reached
    through the chart's Services (this host routes to ClusterIPs), as Prometheus in a cluster would.

    The chart's ``replicaCount`` is one unless ``values`` says otherwise (the tests and the demo start
    faster and their /metrics Service has a single pod behind it; the chart's default is two, and the
    HA test runs two). "Ready" includes a pod of this install holding the Lease (it reconciles).
    """

    def __init__(self, cluster: LocalCluster, *, runner_image: str | None = None,
                 runner_command: str | None = None, runner_env: Mapping[str, str] | None = None,
                 values: Sequence[str] = (), extra_env: Mapping[str, str] | None = None,
                 release: str = RELEASE, namespace: str = SYSTEM_NAMESPACE) -> None:
        if cluster.images is None:
            raise RuntimeError("the chart's operator needs a cluster with a node (and its images)")
        self.cluster = cluster
        self.images = cluster.images
        self.release = release
        self.namespace = namespace
        self.fullname = release if "flowkube" in release else f"{release}-flowkube"
        self.runner_image = runner_image or self.images.runner
        env = dict(extra_env or {})
        if runner_command:
            env["FLOWKUBE_RUNNER_COMMAND"] = runner_command
        self.extra_env = env
        self.runner_env = dict(runner_env or {})
        self.values = list(values)
        self.replicas = next((int(v.split("=", 1)[1]) for v in reversed(self.values)
                              if v.startswith("replicaCount=")), 1)
        self.installed = False
        self._metrics_token = ""

    # -- install / uninstall ----------------------------------------------------------------------

    def helm(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        home = str(self.cluster.root / "helm")
        env = {**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig), "HELM_CACHE_HOME": home,
               "HELM_CONFIG_HOME": home, "HELM_DATA_HOME": home}
        proc = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, env=env, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args[:2])} failed: {proc.stderr.strip()}\n{self.diagnose()}")
        return proc

    def _set_args(self, more: Sequence[str] = ()) -> list[str]:
        operator_repo, operator_tag = self.images.operator.rsplit(":", 1)
        runner_repo, runner_tag = self.runner_image.rsplit(":", 1)
        sets = [
            f"image.repository={operator_repo}", f"image.tag={operator_tag}", "image.pullPolicy=Never",
            f"runner.image.repository={runner_repo}", f"runner.image.tag={runner_tag}",
            "runner.image.pullPolicy=Never",
            # Ready as soon as /readyz answers: the tests and the demo wait for it.
            "readinessProbe.initialDelaySeconds=0", "readinessProbe.periodSeconds=1",
            "replicaCount=1", *self.values, *more,
        ]
        args: list[str] = []
        for s in sets:
            args += ["--set", s]
        if self.runner_env:
            args += ["--set-json", f"runner.defaultEnv={json.dumps(self.runner_env)}"]
        if self.extra_env:
            env = [{"name": k, "value": v} for k, v in self.extra_env.items()]
            args += ["--set-json", f"extraEnv={json.dumps(env)}"]
        return args

    def start(self, timeout: float = 300.0) -> ChartOperator:
        """Install the chart (or bring a killed operator back) and wait until it serves."""
        if not self.installed:
            self.upgrade(timeout=timeout)
        else:
            self.cluster.kubectl("scale", "deployment", self.fullname, "-n", self.namespace,
                                 f"--replicas={self.replicas}")
            self._wait_ready(timeout)
        return self

    def upgrade(self, *values: str, timeout: float = 300.0) -> None:
        """``helm upgrade --install`` with this operator's values and, for this revision, ``values``."""
        adopt_crd(self.cluster, self.release, self.namespace)
        self.helm("upgrade", "--install", self.release, str(CHART), "--namespace", self.namespace,
                  "--create-namespace", "--wait", f"--timeout={int(timeout)}s", *self._set_args(values),
                  timeout=timeout + 30)
        self.installed = True
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        try:
            wait_for(self._ready, timeout, "the operator pod Ready and its CA in the webhooks", interval=0.2)
        except ClusterError as e:
            raise ClusterError(f"{e}\n{self.diagnose()}") from e

    def stop(self) -> None:
        """``helm uninstall``: the operator, its webhook configurations and status policy go, so a
        later test's Flows are not refused by a webhook nobody serves."""
        if self.installed:
            self.helm("uninstall", self.release, "--namespace", self.namespace, "--wait", "--timeout=120s")
            self.installed = False
            # helm waits for the Deployment to go, not for its pods: they would stop gracefully (the
            # 5 s preStop sleep) while the next install starts. Their ServiceAccount and Role are gone,
            # so nothing graceful is left for them to do: they go at once. Nothing of this one may be
            # left for the next test.
            self.cluster.kubectl("delete", "pods", "-n", self.namespace, "-l", self._pod_selector,
                                 "--grace-period=0", "--force", "--ignore-not-found", check=False)
            wait_for(lambda: not self.pods(), 120, f"the operator pods of {self.release} gone")
            # The Lease is the operator's own object, not the chart's: its holder could not release
            # it (helm removed its Role in the same breath), so the next install's pod would wait out
            # the lease duration (10 s) before it leads.
            self.cluster.kubectl("delete", "lease", self.lease_name, "-n", self.namespace, "--ignore-not-found")

    def kill(self) -> None:
        """SIGKILL every replica's operator process, as a crash or an OOM kill, and keep them down
        (replicas 0) until ``start``: no cleanup, no goodbye (the Lease is not released either)."""
        pods = self.pods()
        for pod in pods:
            self.kill_container(pod)
        self.cluster.kubectl("scale", "deployment", self.fullname, "-n", self.namespace, "--replicas=0")
        # The killed pods go at once: deleted gracefully, each would first sit out its preStop sleep
        # (5 s) with nothing left in it to stop. Should the kubelet have restarted a killed container
        # before it saw the deletion, that process is stopped too before this returns. (Once the
        # ReplicaSet wants none: a pod deleted before that would be replaced.)
        wait_for(self._scaled_to_none, 60, "the operator's ReplicaSets scaled to none")
        self.cluster.kubectl("delete", "pods", "-n", self.namespace, "-l", self._pod_selector,
                             "--grace-period=0", "--force", "--ignore-not-found", check=False)
        wait_for(lambda: not self.pods(), 120, "the operator pod gone")
        uids = {pod["metadata"]["uid"] for pod in pods}
        wait_for(lambda: not self._running_containers(uids), 60, "the killed pods' containers stopped on the node")

    def kill_container(self, pod: dict[str, Any] | str) -> str:
        """SIGKILL the operator container of one pod (its object, or its name) through the node's
        containerd; the kubelet then restarts it in the same pod. Returns the killed container's id."""
        if isinstance(pod, str):
            pod = next(p for p in self.pods() if p["metadata"]["name"] == pod)
        for status in pod.get("status", {}).get("containerStatuses", []):
            if status["name"] == "operator" and status.get("containerID", "").startswith("containerd://"):
                cid = str(status["containerID"]).removeprefix("containerd://")
                assert self.cluster.node is not None
                self.cluster.node.ctr("tasks", "kill", "--signal", "SIGKILL", cid)
                return cid
        return ""

    def _scaled_to_none(self) -> bool:
        sets = self.cluster.get(f"/apis/apps/v1/namespaces/{self.namespace}/replicasets",
                                labelSelector=self._pod_selector)["items"]
        # Wanted none, and the ReplicaSet controller has seen it (its status observed this generation): a
        # controller still behind (a kube-apiserver restart just before) would replace a pod deleted now.
        return bool(sets) and all(rs["spec"].get("replicas") == 0 and (rs.get("status") or {}).get(
            "observedGeneration", 0) >= rs["metadata"].get("generation", 0) for rs in sets)

    def _running_containers(self, pod_uids: set[str]) -> list[str]:
        """The ids of the node's running containers (pause sandboxes excepted) of the pods ``pod_uids``."""
        assert self.cluster.node is not None
        ids: list[str] = []
        for uid in pod_uids:
            out = self.cluster.node.ctr("containers", "ls", "-q",  # one filter: its comma-separated parts all hold
                                        f'labels."io.kubernetes.pod.uid"=={uid},labels."io.cri-containerd.kind"==container')
            ids += out.stdout.decode().split()
        if not ids:
            return []
        tasks = self.cluster.node.ctr("tasks", "ls").stdout.decode().splitlines()[1:]  # TASK PID STATUS
        running = {line.split()[0] for line in tasks if line.split()[-1:] == ["RUNNING"]}
        return [i for i in ids if i in running]

    # -- views ------------------------------------------------------------------------------------

    @property
    def _pod_selector(self) -> str:
        return f"app.kubernetes.io/instance={self.release},app.kubernetes.io/component=operator"

    def pods(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.cluster.get(f"/api/v1/namespaces/{self.namespace}/pods",
                                                       labelSelector=self._pod_selector)["items"]
        return items

    def _ready(self) -> bool:
        pods = self.pods()
        if len(pods) > self.replicas or any(p["metadata"].get("deletionTimestamp") for p in pods):
            # A rollout (an upgrade's new values, a restart) is still finishing: a pod of the old
            # revision is going (preStop sleep, graceful stop). The next test must not meet it.
            return False
        ready = {p["metadata"]["name"] for p in pods
                 if any(c.get("type") == "Ready" and c.get("status") == "True"
                        for c in p.get("status", {}).get("conditions", []))}
        if len(ready) < self.replicas or self.leader() not in ready:
            return False  # and after a kill, the new pod reconciles once the old one's Lease ran out
        webhooks = False
        for kind in ("validatingwebhookconfigurations", "mutatingwebhookconfigurations"):
            config = self.cluster.get(f"/apis/admissionregistration.k8s.io/v1/{kind}/{self.webhook_configuration}")
            webhooks = webhooks or config is not None
            if config is not None and not all(h.get("clientConfig", {}).get("caBundle") for h in config["webhooks"]):
                return False
        # Ready pods are not yet a Service kube-proxy sends to: the first Flow after an install
        # could meet "connection refused". A Flow the webhook checks, created as a server dry run,
        # says the webhook answers through its Service.
        return not webhooks or self._webhook_answers()

    def _webhook_answers(self) -> bool:
        probe = {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": "readiness-probe"},
                 "spec": {"flowRef": "probe.flows:Probe", "suspend": True, "inputs": {"probe": True}}}
        out = self.cluster.kubectl("create", "--dry-run=server", "-n", self.namespace, "-f", "-",
                                   input=json.dumps(probe), check=False)
        return out.returncode == 0 or "failed calling webhook" not in out.stderr

    @property
    def lease_name(self) -> str:
        return f"{self.fullname}-operator"

    def lease(self) -> dict[str, Any]:
        """The spec of the Lease whose holder reconciles ({} when there is none yet)."""
        lease = self.cluster.get(f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases/{self.lease_name}")
        spec: dict[str, Any] = (lease or {}).get("spec") or {}
        return spec

    def leader(self) -> str:
        """The name of the pod holding the Lease ("" when none does)."""
        return str(self.lease().get("holderIdentity") or "")

    def console_url(self) -> str:
        """The chart's web console through its Service (this host routes to ClusterIPs), as a user's
        browser reaches it through an Ingress or `kubectl port-forward`."""
        ip = self.cluster.kubectl("get", "service", f"{self.fullname}-console", "-n", self.namespace,
                                  "-o", "jsonpath={.spec.clusterIP}").stdout.strip()
        return f"http://{ip}"

    def pod_ip(self, name: str) -> str:
        return self.cluster.kubectl("get", "pod", name, "-n", self.namespace,
                                    "-o", "jsonpath={.status.podIP}").stdout.strip()

    def pod_metrics(self, name: str) -> str:
        """/metrics of one replica, from its pod IP (this host routes to the pod network), as a
        Prometheus scraping every endpoint reads it."""
        return self.read_metrics(f"http://{self.pod_ip(name)}:9090/metrics")

    def metrics_token(self) -> str:
        """A token of the ServiceAccount `metrics-scraper` (release namespace), bound to the chart's
        metrics-reader ClusterRole as a user binds their Prometheus's; "" with metrics.auth off."""
        if "metrics.auth.enabled=false" in self.values:
            return ""
        if not self._metrics_token:
            ns, sa = self.namespace, "metrics-scraper"
            if self.cluster.kubectl("get", "serviceaccount", sa, "-n", ns, check=False).returncode != 0:
                self.cluster.kubectl("create", "serviceaccount", sa, "-n", ns)
            binding = f"{self.fullname}-metrics-scraper"
            if self.cluster.kubectl("get", "clusterrolebinding", binding, check=False).returncode != 0:
                self.cluster.kubectl("create", "clusterrolebinding", binding,
                                     f"--clusterrole={self.fullname}-metrics-reader", f"--serviceaccount={ns}:{sa}")
            self._metrics_token = self.cluster.kubectl("create", "token", sa, "-n", ns,
                                                       "--duration=48h").stdout.strip()
        return self._metrics_token

    @property
    def webhook_configuration(self) -> str:
        return f"{self.fullname}-{self.namespace}.flowkube.io"

    def _service_ip(self, name: str) -> str:
        return self.cluster.kubectl("get", "service", name, "-n", self.namespace,
                                    "-o", "jsonpath={.spec.clusterIP}").stdout.strip()

    @property
    def metrics_target(self) -> str:
        """host:port of the chart's metrics Service, what a Prometheus in the cluster scrapes. With
        several replicas (the Service picks one per connection), the leader's pod: only it exports
        the per-flow series."""
        if self.replicas > 1:
            return f"{self.pod_ip(self.leader())}:9090"
        return f"{self._service_ip(f'{self.fullname}-metrics')}:9090"

    @property
    def state_url(self) -> str:
        """The state API through its Service's ClusterIP (its certificate names the Service)."""
        return f"https://{self._service_ip(f'{self.fullname}-webhook')}:8443"

    @property
    def state_server_name(self) -> str:
        return f"{self.fullname}-webhook.{self.namespace}.svc"

    def ca_file(self) -> Path:
        out = self.cluster.kubectl("get", "secret", f"{self.fullname}-ca", "-n", self.namespace, "-o", "json")
        data = json.loads(out.stdout).get("data", {})
        path = self.cluster.root / f"{self.release}-ca.crt"
        path.write_bytes(base64.b64decode(data["ca.crt"]))
        return path

    def logs(self) -> str:
        """The operator's log, this container's and the one before a restart."""
        text = ""
        for pod in self.pods():
            for previous in ("--previous", ""):
                out = self.cluster.kubectl("logs", pod["metadata"]["name"], "-n", self.namespace, "-c", "operator",
                                           *([previous] if previous else []), check=False)
                text += out.stdout
        return text

    def diagnose(self) -> str:
        """Pods and events, why each operator container last ended (OOMKilled, a failed liveness probe's
        exit, an error), and the tails of the log before that restart and of the current one."""
        out = self.cluster.kubectl("get", "pods,events", "-n", self.namespace, "-o", "wide", check=False)
        text = f"{out.stdout}{out.stderr}"
        for pod in self.pods():
            name = pod["metadata"]["name"]
            for status in pod.get("status", {}).get("containerStatuses", []):
                ended = status.get("lastState", {}).get("terminated")
                if status["name"] != "operator" or not ended:
                    continue
                text += (f"\n--- {name}: the operator's last container ended {ended.get('reason')} "
                         f"(exit {ended.get('exitCode')}) at {ended.get('finishedAt')}, "
                         f"started {ended.get('startedAt')}")
                before = self.cluster.kubectl("logs", name, "-n", self.namespace, "-c", "operator", "--previous",
                                              check=False)
                text += f"\n--- {name}: its log (tail)\n{before.stdout[-2500:]}"
            now = self.cluster.kubectl("logs", name, "-n", self.namespace, "-c", "operator", check=False)
            text += f"\n--- {name}: the operator's log now (tail)\n{now.stdout[-2500:]}"
        return text
