"""Where a Flow's durable state and run reports live: binary blobs under keys of one object.

In a pod that object is the ConfigMap ``<flow>-state`` the operator pre-created; the runner's Role
allows only get/patch/update on it, so this module never creates or lists anything. ``FileStore``
stands in for it in unit tests and local runs.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import httpx

from flowkube_api.constants import STATE_LIMIT

SERVICEACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class StoreError(Exception):
    """The state object could not be read or written (API unreachable, forbidden, missing)."""


class StateTooLarge(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"flow state is {size} bytes gzip-compressed, over the {limit}-byte limit of one "
            "ConfigMap; keep large data out of flow state (store a reference instead)"
        )
        self.size = size
        self.limit = limit


class StateCorrupt(Exception):
    pass


class StateStore(Protocol):
    """Binary values by key inside the Flow's one state object."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes) -> None: ...


def encode_json(document: Any, limit: int = STATE_LIMIT) -> bytes:
    """gzip JSON, refusing (not truncating) anything over ``limit`` compressed bytes."""
    data = gzip.compress(json.dumps(document, separators=(",", ":")).encode("utf-8"), mtime=0)
    if len(data) > limit:
        raise StateTooLarge(len(data), limit)
    return data


def decode_json(data: bytes, what: str) -> Any:
    try:
        return json.loads(gzip.decompress(data))
    except (OSError, EOFError, ValueError) as e:
        raise StateCorrupt(f"{what} is not gzip-compressed JSON: {e}") from e


class FileStore:
    """One file per key in a directory; writes are atomic renames like a ConfigMap update."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if "/" in key or key in ("", ".", ".."):
            raise StoreError(f"invalid key {key!r}")
        return self.directory / key

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def put(self, key: str, value: bytes) -> None:
        target = self._path(key)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.")
        with os.fdopen(fd, "wb") as fh:
            fh.write(value)
        Path(tmp).replace(target)


RETRYABLE_STATUS = frozenset({401, 403, 429})


class ConfigMapStore:
    """binaryData keys of one existing ConfigMap, through the Kubernetes API.

    JSON merge patches touch only the key written, so the state key and each run's report key
    never overwrite one another and no resourceVersion round trip is needed.
    """

    def __init__(self, client: httpx.Client, namespace: str, name: str, *, retry_for: float = 60.0) -> None:
        self._client = client
        self._path = f"/api/v1/namespaces/{namespace}/configmaps/{name}"
        # Long enough to ride out an API server restart; a run's state is never dropped for less.
        self._retry_for = retry_for
        self.name = name
        self.namespace = namespace

    @classmethod
    def from_environment(cls, namespace: str, name: str) -> ConfigMapStore:
        return cls(kubernetes_client(), namespace, name)

    def _request(self, method: str, **kwargs: Any) -> httpx.Response:
        delay = 0.25
        deadline = time.monotonic() + self._retry_for
        while True:
            last_try = time.monotonic() + delay > deadline
            try:
                response = self._client.request(method, self._path, **kwargs)
            except httpx.TransportError as e:
                if last_try:
                    raise StoreError(f"{method} configmap {self.name}: {e}") from e
            else:
                # 429/5xx: the API server is shedding load or restarting. 401/403: our RoleBinding is
                # made with the pod and RBAC takes effect through informers, and an API server just
                # restarted authorizes before its caches are warm. Anything else is final.
                if (response.status_code not in RETRYABLE_STATUS and response.status_code < 500) or last_try:
                    return response
            time.sleep(delay)
            delay = min(delay * 2, 4.0)

    def get(self, key: str) -> bytes | None:
        response = self._request("GET")
        if response.status_code != 200:
            raise StoreError(f"GET configmap {self.namespace}/{self.name}: {_status_text(response)}")
        value = (response.json().get("binaryData") or {}).get(key)
        if value is None:
            return None
        try:
            return base64.b64decode(value, validate=True)
        except ValueError as e:
            raise StateCorrupt(f"binaryData[{key}] of configmap {self.name} is not base64: {e}") from e

    def put(self, key: str, value: bytes) -> None:
        body = json.dumps({"binaryData": {key: base64.b64encode(value).decode("ascii")}})
        response = self._request("PATCH", content=body, headers={"Content-Type": "application/merge-patch+json"})
        if response.status_code != 200:
            raise StoreError(f"PATCH configmap {self.namespace}/{self.name}: {_status_text(response)}")


def _status_text(response: httpx.Response) -> str:
    try:
        message = response.json().get("message", "")
    except ValueError:
        message = response.text[:200]
    return f"HTTP {response.status_code} {message}".strip()


class _ServiceAccountToken(httpx.Auth):
    """Re-reads the projected token per request: kubelet rotates it under a long-running pod."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def auth_flow(self, request: httpx.Request) -> Any:
        request.headers["Authorization"] = f"Bearer {self._path.read_text().strip()}"
        yield request


def kubernetes_client(timeout: float = 15.0) -> httpx.Client:
    """An httpx client for the API server: in-cluster config first, else ``$KUBECONFIG``."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    if host:
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if ":" in host:
            host = f"[{host}]"
        return httpx.Client(
            base_url=f"https://{host}:{port}",
            verify=str(SERVICEACCOUNT_DIR / "ca.crt"),
            auth=_ServiceAccountToken(SERVICEACCOUNT_DIR / "token"),
            timeout=timeout,
        )
    kubeconfig = os.environ.get("KUBECONFIG", str(Path.home() / ".kube" / "config")).split(os.pathsep)[0]
    return _client_from_kubeconfig(Path(kubeconfig), timeout)


def _client_from_kubeconfig(path: Path, timeout: float) -> httpx.Client:
    """The current context of a kubeconfig: token or client-certificate users, CA data or file."""
    import ssl

    import yaml

    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise StoreError(f"no in-cluster config and kubeconfig {path} is unreadable: {e}") from e

    def named(section: str, name: str) -> dict[str, Any]:
        for item in config.get(section) or []:
            if item.get("name") == name:
                return dict(item.get(section[:-1]) or {})
        raise StoreError(f"kubeconfig {path}: no {section[:-1]} named {name!r}")

    context = named("contexts", config.get("current-context", ""))
    cluster = named("clusters", context.get("cluster", ""))
    user = named("users", context.get("user", ""))
    base = path.parent

    def material(data_key: str, file_key: str, source: dict[str, Any]) -> str | None:
        """Inline ``*-data`` fields go to private temp files: ssl only loads from paths."""
        if source.get(data_key):
            fd, name = tempfile.mkstemp(prefix="flowkube-kube-")
            with os.fdopen(fd, "wb") as fh:
                fh.write(base64.b64decode(source[data_key]))
            return name
        if source.get(file_key):
            return str(base / str(source[file_key]))
        return None

    context_ssl = ssl.create_default_context(
        cafile=material("certificate-authority-data", "certificate-authority", cluster)
    )
    if cluster.get("insecure-skip-tls-verify"):
        context_ssl.check_hostname = False
        context_ssl.verify_mode = ssl.CERT_NONE
    cert = material("client-certificate-data", "client-certificate", user)
    key = material("client-key-data", "client-key", user)
    if cert and key:
        context_ssl.load_cert_chain(cert, key)
    headers = {"Authorization": f"Bearer {user['token']}"} if user.get("token") else {}
    return httpx.Client(base_url=str(cluster["server"]), verify=context_ssl, headers=headers, timeout=timeout)
