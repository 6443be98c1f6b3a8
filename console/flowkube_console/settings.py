"""The console's settings, from FLOWKUBE_CONSOLE_* environment variables (the chart sets them) or
from `flowkube-console`'s flags (`kubectl flow console` passes them). docs/console.md lists them."""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

IN_CLUSTER_CA = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"


@dataclass(frozen=True)
class Settings:
    host: str = "0.0.0.0"  # noqa: S104 - a pod serves its Service on every address
    port: int = 8080
    api_server: str = "https://kubernetes.default.svc"
    api_socket: str | None = None  # local mode: `kubectl proxy --unix-socket`
    ca_file: str | None = None
    # "token": users sign in with a bearer token (pasted, or a header an auth proxy adds);
    # "local": `kubectl flow console`: the API server is `kubectl proxy`, which adds the kubeconfig's
    # credentials; the console listens on loopback and admits the browser holding the launch key.
    mode: str = "token"
    token_header: str = ""  # a request header an auth proxy puts the user's token in, beside Authorization
    session_key: bytes = b""  # 32 bytes; signs and encrypts the session cookie
    session_hours: float = 8.0
    namespaces: tuple[str, ...] = ()  # followed when a user may not list Flows cluster-wide
    grafana_url: str = ""  # with {namespace} and {name}
    trace_url: str = ""  # with {traceId} (and {namespace}, {name}): a Flow's trace in the trace backend
    launch_key: str = ""  # local mode: the one-time key in the URL `kubectl flow console` opens

    @property
    def fernet_key(self) -> bytes:
        return base64.urlsafe_b64encode(self.session_key)


def _key(raw: str | None) -> bytes:
    """A session key from its text (any length, hashed to 32 bytes), or a new random one: sessions
    then end when the console restarts, and replicas do not share them (the chart sets one)."""
    if not raw:
        return secrets.token_bytes(32)
    return hashlib.sha256(raw.strip().encode()).digest()


def in_cluster_server() -> str:
    """What client libraries use in a pod: the API server's Service address from the environment."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return Settings.api_server
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def load(argv: list[str] | None = None) -> Settings:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="flowkube-console", description="The flowkube web console.")
    p.add_argument("--host", default=env("FLOWKUBE_CONSOLE_HOST", Settings.host))
    p.add_argument("--port", type=int, default=int(env("FLOWKUBE_CONSOLE_PORT", str(Settings.port))))
    p.add_argument("--api-server", default=env("FLOWKUBE_CONSOLE_API_SERVER", in_cluster_server()))
    p.add_argument("--api-socket", default=env("FLOWKUBE_CONSOLE_API_SOCKET"),
                   help="the API server through a unix socket (kubectl proxy --unix-socket)")
    p.add_argument("--ca-file", default=env("FLOWKUBE_CONSOLE_CA_FILE"))
    p.add_argument("--mode", choices=("token", "local"), default=env("FLOWKUBE_CONSOLE_MODE", Settings.mode))
    p.add_argument("--token-header", default=env("FLOWKUBE_CONSOLE_TOKEN_HEADER", ""))
    p.add_argument("--namespaces", default=env("FLOWKUBE_CONSOLE_NAMESPACES", ""))
    p.add_argument("--grafana-url", default=env("FLOWKUBE_CONSOLE_GRAFANA_URL", ""))
    p.add_argument("--trace-url", default=env("FLOWKUBE_CONSOLE_TRACE_URL", ""))
    p.add_argument("--session-hours", type=float, default=float(env("FLOWKUBE_CONSOLE_SESSION_HOURS", "8")))
    p.add_argument("--launch-key", default=env("FLOWKUBE_CONSOLE_LAUNCH_KEY", ""))
    a = p.parse_args(argv)
    key_file = env("FLOWKUBE_CONSOLE_SESSION_KEY_FILE")
    raw_key = (Path(key_file).read_text() if key_file and Path(key_file).exists()
               else env("FLOWKUBE_CONSOLE_SESSION_KEY"))
    ca = a.ca_file or (IN_CLUSTER_CA if Path(IN_CLUSTER_CA).exists() else None)
    if a.mode == "local" and not a.launch_key:
        p.error("--mode local needs --launch-key")
    return Settings(host=a.host, port=a.port, api_server=a.api_server, api_socket=a.api_socket, ca_file=ca,
                    mode=a.mode,
                    token_header=a.token_header, session_key=_key(raw_key), session_hours=a.session_hours,
                    namespaces=tuple(n.strip() for n in a.namespaces.split(",") if n.strip()),
                    grafana_url=a.grafana_url, trace_url=a.trace_url, launch_key=a.launch_key)
