"""The launcher leaves nothing behind: a test run killed outright takes its cluster's processes with it
(what they leave of their own, container shims and mounts, is reaped by the next start)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowkube_devstack import kubenode, procs
from flowkube_devstack.cluster import wait_for

SCRIPT = """
import json, sys, time
from pathlib import Path
from flowkube_devstack.cluster import LocalCluster
c = LocalCluster(Path(sys.argv[1]), with_node=True).start()
print(json.dumps(c.describe()["pids"]), flush=True)
time.sleep(600)
"""


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """The kubelet's unix sockets live under its root: pytest's tmp_path (``.../pytest-130/test_a_killed_
    parent_leaves_no0/...``) makes them longer than the 107 bytes a socket path may have."""
    root = Path(tempfile.mkdtemp(prefix="fk-", dir="/tmp"))
    try:
        yield root
    finally:
        kubenode.unmount_under(root)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.controlplane
def test_a_killed_parent_leaves_no_control_plane_processes(short_dir: Path) -> None:
    tmp_path = short_dir
    parent = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "cluster")],
                              stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pids: dict[str, int] = json.loads(parent.stdout.readline())
    assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
                         "containerd", "kubelet", "kube-proxy", "coredns"}
    assert all(procs.alive(p) for p in pids.values())
    parent.kill()  # SIGKILL: no finalizer, no atexit, nothing graceful
    parent.wait()
    wait_for(lambda: not any(procs.alive(p) for p in pids.values()), 30,
             "every control-plane process to die with its parent")
    # The node's mounts (pod volumes) outlive it until the next start on its slot reaps them; undo
    # them here so pytest can remove the test's directory.
    kubenode.unmount_under(tmp_path)
