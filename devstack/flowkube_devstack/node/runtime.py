"""One PodWorker per pod bound to the node: volumes, container processes, status, termination."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import marshal
import os
import pwd
import shutil
import signal
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from flowkube_devstack.node import podspec
from flowkube_devstack.node.kubeapi import MERGE_PATCH, Api, ApiError
from flowkube_devstack.node.podspec import ConfigError, ContainerRecord, Obj, PodRecord

log = logging.getLogger("flowkube.node")

SPAWN_SCRIPT = Path(__file__).with_name("spawn.py")
BACKOFF_START, BACKOFF_MAX = 10.0, 300.0  # kubelet's CrashLoopBackOff
DEFAULT_TERMINATION_LOG = "/dev/termination-log"


@dataclass
class Helper:
    """A started spawn.py waiting on its stdin for a container spec."""

    proc: asyncio.subprocess.Process
    status_fd: int
    spec_fd: int

    async def hand_over(self, spec: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            if len(spec) <= 65536:  # fits the pipe buffer: cannot block
                os.write(self.spec_fd, spec)
            else:
                await loop.run_in_executor(None, _write_all, self.spec_fd, spec)
        finally:
            os.close(self.spec_fd)

    def discard(self) -> None:
        os.close(self.spec_fd)  # the helper reads EOF and exits
        os.close(self.status_fd)


class Standby:
    """Keeps one container start-up helper ready, so Python's start-up (10-30 ms on a busy machine)
    is paid before a pod arrives rather than after."""

    def __init__(self) -> None:
        self._next: asyncio.Task[Helper] | None = None

    def prime(self) -> None:
        self._next = asyncio.create_task(self._start())

    async def take(self) -> Helper:
        ready = self._next or asyncio.create_task(self._start())
        self._next = asyncio.create_task(self._start())
        return await ready

    async def close(self) -> None:
        if self._next is not None:
            with contextlib.suppress(Exception):
                (await self._next).discard()

    @staticmethod
    async def _start() -> Helper:
        status_r, status_w = os.pipe()
        spec_r, spec_w = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", str(SPAWN_SCRIPT), str(status_w), str(os.getpid()),
                stdin=spec_r, stdout=asyncio.subprocess.DEVNULL, pass_fds=(status_w,),
                start_new_session=True, cwd="/")
        except BaseException:
            os.close(status_r)
            os.close(spec_w)
            raise
        finally:
            os.close(status_w)
            os.close(spec_r)
        return Helper(proc, status_r, spec_w)


def closed_runtime_paths() -> tuple[list[str], list[str]]:
    """The agent's Python environment directories that a non-root user cannot reach, and the
    topmost ancestors closing them (e.g. pyenv under a 0700 /root)."""
    wanted = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, *sys.path)
              if p and Path(p).is_dir()}
    paths, closed = [], set()
    for p in sorted(wanted):
        shut = [a for a in reversed(Path(p).parents) if not Path(a).stat().st_mode & stat.S_IXOTH]
        if shut:
            paths.append(p)
            closed.add(str(shut[0]))
    top = sorted(c for c in closed if not any(Path(c).is_relative_to(o) and c != o for o in closed))
    return [p for p in paths if not any(Path(p).is_relative_to(q) and p != q for q in paths)], top


def runtime_keep_paths() -> list[str]:
    """Host directories a pod's program needs, whatever its volumes cover: the agent's Python
    environment and the project it runs from (editable installs point there). A volume mounted
    over one of them (an emptyDir at /tmp, with the checkout under /tmp) must not hide it."""
    wanted = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, *sys.path, str(Path.cwd()),
                                            str(Path(__file__).resolve().parents[3]))
              if p and Path(p).is_dir() and os.path.realpath(p) != "/"}
    return sorted(p for p in wanted if not any(Path(p).is_relative_to(q) and p != q for q in wanted))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@dataclass
class NodeContext:
    api: Api
    node_name: str
    state_dir: Path
    api_port: int
    allocatable: dict[str, str]
    namespaces: bool  # private mount namespaces work (root + unshare)
    path: str  # PATH for containers: the agent's, with its Python environment's bin first
    standby: Standby
    runtime_paths: list[str]  # see closed_runtime_paths
    runtime_closed: list[str]
    runtime_keep: list[str] = field(default_factory=runtime_keep_paths)
    shutdown_grace: float = 8.0


async def read_until_eof(fd: int) -> bytes:
    """Read a pipe without blocking the loop or holding a thread."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if chunk:
            chunks.append(chunk)
        elif not done.done():
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return b"".join(chunks)


def write_atomic_volume(directory: Path, payload: podspec.Payload, gid: int | None) -> None:
    """kubelet's AtomicWriter layout: files in a timestamped dir, `..data` swapped by rename."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755 if gid is None else 0o2775)
    stamp = directory / f"..{time.time_ns()}"
    stamp.mkdir()
    stamp.chmod(0o755)
    for rel, (content, mode) in payload.items():
        path = stamp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(mode)
        if gid is not None:
            os.chown(path, -1, gid)
    tmp = directory / "..data_tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(stamp.name)
    tmp.replace(directory / "..data")
    tops = {rel.split("/", 1)[0] for rel in payload}
    for entry in directory.iterdir():
        if entry.name.startswith(".."):
            if entry.is_dir() and not entry.is_symlink() and entry != stamp:
                shutil.rmtree(entry)
        elif entry.is_symlink() and entry.name not in tops:
            entry.unlink()
    for top in tops:
        link = directory / top
        if not link.is_symlink():
            link.symlink_to(f"..data/{top}")


class PodWorker:
    def __init__(self, ctx: NodeContext, pod: Obj) -> None:
        self.ctx = ctx
        self.pod = pod
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.key = f"{meta['namespace']}/{meta['name']}"
        self.dir: Path = ctx.state_dir / "pods" / self.uid
        self.rec = PodRecord.for_pod(pod)
        known_start = (pod.get("status") or {}).get("startTime")
        self.rec.start_time = known_start or podspec.now()
        self.started_wall = podspec.parse_time(known_start).timestamp() if known_start else time.time()
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.envs: dict[str, dict[str, str]] = {}
        self.tokens: dict[tuple[str, int], str] = {}
        self.stopping = ""
        self.gone = False
        self.seen_at = time.monotonic()
        self._changed = asyncio.Event()
        self._stop_event = asyncio.Event()
        self._kill_at = 0.0
        self._status_gen = self._written_gen = 0
        self._status_dirty = asyncio.Event()
        self._status_written = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._lifecycle: asyncio.Task[None] | None = None
        self._deleting = False
        self._objects: podspec.Objects = {}
        self.task = asyncio.create_task(self._run(), name=f"pod {self.key}")

    # -- inputs from the agent --------------------------------------------------------------------

    def update(self, pod: Obj) -> None:
        self.pod = pod
        self._changed.set()

    def deleted(self, final: Obj | None = None) -> None:
        if final is not None:
            self.pod = final
        self.gone = True
        self._changed.set()

    def shutdown(self) -> None:
        if self._lifecycle is not None and not self._lifecycle.done():
            self.rec.reason = "Terminated"
            self.rec.message = "Pod was terminated in response to imminent node shutdown."
            self.stop("NodeShutdown", min(self._grace(), self.ctx.shutdown_grace))

    async def stopped(self) -> None:
        if self._lifecycle is not None:
            await asyncio.wait([self._lifecycle])

    # -- control ----------------------------------------------------------------------------------

    def _grace(self) -> float:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        grace = meta.get("deletionGracePeriodSeconds", spec.get("terminationGracePeriodSeconds", 30))
        # kubelet's minimumGracePeriodInSeconds: even a forced deletion gets a moment after SIGTERM.
        return max(float(grace if grace is not None else 30), 2.0)

    async def _run(self) -> None:
        self._tasks.append(asyncio.create_task(self._status_writer()))
        status = self.pod.get("status") or {}
        if status.get("phase") not in ("Succeeded", "Failed") and self._adopt(status):
            self._lifecycle = asyncio.create_task(self._run_lifecycle())
            deadline = self.pod["spec"].get("activeDeadlineSeconds")
            if deadline is not None:
                self._tasks.append(asyncio.create_task(self._deadline(float(deadline))))
        while not self.gone:
            self._react()
            waiter = asyncio.create_task(self._changed.wait())
            waits: set[asyncio.Task[Any]] = {waiter}
            if self._lifecycle is not None and not self._lifecycle.done():
                waits.add(self._lifecycle)
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            self._changed.clear()
        if self._lifecycle is not None and not self._lifecycle.done():
            self.stop("PodDeleted", self._grace())
            await self._lifecycle
        for t in self._tasks:
            t.cancel()
        shutil.rmtree(self.dir / "volumes", ignore_errors=True)

    def _react(self) -> None:
        if not self.pod["metadata"].get("deletionTimestamp"):
            return
        if self._lifecycle is not None and not self._lifecycle.done():
            self.stop("PodDeleted", self._grace())
        elif self._written_gen == self._status_gen and not self._deleting:
            self._deleting = True  # the final status is in: now the pod may go, as kubelet does
            self._tasks.append(asyncio.create_task(self._delete()))

    def stop(self, reason: str, grace: float) -> None:
        """SIGTERM every container now, SIGKILL at the deadline; a later, shorter grace wins."""
        kill_at = time.monotonic() + max(grace, 0.0)
        first = not self.stopping
        if first:
            self.stopping = reason
            self._stop_event.set()
            log.info("stopping pod %s (%s, grace %.0fs)", self.key, reason, grace)
        if first or kill_at < self._kill_at:
            self._kill_at = kill_at
            self._tasks.append(asyncio.create_task(self._kill_all(first)))

    async def _kill_all(self, send_term: bool) -> None:
        if send_term:
            for name, proc in list(self.procs.items()):
                self.event("Normal", "Killing", f"Stopping container {name}")
                _signal_group(proc.pid, signal.SIGTERM)
        while self.procs and time.monotonic() < self._kill_at:
            await asyncio.wait([asyncio.create_task(p.wait()) for p in self.procs.values()],
                               timeout=self._kill_at - time.monotonic())
        for proc in list(self.procs.values()):
            _signal_group(proc.pid, signal.SIGKILL)

    async def _deadline(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, self.started_wall + seconds - time.time()))
        if not self.stopping and self.rec.phase() not in ("Succeeded", "Failed"):
            self.rec.reason = "DeadlineExceeded"
            self.rec.message = "Pod was active on the node longer than the specified deadline"
            self.event("Normal", "DeadlineExceeded", self.rec.message)
            self.mark_dirty()
            self.stop("DeadlineExceeded", self._grace())

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop_event.wait(), seconds)

    def _adopt(self, status: Obj) -> bool:
        """Containers a previous agent started died with it (parent-death signal): report them as
        kubelet reports lost containers, then apply the restart policy. True if anything is to run."""
        old = {c["name"]: c for c in [*(status.get("initContainerStatuses") or []),
                                      *(status.get("containerStatuses") or [])]}
        lost = {"exitCode": 137, "reason": "ContainerStatusUnknown",
                "message": "The container could not be located: the node agent restarted"}
        recs = [r for r in [*self.rec.init, *self.rec.main] if r.name in old]
        never = self.pod["spec"].get("restartPolicy", "Always") == "Never"
        started = False
        for rec in recs:
            previous = old[rec.name]
            rec.restart_count = int(previous.get("restartCount", 0))
            rec.last_state = previous.get("lastState") or {}
            state = previous.get("state") or {}
            if "running" in state or "terminated" in state:
                started = True
                ended = state.get("terminated") or lost
                if never:
                    rec.state, rec.final = {"terminated": ended}, True
                else:
                    rec.restart_count += 1
                    rec.last_state = {"terminated": ended}
        if never and started:
            for rec in [*self.rec.init, *self.rec.main]:
                if not rec.final:
                    rec.state, rec.final = {"terminated": lost}, True
            self.rec.initialized = True
            self._finish()
        return not (never and started)

    # -- lifecycle --------------------------------------------------------------------------------

    async def _run_lifecycle(self) -> None:
        try:
            await self._lifecycle_steps()
        except Exception:
            log.exception("pod %s: node agent error", self.key)
            self.rec.reason, self.rec.message = "NodeAgentError", "the node agent failed; see its log"
            self.stop("NodeAgentError", 0)
        finally:
            self._finish()

    async def _lifecycle_steps(self) -> None:
        self.mark_dirty()
        if not await self._prepare():
            return
        spec = self.pod["spec"]
        by_name = {c["name"]: c for c in podspec.iter_containers(self.pod)}
        for rec in self.rec.init:
            if not await self._run_container(by_name[rec.name], rec, init=True):
                return
        self.rec.initialized = True
        if not spec.get("initContainers"):
            for rec in self.rec.main:
                rec.state = {"waiting": {"reason": "ContainerCreating"}}
        self.mark_dirty()
        await asyncio.gather(*(self._run_container(by_name[r.name], r, init=False)
                               for r in self.rec.main))

    def _finish(self) -> None:
        for rec in [*self.rec.init, *self.rec.main]:
            if "terminated" not in rec.state:
                rec.state = {"terminated": {
                    "exitCode": 137, "reason": "ContainerStatusUnknown",
                    "message": "The container could not be located when the pod was terminated"}}
            rec.final = True
        self.mark_dirty()
        log.info("pod %s finished: %s", self.key, self.rec.phase())

    async def _prepare(self) -> bool:
        delay = 1.0
        while not self.stopping:
            try:
                await self._materialise()
                self.rec.sandbox_ready = True
                return True
            except (ConfigError, ApiError, aiohttp.ClientError, TimeoutError, OSError) as exc:
                reason = "CreateContainerConfigError" if isinstance(exc, ConfigError) else \
                    "ContainerCreating"
                log.warning("pod %s: %s: %s", self.key, reason, exc)
                self.event("Warning", "Failed" if isinstance(exc, ConfigError) else "FailedMount",
                           f"Error: {exc}")
                for rec in [*self.rec.init, *self.rec.main]:
                    rec.state = {"waiting": {"reason": reason, "message": str(exc)}}
                self.mark_dirty()
            await self._sleep(delay)
            delay = min(delay * 2, 10.0)
        return False

    async def _fetch(self, path: str) -> Obj | None:
        """GET with retries on 403: the Node authorizer learns of a fresh binding a moment late."""
        delay = 0.01
        while True:
            try:
                return await self.ctx.api.request("GET", path)
            except ApiError as exc:
                if exc.status == 404:
                    return None
                if exc.status != 403 or delay > 3:
                    raise
                log.debug("pod %s: %s forbidden, retrying in %.2fs", self.key, path, delay)
            await asyncio.sleep(delay)
            delay *= 2

    async def _request_token(self, audience: str, seconds: int) -> str:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        sa = spec.get("serviceAccountName") or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
            "audiences": [audience] if audience else None, "expirationSeconds": seconds,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                               "uid": meta["uid"]}}}
        path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{sa}/token"
        delay = 0.01
        while True:
            try:
                return str((await self.ctx.api.request("POST", path, body))["status"]["token"])
            except ApiError as exc:
                if exc.status != 403 or delay > 3:
                    raise
            await asyncio.sleep(delay)
            delay *= 2

    async def _materialise(self) -> None:
        ns = self.pod["metadata"]["namespace"]
        refs = sorted(podspec.object_refs(self.pod))
        token_keys = sorted(podspec.token_requests(self.pod))
        plural = {"Secret": "secrets", "ConfigMap": "configmaps"}
        found, tokens = await asyncio.gather(
            asyncio.gather(*(self._fetch(f"/api/v1/namespaces/{ns}/{plural[k]}/{n}") for k, n in refs)),
            asyncio.gather(*(self._request_token(a, s) for a, s in token_keys)))
        self.tokens = dict(zip(token_keys, tokens, strict=True))
        objects = {ref: podspec.decode_data(o) if o else None for ref, o in zip(refs, found, strict=True)}
        log.debug("pod %s: API objects and tokens in %.0f ms", self.key,
                  1000 * (time.monotonic() - self.seen_at))
        for c in podspec.iter_containers(self.pod):
            self.envs[c["name"]] = podspec.container_env(self.pod, c, objects, self.ctx.api_port,
                                                         self.ctx.allocatable)
            _credentials(self.pod, c)  # fail early on runAsNonRoot
        self._objects = objects
        self._write_volumes()
        if token_keys and not any(t.get_name() == "tokens" for t in self._tasks):
            self._tasks.append(asyncio.create_task(self._refresh_tokens(), name="tokens"))

    def _write_volumes(self) -> None:
        fs_group = (self.pod["spec"].get("securityContext") or {}).get("fsGroup")
        gid = int(fs_group) if fs_group is not None and os.geteuid() == 0 else None
        for vol in self.pod["spec"].get("volumes", []):
            target = self.dir / "volumes" / vol["name"]
            payload = podspec.volume_payload(self.pod, vol, self._objects, self.tokens,
                                             self.ctx.allocatable)
            if payload is not None:
                write_atomic_volume(target, payload, gid)
            elif "emptyDir" in vol:
                target.mkdir(parents=True, exist_ok=True)
                target.chmod(0o777)
            elif "hostPath" not in vol:
                kind = next((k for k in vol if k != "name"), "?")
                raise ConfigError(f"volume {vol['name']!r}: {kind} volumes are not supported "
                                  "by the flowkube node agent")

    async def _refresh_tokens(self) -> None:
        # kubelet refreshes at 80% of the requested lifetime; the API server may extend expiry.
        while True:
            await asyncio.sleep(0.8 * min(s for _, s in self.tokens))
            try:
                keys = list(self.tokens)
                fresh = await asyncio.gather(*(self._request_token(a, s) for a, s in keys))
                self.tokens = dict(zip(keys, fresh, strict=True))
                self._write_volumes()
            except (ApiError, aiohttp.ClientError, TimeoutError, ConfigError, OSError) as exc:
                log.warning("pod %s: token refresh failed: %s", self.key, exc)

    async def _run_container(self, spec: Obj, rec: ContainerRecord, *, init: bool) -> bool:
        """Run one container under the restart policy; True when it ended successfully."""
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if init and policy == "Always":
            policy = "OnFailure"
        backoff = BACKOFF_START
        while True:
            if self.stopping:
                return False
            started = time.monotonic()
            code = await self._start_and_wait(spec, rec)
            self.mark_dirty()
            restart = not self.stopping and (policy == "Always" or (policy == "OnFailure" and code != 0))
            if not restart:
                rec.final = True
                return code == 0
            backoff = BACKOFF_START if time.monotonic() - started > 600 else backoff
            rec.last_state, rec.state = rec.state, {"waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {backoff:.0f}s restarting failed container={rec.name} "
                           f"pod={self.pod['metadata']['name']}_{self.pod['metadata']['namespace']}"
                           f"({self.uid})"}}
            rec.restart_count += 1
            rec.container_id = ""
            self.event("Warning", "BackOff", f"Back-off restarting failed container {rec.name} in pod "
                                             f"{self.pod['metadata']['name']}_{self.pod['metadata']['namespace']}")
            self.mark_dirty()
            await self._sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    async def _start_and_wait(self, spec: Obj, rec: ContainerRecord) -> int:
        name = rec.name
        cdir = self.dir / "containers" / name
        cdir.mkdir(parents=True, exist_ok=True)
        term_log = cdir / "termination-log"
        term_log.write_bytes(b"")
        term_log.chmod(0o666)
        log_file = self.log_path(name, rec.restart_count)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        env = self.envs[name]
        argv = [podspec.expand(a, env) for a in [*spec.get("command", []), *spec.get("args", [])]]
        try:
            if not spec.get("command"):
                raise ConfigError("the flowkube node agent runs containers as host processes and cannot "
                                  "read the image ENTRYPOINT: set `command`")
            proc, status_fd = await self._spawn(spec, argv, env, log_file, term_log)
        except (ConfigError, OSError) as exc:
            return self._terminated(rec, 128, "StartError", str(exc), podspec.now())
        self.procs[name] = proc
        log.debug("pod %s container %s forked at %.0f ms", self.key, name,
                  1000 * (time.monotonic() - self.seen_at))
        if self.stopping:  # the stop raced with the start
            _signal_group(proc.pid, signal.SIGTERM)
            self._tasks.append(asyncio.create_task(self._kill_all(False)))
        rec.container_id = f"flowkube://{self.uid}/{name}/{rec.restart_count}"
        error = await read_until_eof(status_fd)
        started_at = podspec.now()
        if error:
            await proc.wait()
            del self.procs[name]
            return self._terminated(rec, 128, "StartError", error.decode(errors="replace"), started_at)
        log.info("pod %s container %s started pid %d (%.0f ms after the pod was seen)",
                 self.key, name, proc.pid, 1000 * (time.monotonic() - self.seen_at))
        rec.state = {"running": {"startedAt": started_at}}
        self.mark_dirty()
        self.event("Normal", "Started", f"Started container {name} (pid {proc.pid})")
        returncode = await proc.wait()
        del self.procs[name]
        _signal_group(proc.pid, signal.SIGKILL)  # leftovers in the container's session
        code = returncode if returncode >= 0 else 128 - returncode
        tail = _tail(log_file, podspec.FALLBACK_LOG_BYTES) if code != 0 else b""
        message = podspec.termination_message(
            term_log.read_bytes(), tail, code, spec.get("terminationMessagePolicy", "File"))
        return self._terminated(rec, code, "Completed" if code == 0 else "Error", message, started_at)

    def _terminated(self, rec: ContainerRecord, code: int, reason: str, message: str,
                    started_at: str) -> int:
        term: Obj = {"exitCode": code, "reason": reason, "startedAt": started_at,
                     "finishedAt": podspec.now()}
        if rec.container_id:
            term["containerID"] = rec.container_id
        if message:
            term["message"] = message
        rec.state = {"terminated": term}
        if reason == "StartError":
            self.event("Warning", "Failed", f"Error: {message}")
        log.info("pod %s container %s terminated: %s %d", self.key, rec.name, reason, code)
        return code

    async def _spawn(self, spec: Obj, argv: list[str], env: dict[str, str], log_file: Path,
                     term_log: Path) -> tuple[asyncio.subprocess.Process, int]:
        mounts = self._mounts(spec, env, term_log)
        if mounts and not self.ctx.namespaces:
            raise ConfigError("volume mounts need a private mount namespace (root and unshare), "
                              "which this node agent cannot create")
        uid, gid, groups = _credentials(self.pod, spec)
        hostname = (self.pod["spec"].get("hostname") or self.pod["metadata"]["name"])[:63]
        pod_env = {"PATH": self.ctx.path, "HOSTNAME": hostname,
                   "HOME": _home(uid if uid is not None else os.geteuid())}
        pod_env.update(env)
        exec_spec = marshal.dumps({
            "argv": argv, "env": pod_env, "cwd": spec.get("workingDir") or "/", "log": str(log_file),
            "namespaces": self.ctx.namespaces, "hostname": hostname,
            "mounts": mounts, "uid": uid, "gid": gid, "groups": groups,
            "runtime": {"paths": self.ctx.runtime_paths, "closed": self.ctx.runtime_closed,
                        "keep": self.ctx.runtime_keep}
            if uid else {"paths": [], "closed": []},
        })
        helper = await self.ctx.standby.take()
        try:
            await helper.hand_over(exec_spec)
        except OSError:
            os.close(helper.status_fd)
            _signal_group(helper.proc.pid, signal.SIGKILL)
            await helper.proc.wait()
            raise
        return helper.proc, helper.status_fd

    def _mounts(self, spec: Obj, env: dict[str, str], term_log: Path) -> list[Obj]:
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes", [])}
        mounts = []
        for m in spec.get("volumeMounts", []):
            vol = volumes.get(m["name"])
            if vol is None:
                raise ConfigError(f"volumeMount {m['name']!r} names no volume")
            source = Path(vol["hostPath"]["path"]) if "hostPath" in vol else \
                self.dir / "volumes" / m["name"]
            if "hostPath" in vol and vol["hostPath"].get("type") == "DirectoryOrCreate":
                source.mkdir(parents=True, exist_ok=True)
            sub = m.get("subPath") or podspec.expand(m.get("subPathExpr", ""), env)
            if sub:
                source = source / sub
                if not source.exists():
                    source.mkdir(parents=True)
            mounts.append({"source": str(source), "target": m["mountPath"],
                           "readOnly": bool(m.get("readOnly")), "file": source.is_file()})
        mounts.append({"source": str(term_log), "readOnly": False, "file": True,
                       "target": spec.get("terminationMessagePath") or DEFAULT_TERMINATION_LOG})
        # Parents before children, as container runtimes order them.
        return sorted(mounts, key=lambda m: len(Path(m["target"]).parts))

    # -- status and deletion ----------------------------------------------------------------------

    def mark_dirty(self) -> None:
        self._status_gen += 1
        self._status_dirty.set()

    async def _status_writer(self) -> None:
        meta = self.pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        delay = 0.2
        while True:
            await self._status_dirty.wait()
            self._status_dirty.clear()
            gen = self._status_gen
            patch = {"metadata": {"uid": self.uid}, "status": podspec.pod_status(self.pod, self.rec)}
            try:
                await self.ctx.api.request("PATCH", path, patch, content_type=MERGE_PATCH)
                self._written_gen = max(self._written_gen, gen)
                self._status_written.set()
                delay = 0.2
                self._changed.set()
            except (ApiError, aiohttp.ClientError, TimeoutError) as exc:
                if isinstance(exc, ApiError) and exc.status in (404, 409, 422) and self.gone:
                    return
                log.warning("pod %s: status update failed (retrying in %.1fs): %s", self.key, delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                self._status_dirty.set()

    async def flush_status(self) -> None:
        """Wait until the API has the status as of now (callers bound the wait)."""
        gen = self._status_gen
        while self._written_gen < gen:
            self._status_written.clear()
            await self._status_written.wait()

    async def _delete(self) -> None:
        """Remove the terminated pod from the API, as kubelet does once its final status is written."""
        meta = self.pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0,
                "preconditions": {"uid": self.uid}}
        delay = 0.2
        while not self.gone:
            try:
                await self.ctx.api.request("DELETE", path, body)
                return
            except ApiError as exc:
                if exc.status in (404, 409):
                    return
                log.warning("pod %s: delete failed: %s", self.key, exc)
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning("pod %s: delete failed: %s", self.key, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    def event(self, type_: str, reason: str, message: str) -> None:
        """Record an Event for `kubectl describe`, in the background; losing one is harmless."""
        meta, t = self.pod["metadata"], podspec.now()
        body = {
            "apiVersion": "v1", "kind": "Event", "type": type_, "reason": reason, "message": message,
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                               "namespace": meta["namespace"], "uid": self.uid},
            "source": {"component": "flowkube-node", "host": self.ctx.node_name},
            "reportingComponent": "flowkube-node", "reportingInstance": self.ctx.node_name,
            "firstTimestamp": t, "lastTimestamp": t, "count": 1,
        }
        task = asyncio.create_task(self.ctx.api.request(
            "POST", f"/api/v1/namespaces/{meta['namespace']}/events", body))
        _background.add(task)
        task.add_done_callback(_event_done)

    def log_path(self, container: str, restart: int) -> Path:
        return self.dir / "logs" / container / f"{restart}.log"

    def record(self, container: str) -> ContainerRecord | None:
        return next((r for r in [*self.rec.init, *self.rec.main] if r.name == container), None)


_background: set[asyncio.Task[Obj]] = set()


def _event_done(task: asyncio.Task[Obj]) -> None:
    _background.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.debug("event not recorded: %s", task.exception())


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _tail(path: Path, size: int) -> bytes:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - size))
            return f.read()
    except OSError:
        return b""


def _home(uid: int) -> str:
    try:
        return str(pwd.getpwuid(uid).pw_dir)
    except KeyError:
        return "/"


def _credentials(pod: Obj, container: Obj) -> tuple[int | None, int, list[int]]:
    """uid, gid and groups to run as; uid None means the agent's own user."""
    psc = pod["spec"].get("securityContext") or {}
    csc = container.get("securityContext") or {}

    def pick(key: str) -> Any:
        return csc.get(key, psc.get(key))

    uid = pick("runAsUser")
    effective = os.geteuid() if uid is None else int(uid)
    if pick("runAsNonRoot") and effective == 0:
        raise ConfigError("container has runAsNonRoot and the host process would run as root "
                          "(the node agent's user): set runAsUser")
    if uid is None or os.geteuid() != 0:
        return None, os.getegid(), []
    gid = pick("runAsGroup")
    if gid is None:
        try:
            gid = pwd.getpwuid(int(uid)).pw_gid
        except KeyError:
            gid = 0
    groups = [int(g) for g in psc.get("supplementalGroups", [])]
    if psc.get("fsGroup") is not None:
        groups.append(int(psc["fsGroup"]))
    return int(uid), int(gid), groups

