"""A network namespace per local cluster: its own "machine" on the network, next to this host.

Every process of a local cluster (etcd, the control plane, containerd, kubelet, kube-proxy, CoreDNS)
runs in one network namespace, joined to the host by a veth pair:

    host  10.234.<slot>.1  <-- veth -->  10.234.<slot>.2  the cluster's node (API server :6443)
          route 10.244.<slot>.0/24 (pods) and 10.<96+slot>.0.0/16 (Services) via 10.234.<slot>.2

So kube-proxy's iptables rules, the pods' bridge and the fixed ports a node uses (6443, 10250,
53, ...) belong to the cluster and vanish with it, two clusters (the dev stack and a test run) can
run at once, and the host still reaches the API server, pod IPs and ClusterIPs as a machine on
the cluster's network would. A slot is held with a file lock for the cluster's lifetime; a slot
left by a killed run is cleaned (its processes killed, its namespace deleted) before it is reused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

SLOTS = 32


class NetnsError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


@dataclass
class Netns:
    """One slot's namespace. ``host_ip`` is this host's end, ``node_ip`` the cluster's."""

    slot: int
    lock: IO[str] | None = None

    @property
    def name(self) -> str:
        return f"flowkube-{self.slot}"

    @property
    def path(self) -> str:
        return f"/run/netns/{self.name}"

    @property
    def host_ip(self) -> str:
        return f"10.234.{self.slot}.1"

    @property
    def node_ip(self) -> str:
        return f"10.234.{self.slot}.2"

    @property
    def pod_cidr(self) -> str:
        return f"10.244.{self.slot}.0/24"

    @property
    def service_cidr(self) -> str:
        return f"10.{96 + self.slot}.0.0/16"

    @property
    def kubernetes_service_ip(self) -> str:
        return f"10.{96 + self.slot}.0.1"

    @property
    def dns_service_ip(self) -> str:
        return f"10.{96 + self.slot}.0.10"

    def wrap(self, argv: list[str]) -> list[str]:
        """argv run inside the namespace (network only: mounts and cgroups stay the host's)."""
        return ["nsenter", f"--net={self.path}", "--", *argv]

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.wrap(list(argv)), capture_output=True, text=True)

    # -- lifecycle --------------------------------------------------------------------------------

    def create(self) -> None:
        self._remove()
        host_if, ns_if = f"fkh{self.slot}", f"fkn{self.slot}"
        _ip("netns", "add", self.name)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", self.name)
        _ip("addr", "add", f"{self.host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        inside = [
            ["addr", "add", f"{self.node_ip}/30", "dev", ns_if],
            ["link", "set", ns_if, "up"],
            ["link", "set", "lo", "up"],
            ["route", "add", "default", "via", self.host_ip],
        ]
        for args in inside:
            _ip("-n", self.name, *args)
        # A node routes between its pods' bridge and the world; a lone netns starts with it off.
        for key, value in (("net/ipv4/ip_forward", "1"), ("net/bridge/bridge-nf-call-iptables", "1")):
            proc = self.run("sh", "-c", f"echo {value} > /proc/sys/{key}")
            if proc.returncode != 0 and "ip_forward" in key:
                raise NetnsError(f"cannot enable {key} in {self.name}: {proc.stderr.strip()}")
        for cidr in (self.pod_cidr, self.service_cidr):
            _ip("route", "replace", cidr, "via", self.node_ip)

    def _remove(self) -> None:
        for cidr in (self.pod_cidr, self.service_cidr):
            _ip("route", "del", cidr, check=False)
        if Path(self.path).exists():
            pids = _ip("netns", "pids", self.name, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", self.name, check=False)
        _ip("link", "del", f"fkh{self.slot}", check=False)

    def delete(self) -> None:
        self._remove()
        if self.lock is not None:
            self.lock.close()
            self.lock = None


def acquire(lock_dir: Path, timeout: float = 60.0, prefer: int | None = None) -> Netns:
    """Take the first free slot, ``prefer`` first (its lock is held until ``delete``), and create its
    namespace."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    order = sorted(range(SLOTS), key=lambda s: s != prefer)
    while True:
        for slot in order:
            f = (lock_dir / f"slot-{slot}.lock").open("w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            ns = Netns(slot, f)
            try:
                ns.create()
            except BaseException:
                ns.delete()
                raise
            return ns
        if time.monotonic() > deadline:
            raise NetnsError(f"all {SLOTS} local cluster slots are taken (locks in {lock_dir})")
        time.sleep(1)
