"""The node: registration, heartbeats, the pod watch, and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp

from flowkube_devstack import versions
from flowkube_devstack.node import podspec, server
from flowkube_devstack.node.kubeapi import MERGE_PATCH, Api, ApiError, ssl_context_from_kubeconfig
from flowkube_devstack.node.podspec import Obj
from flowkube_devstack.node.runtime import NodeContext, PodWorker, Standby, closed_runtime_paths

log = logging.getLogger("flowkube.node")

LEASE_SECONDS, LEASE_RENEW = 40, 10.0  # kubelet's defaults
STATUS_EVERY = 60.0
WATCH_SECONDS = 300
MAX_BACKOFF = 2.0  # a local API server comes back within seconds
NETWORK_ERRORS = (aiohttp.ClientError, OSError, TimeoutError)


def mount_namespaces_work() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "--uts", "true"], capture_output=True, check=False)
    return probe.returncode == 0


def container_path() -> str:
    """The agent's PATH, with its Python environment first, so `python` and the project's scripts
    resolve in containers even when the environment was never activated."""
    env_bin = str(Path(sys.executable).parent)
    parts = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(":")
    return ":".join(parts if env_bin in parts else [env_bin, *parts])


def capacity(state_dir: Path) -> dict[str, str]:
    mem_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:"))
    disk = shutil.disk_usage(state_dir)
    return {"cpu": str(os.cpu_count() or 1), "memory": f"{mem_kib}Ki", "pods": "110",
            "ephemeral-storage": f"{disk.total // 1024}Ki"}


class Agent:
    def __init__(self, *, kubeconfig: Path, name: str, state_dir: Path, api_port: int,
                 serving_cert: Path, serving_key: Path, client_ca: Path) -> None:
        self.name = name
        self.kubeconfig = kubeconfig
        self.state_dir = state_dir
        self.api_port = api_port
        self.tls_files = (serving_cert, serving_key, client_ca)
        self.workers: dict[str, PodWorker] = {}
        self.node_uid = ""
        self.port = 0
        self._pruned = False
        self._stop = asyncio.Event()

    # -- entry ------------------------------------------------------------------------------------

    async def run(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir.chmod(0o700)  # pod volumes hold secrets
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        server_url, tls = ssl_context_from_kubeconfig(self.kubeconfig)
        api = Api(server_url, tls)
        alloc = capacity(self.state_dir)
        closed = closed_runtime_paths()
        if closed[1]:
            log.info("non-root containers see %s through a tmpfs over %s", closed[0], closed[1])
        self.ctx = NodeContext(api, self.name, self.state_dir, self.api_port, alloc,
                               namespaces=mount_namespaces_work(), path=container_path(),
                               standby=Standby(), runtime_paths=closed[0], runtime_closed=closed[1])
        self.ctx.standby.prime()
        if not self.ctx.namespaces:
            log.warning("private mount namespaces unavailable: pods with volume mounts will fail")
        http = await server.start(self, *self.tls_files)
        try:
            await self._register()
            tasks = [asyncio.create_task(c) for c in (self._lease_loop(), self._status_loop(),
                                                        self._watch_pods())]
            await self._stop.wait()
            log.info("shutting down: stopping %d pods", len(self.workers))
            for t in tasks:
                t.cancel()
            await self._stop_pods()
        finally:
            await self.ctx.standby.close()
            await http.cleanup()
            await api.close()

    async def _stop_pods(self) -> None:
        workers = list(self.workers.values())
        for w in workers:
            w.shutdown()
        if workers:
            await asyncio.wait([asyncio.create_task(w.stopped()) for w in workers],
                               timeout=self.ctx.shutdown_grace + 2)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):
                    await asyncio.gather(*(w.flush_status() for w in workers))

    def find(self, namespace: str, name: str) -> PodWorker | None:
        return next((w for w in self.workers.values()
                     if w.pod["metadata"]["namespace"] == namespace
                     and w.pod["metadata"]["name"] == name), None)

    # -- node -------------------------------------------------------------------------------------

    def _node_status(self) -> Obj:
        t = podspec.now()
        def cond(type_: str, ok: bool, reason: str, message: str) -> Obj:
            return {"type": type_, "status": "True" if ok else "False", "reason": reason,
                    "message": message, "lastHeartbeatTime": t, "lastTransitionTime": self._since}
        uname = platform.uname()
        return {
            "capacity": self.ctx.allocatable, "allocatable": self.ctx.allocatable,
            "conditions": [
                cond("MemoryPressure", False, "KubeletHasSufficientMemory", "no memory pressure"),
                cond("DiskPressure", False, "KubeletHasNoDiskPressure", "no disk pressure"),
                cond("PIDPressure", False, "KubeletHasSufficientPID", "no PID pressure"),
                cond("Ready", True, "KubeletReady",
                     "flowkube node agent is posting ready status (pods run as host processes)"),
            ],
            "addresses": [{"type": "InternalIP", "address": podspec.HOST_IP},
                          {"type": "Hostname", "address": self.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.port}},
            "nodeInfo": {
                "machineID": _read("/etc/machine-id"), "systemUUID": _read("/etc/machine-id"),
                "bootID": _read("/proc/sys/kernel/random/boot_id"),
                "kernelVersion": uname.release, "osImage": _os_image(),
                "containerRuntimeVersion": "flowkube-host-process://0.1.0",
                "kubeletVersion": versions.KUBERNETES_VERSION,
                "kubeProxyVersion": "", "operatingSystem": "linux",
                "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(uname.machine, uname.machine),
            },
        }

    async def _register(self) -> None:
        self._since = podspec.now()
        labels = {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux",
                  "kubernetes.io/arch": self._node_status()["nodeInfo"]["architecture"]}
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.name, "labels": labels}, "status": self._node_status()}
        delay = 0.2
        while True:
            try:
                try:
                    node = await self.ctx.api.request("POST", "/api/v1/nodes", body)
                except ApiError as exc:
                    if exc.status != 409:
                        raise
                    node = await self.ctx.api.request("GET", f"/api/v1/nodes/{self.name}")
                self.node_uid = node["metadata"]["uid"]
                await self._post_status()
                log.info("node %s registered (kubelet endpoint port %d)", self.name, self.port)
                return
            except (ApiError, *NETWORK_ERRORS) as exc:
                log.warning("registering node failed (retrying in %.1fs): %s", delay, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF)

    async def _post_status(self) -> None:
        await self.ctx.api.request("PATCH", f"/api/v1/nodes/{self.name}/status",
                                   {"status": self._node_status()}, content_type=MERGE_PATCH)

    async def _status_loop(self) -> None:
        while True:
            await asyncio.sleep(STATUS_EVERY)
            try:
                await self._post_status()
            except ApiError as exc:
                if exc.status == 404:
                    await self._register()
                else:
                    log.warning("node status update failed: %s", exc)
            except NETWORK_ERRORS as exc:
                log.warning("node status update failed: %s", exc)

    async def _lease_loop(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}"
        while True:
            spec = {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_SECONDS,
                    "renewTime": podspec.now_micro()}
            try:
                try:
                    await self.ctx.api.request("PATCH", path, {"spec": spec}, content_type=MERGE_PATCH)
                except ApiError as exc:
                    if exc.status != 404:
                        raise
                    await self.ctx.api.request("POST", path.rsplit("/", 1)[0], {
                        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                        "metadata": {"name": self.name, "namespace": "kube-node-lease",
                                     "ownerReferences": [{"apiVersion": "v1", "kind": "Node",
                                                          "name": self.name, "uid": self.node_uid}]},
                        "spec": spec})
            except (ApiError, *NETWORK_ERRORS) as exc:
                log.warning("lease renewal failed: %s", exc)
                await asyncio.sleep(1.0)
                continue
            await asyncio.sleep(LEASE_RENEW)

    # -- pods -------------------------------------------------------------------------------------

    async def _watch_pods(self) -> None:
        """List, then watch from the list's resourceVersion; re-list after 410 Gone."""
        params = {"fieldSelector": f"spec.nodeName={self.name}"}
        rv = ""
        delay = 0.1
        while True:
            try:
                if not rv:
                    listing = await self.ctx.api.request("GET", "/api/v1/pods", params=params)
                    rv = listing["metadata"]["resourceVersion"]
                    self._sync(listing["items"])
                events = self.ctx.api.watch("/api/v1/pods", {
                    **params, "resourceVersion": rv, "allowWatchBookmarks": "true",
                    "timeoutSeconds": str(WATCH_SECONDS)})
                async with contextlib.aclosing(events):
                    async for event in events:
                        kind, obj = event["type"], event["object"]
                        if kind == "ERROR":
                            if obj.get("code") == 410:
                                rv = ""
                                break
                            raise ApiError(int(obj.get("code", 500)), "WATCH", "/api/v1/pods", obj)
                        rv = obj["metadata"]["resourceVersion"]
                        log.debug("watch %s %s/%s rv=%s deleting=%s", kind,
                                  obj["metadata"].get("namespace"), obj["metadata"].get("name"), rv,
                                  bool(obj["metadata"].get("deletionTimestamp")))
                        if kind == "DELETED":
                            self._gone(obj["metadata"]["uid"], obj)
                        elif kind in ("ADDED", "MODIFIED"):
                            self._seen(obj)
                delay = 0.1
                continue
            except ApiError as exc:
                if exc.status == 410:
                    rv = ""
                    continue
                log.warning("pod watch failed (retrying in %.1fs): %s", delay, exc)
            except (*NETWORK_ERRORS, ValueError) as exc:
                log.warning("pod watch interrupted (retrying in %.1fs): %r", delay, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF)

    def _sync(self, pods: list[Obj]) -> None:
        present = {p["metadata"]["uid"] for p in pods}
        if not self._pruned:  # state of pods deleted while no agent ran
            self._pruned = True
            for d in (self.state_dir / "pods").glob("*"):
                if d.name not in present:
                    shutil.rmtree(d, ignore_errors=True)
        for uid in [u for u in self.workers if u not in present]:
            self._gone(uid)
        for pod in pods:
            self._seen(pod)

    def _seen(self, pod: Obj) -> None:
        uid = pod["metadata"]["uid"]
        worker = self.workers.get(uid)
        if worker is not None:
            worker.update(pod)
            return
        worker = PodWorker(self.ctx, pod)
        self.workers[uid] = worker
        worker.task.add_done_callback(lambda t: self._reap(uid, t))

    def _gone(self, uid: str, final: Obj | None = None) -> None:
        if uid in self.workers:
            self.workers[uid].deleted(final)

    def _reap(self, uid: str, task: asyncio.Task[Any]) -> None:
        self.workers.pop(uid, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("pod worker %s failed", uid, exc_info=task.exception())


def _read(path: str) -> str:
    with contextlib.suppress(OSError):
        return Path(path).read_text().strip()
    return ""


def _os_image() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    return "Linux"
