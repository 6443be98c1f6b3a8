"""Pure functions from a Pod and the objects it references to what the agent must do and report.

No I/O here: environment, volume payloads and pod status are computed from plain dicts, so they are
unit-tested without a cluster. Semantics follow kubelet (pkg/kubelet/kubelet_pods.go, status/).
"""

from __future__ import annotations

import base64
import datetime as dt
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

Obj = dict[str, Any]
# ("Secret" | "ConfigMap", name) -> key -> bytes, or None when the object does not exist.
Objects = Mapping[tuple[str, str], Mapping[str, bytes] | None]
# (audience, expirationSeconds) -> token
Tokens = Mapping[tuple[str, int], str]

HOST_IP = "127.0.0.1"
DEFAULT_FILE_MODE = 0o644
MAX_TERMINATION_MESSAGE = 4096
FALLBACK_LOG_BYTES, FALLBACK_LOG_LINES = 2048, 80


class ConfigError(Exception):
    """The pod cannot start as specified (kubelet's CreateContainerConfigError)."""


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


# -- references -----------------------------------------------------------------------------------


def object_refs(pod: Obj) -> set[tuple[str, str]]:
    """Every Secret and ConfigMap the pod's containers and volumes name."""
    refs: set[tuple[str, str]] = set()
    spec = pod["spec"]
    for c in [*spec.get("initContainers", []), *spec.get("containers", [])]:
        for src in c.get("envFrom", []):
            if "secretRef" in src:
                refs.add(("Secret", src["secretRef"]["name"]))
            if "configMapRef" in src:
                refs.add(("ConfigMap", src["configMapRef"]["name"]))
        for env in c.get("env", []):
            vf = env.get("valueFrom", {})
            if "secretKeyRef" in vf:
                refs.add(("Secret", vf["secretKeyRef"]["name"]))
            if "configMapKeyRef" in vf:
                refs.add(("ConfigMap", vf["configMapKeyRef"]["name"]))
    for vol in spec.get("volumes", []):
        sources = [vol, *vol.get("projected", {}).get("sources", [])]
        for src in sources:
            if "secret" in src:
                refs.add(("Secret", src["secret"].get("secretName") or src["secret"].get("name", "")))
            if "configMap" in src:
                refs.add(("ConfigMap", src["configMap"]["name"]))
    return refs


def token_requests(pod: Obj) -> set[tuple[str, int]]:
    out = set()
    for vol in pod["spec"].get("volumes", []):
        for src in vol.get("projected", {}).get("sources", []):
            if "serviceAccountToken" in src:
                t = src["serviceAccountToken"]
                out.add((t.get("audience", ""), int(t.get("expirationSeconds", 3600))))
    return out


def decode_data(obj: Obj) -> dict[str, bytes]:
    if obj.get("kind") == "Secret":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return data


def _lookup(objects: Objects, kind: str, name: str, optional: bool) -> Mapping[str, bytes] | None:
    data = objects.get((kind, name))
    if data is None and not optional:
        raise ConfigError(f'{kind.lower()} "{name}" not found')
    return data


# -- environment ----------------------------------------------------------------------------------

_VAR_REF = re.compile(r"\$\$|\$\(([^)]*)\)")


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: `$$` escapes, unknown references stay verbatim."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))

    return _VAR_REF.sub(sub, value)


def field_value(pod: Obj, path: str) -> str:
    meta = pod["metadata"]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
        "status.hostIP": HOST_IP, "status.hostIPs": HOST_IP,
        "status.podIP": HOST_IP, "status.podIPs": HOST_IP,
    }
    if path in simple:
        return str(simple[path])
    if path in ("metadata.labels", "metadata.annotations"):
        items = sorted((meta.get(path.split(".")[1]) or {}).items())
        return "\n".join(f"{k}={_go_quote(v)}" for k, v in items)
    raise ConfigError(f"unsupported fieldRef {path!r}")


def _go_quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


_SUFFIX: dict[str, Fraction] = {
    "": Fraction(1), "m": Fraction(1, 1000), "k": Fraction(10**3), "M": Fraction(10**6),
    "G": Fraction(10**9), "T": Fraction(10**12), "P": Fraction(10**15), "E": Fraction(10**18),
    "Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30), "Ti": Fraction(2**40),
    "Pi": Fraction(2**50), "Ei": Fraction(2**60)}


def parse_quantity(q: str | int) -> Fraction:
    m = re.fullmatch(r"([+-]?[0-9.]+)(?:[eE]([+-]?\d+)|([a-zA-Z]*))", str(q).strip())
    if not m or (m.group(3) or "") not in _SUFFIX:
        raise ConfigError(f"invalid quantity {q!r}")
    if m.group(2):
        return Fraction(m.group(1)) * Fraction(10) ** int(m.group(2))
    return Fraction(m.group(1)) * _SUFFIX[m.group(3) or ""]


def resource_value(container: Obj, ref: Obj, allocatable: Mapping[str, str]) -> str:
    """resourceFieldRef: the container's request or limit; an unset limit is the node allocatable."""
    kind, _, resource = ref["resource"].partition(".")
    resources = container.get("resources", {})
    raw = resources.get(kind, {}).get(resource)
    if raw is None and kind == "requests":
        raw = resources.get("limits", {}).get(resource)
    if raw is None:
        raw = allocatable.get(resource, "0") if kind == "limits" else "0"
    value = parse_quantity(raw) / parse_quantity(ref.get("divisor") or "1")
    return str(math.ceil(value))


def container_env(pod: Obj, container: Obj, objects: Objects, api_port: int,
                  allocatable: Mapping[str, str]) -> dict[str, str]:
    """The environment kubelet would give this container (service links reduced to the API server)."""
    env: dict[str, str] = {
        "KUBERNETES_SERVICE_HOST": HOST_IP,
        "KUBERNETES_SERVICE_PORT": str(api_port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(api_port),
        "KUBERNETES_PORT": f"tcp://{HOST_IP}:{api_port}",
    }
    for src in container.get("envFrom", []):
        prefix = src.get("prefix", "")
        for kind, key in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
            if key in src:
                ref = src[key]
                data = _lookup(objects, kind, ref["name"], bool(ref.get("optional")))
                for k, v in (data or {}).items():
                    if "=" not in prefix + k:
                        env[prefix + k] = v.decode(errors="replace")
    for var in container.get("env", []):
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        vf = var["valueFrom"]
        if "fieldRef" in vf:
            env[name] = field_value(pod, vf["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in vf:
            env[name] = resource_value(container, vf["resourceFieldRef"], allocatable)
        else:
            kind, key = ("Secret", "secretKeyRef") if "secretKeyRef" in vf else ("ConfigMap",
                                                                              "configMapKeyRef")
            ref = vf[key]
            optional = bool(ref.get("optional"))
            data = _lookup(objects, kind, ref["name"], optional)
            if data is not None and ref["key"] in data:
                env[name] = data[ref["key"]].decode(errors="replace")
            elif not optional:
                raise ConfigError(f'couldn\'t find key {ref["key"]} in {kind} '
                                  f'{pod["metadata"]["namespace"]}/{ref["name"]}')
    return env


# -- volumes --------------------------------------------------------------------------------------

# A volume's files: relative path -> (content, mode).
Payload = dict[str, tuple[bytes, int]]


def _items(data: Mapping[str, bytes], items: list[Obj] | None, mode: int, what: str) -> Payload:
    if not items:
        return {k: (v, mode) for k, v in data.items()}
    out: Payload = {}
    for it in items:
        if it["key"] not in data:
            raise ConfigError(f"{what}: key {it['key']!r} not found")
        out[it["path"]] = (data[it["key"]], int(it.get("mode", mode)))
    return out


def _downward(pod: Obj, container_for: Mapping[str, Obj], items: list[Obj], mode: int,
              allocatable: Mapping[str, str]) -> Payload:
    out: Payload = {}
    for it in items:
        m = int(it.get("mode", mode))
        if "fieldRef" in it:
            out[it["path"]] = (field_value(pod, it["fieldRef"]["fieldPath"]).encode(), m)
        elif "resourceFieldRef" in it:
            ref = it["resourceFieldRef"]
            c = container_for.get(ref.get("containerName", ""), {})
            out[it["path"]] = (resource_value(c, ref, allocatable).encode(), m)
    return out


def volume_payload(pod: Obj, vol: Obj, objects: Objects, tokens: Tokens,
                   allocatable: Mapping[str, str]) -> Payload | None:
    """Files of a secret/configMap/downwardAPI/projected volume; None for other kinds."""
    containers = {c["name"]: c for c in pod["spec"].get("containers", [])}
    ns = pod["metadata"]["namespace"]

    def secret(src: Obj, default_mode: int) -> Payload:
        name = src.get("secretName") or src.get("name", "")
        data = _lookup(objects, "Secret", name, bool(src.get("optional")))
        return _items(data or {}, src.get("items"), default_mode, f"secret {ns}/{name}")

    def configmap(src: Obj, default_mode: int) -> Payload:
        data = _lookup(objects, "ConfigMap", src["name"], bool(src.get("optional")))
        return _items(data or {}, src.get("items"), default_mode, f"configmap {ns}/{src['name']}")

    if "secret" in vol:
        return secret(vol["secret"], int(vol["secret"].get("defaultMode", DEFAULT_FILE_MODE)))
    if "configMap" in vol:
        return configmap(vol["configMap"], int(vol["configMap"].get("defaultMode", DEFAULT_FILE_MODE)))
    if "downwardAPI" in vol:
        d = vol["downwardAPI"]
        return _downward(pod, containers, d.get("items", []),
                         int(d.get("defaultMode", DEFAULT_FILE_MODE)), allocatable)
    if "projected" in vol:
        p = vol["projected"]
        mode = int(p.get("defaultMode", DEFAULT_FILE_MODE))
        out: Payload = {}
        for src in p.get("sources", []):
            if "secret" in src:
                out.update(secret(src["secret"], mode))
            elif "configMap" in src:
                out.update(configmap(src["configMap"], mode))
            elif "downwardAPI" in src:
                out.update(_downward(pod, containers, src["downwardAPI"].get("items", []), mode,
                                     allocatable))
            elif "serviceAccountToken" in src:
                t = src["serviceAccountToken"]
                key = (t.get("audience", ""), int(t.get("expirationSeconds", 3600)))
                out[t["path"]] = (tokens[key].encode(), mode)
            else:
                raise ConfigError(f"projected source {sorted(src)} is not supported by this node")
        return out
    return None


# -- status ---------------------------------------------------------------------------------------


@dataclass
class ContainerRecord:
    """What the agent knows about one container, kept in API form."""

    name: str
    image: str
    state: Obj = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: Obj = field(default_factory=dict)
    restart_count: int = 0
    container_id: str = ""
    final: bool = False  # terminated and will not be restarted

    @property
    def running(self) -> bool:
        return "running" in self.state

    @property
    def exit_code(self) -> int | None:
        t = self.state.get("terminated")
        return None if t is None else int(t["exitCode"])

    def api(self) -> Obj:
        out: Obj = {"name": self.name, "image": self.image, "imageID": "", "ready": self.running,
                    "restartCount": self.restart_count, "started": self.running, "state": self.state,
                    "lastState": self.last_state}
        if self.container_id:
            out["containerID"] = self.container_id
        return out


@dataclass
class PodRecord:
    init: list[ContainerRecord]
    main: list[ContainerRecord]
    start_time: str = ""
    sandbox_ready: bool = False
    initialized: bool = False
    reason: str = ""  # pod-level failure, e.g. DeadlineExceeded
    message: str = ""
    conditions: dict[str, Obj] = field(default_factory=dict)  # as last reported, for transition times

    @classmethod
    def for_pod(cls, pod: Obj) -> PodRecord:
        spec = pod["spec"]
        def recs(key: str) -> list[ContainerRecord]:
            return [ContainerRecord(c["name"], c.get("image", "")) for c in spec.get(key, [])]
        rec = cls(recs("initContainers"), recs("containers"))
        for c in rec.main if rec.init else []:
            c.state = {"waiting": {"reason": "PodInitializing"}}
        return rec

    def phase(self) -> str:
        if self.reason and not any(c.running for c in [*self.init, *self.main]):
            return "Failed"  # only once the containers are stopped, so the status says how they ended
        if not self.initialized:
            failed_init = any(c.final and c.exit_code != 0 for c in self.init)
            return "Failed" if failed_init else "Pending"
        if all(c.final for c in self.main):
            return "Failed" if any(c.exit_code != 0 for c in self.main) else "Succeeded"
        if any(c.running or c.last_state or c.final for c in self.main):
            return "Running"
        return "Pending"


def _condition(type_: str, ok: bool, previous: Mapping[str, Obj], reason: str = "",
               message: str = "") -> Obj:
    status = "True" if ok else "False"
    prev = previous.get(type_)
    since = prev.get("lastTransitionTime") if prev and prev.get("status") == status else None
    cond: Obj = {"type": type_, "status": status, "lastProbeTime": None,
                 "lastTransitionTime": since or now()}
    if not ok and reason:
        cond["reason"] = reason
    if not ok and message:
        cond["message"] = message
    return cond


OWNED_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady")


def pod_status(pod: Obj, rec: PodRecord) -> Obj:
    """The full status the agent reports; conditions it does not own (PodScheduled, ...) are kept.

    The owned conditions are remembered in rec so transition times survive stale watch events."""
    phase = rec.phase()
    previous = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
    previous.update(rec.conditions)
    terminal = phase in ("Succeeded", "Failed")
    unready = [c.name for c in rec.main if not c.running]
    uninit = [c.name for c in rec.init if not (c.final and c.exit_code == 0)]
    ready_reason = "PodCompleted" if terminal else "ContainersNotReady"
    ready_msg = "" if terminal else f"containers with unready status: [{' '.join(unready)}]"
    conditions = [c for t, c in previous.items() if t not in OWNED_CONDITIONS]
    conditions += [
        _condition("PodReadyToStartContainers", rec.sandbox_ready and not terminal, previous),
        _condition("Initialized", rec.initialized, previous,
                   "PodCompleted" if terminal else "ContainersNotInitialized",
                   "" if terminal else f"containers with incomplete status: [{' '.join(uninit)}]"),
        _condition("Ready", not unready and not terminal, previous, ready_reason, ready_msg),
        _condition("ContainersReady", not unready and not terminal, previous, ready_reason, ready_msg),
    ]
    rec.conditions = {c["type"]: c for c in conditions if c["type"] in OWNED_CONDITIONS}
    status: Obj = {
        "phase": phase, "conditions": conditions,
        "hostIP": HOST_IP, "hostIPs": [{"ip": HOST_IP}],
        "podIP": HOST_IP, "podIPs": [{"ip": HOST_IP}],
        "containerStatuses": [c.api() for c in rec.main],
        "reason": rec.reason or None, "message": rec.message or None,
    }
    if rec.start_time:
        status["startTime"] = rec.start_time
    if rec.init:
        status["initContainerStatuses"] = [c.api() for c in rec.init]
    return status


def termination_message(file_text: bytes, log_tail: bytes, exit_code: int, policy: str) -> str:
    msg = file_text[:MAX_TERMINATION_MESSAGE].decode(errors="replace")
    if not msg and exit_code != 0 and policy == "FallbackToLogsOnError":
        lines = log_tail[-FALLBACK_LOG_BYTES:].splitlines()[-FALLBACK_LOG_LINES:]
        msg = b"\n".join(lines).decode(errors="replace")
    return msg


def iter_containers(pod: Obj) -> Iterator[Obj]:
    yield from pod["spec"].get("initContainers", [])
    yield from pod["spec"].get("containers", [])
