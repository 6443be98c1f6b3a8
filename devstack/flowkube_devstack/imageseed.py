"""A local node's containerd starts with the local images already imported and unpacked.

Importing the images into a new node's containerd (``images.load_into_containerd``: 1.2 GB of
blobs, written once into its content store and once unpacked into overlayfs snapshots) took 22 of
the 27 seconds a cluster took to start, in each xdist worker's cluster and in every other. Instead,
a *seed* is made once per set of images: a containerd root (content store, snapshots, metadata)
into which a containerd of its own imported them. A node's containerd root is then laid down as hard
links to the seed's files (well under a second): blobs and committed snapshots are never written
after they are made, and whatever a node adds or removes (containers' snapshots, an image
garbage-collected) is a file of its own or an unlinked name. Only the two bolt databases, which
containerd writes in place, are copied.

A seed is keyed by the image references (each a hash of what went into the image) and containerd's
version. A new set starts from the newest seed of another set: its images are linked, those not in
the set removed and only the missing ones imported (usually the operator's small top layer after an
operator change). The newest ``KEEP`` seeds are kept. Where hard links cannot be made (the cluster's
root on another file system) nothing is laid down and the node imports the images as before.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from flowkube_devstack import build, images, procs

KEEP = 2  # seeds kept, most recently made or used first
BOLT_DATABASES = ("io.containerd.metadata.v1.bolt/meta.db", "io.containerd.snapshotter.v1.overlayfs/metadata.db")
READY = "ready"  # a seed's marker, written last; its mtime: when the seed was last used


def seeds_dir() -> Path:
    return build.cache_root() / "containerd-seeds"


def containerd_version() -> str:
    return subprocess.run(["containerd", "--version"], capture_output=True, text=True, check=True).stdout.strip()


def seed_key(refs: Sequence[str]) -> str:
    text = json.dumps({"refs": sorted(set(refs)), "containerd": containerd_version(), "snapshotter": "overlayfs"})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _lock() -> contextlib.AbstractContextManager[None]:
    return build._lock(build.cache_root() / "locks" / "containerd-seeds.lock")


def _seeds() -> list[Path]:
    """The ready seeds, the most recently made or used first."""
    ready = [p for p in seeds_dir().glob("*/" + READY)] if seeds_dir().is_dir() else []
    return [p.parent for p in sorted(ready, key=lambda p: p.stat().st_mtime, reverse=True)]


def link_root(seed_root: Path, root: Path) -> None:
    """Lay ``root`` (a containerd root, absent or empty) down as hard links to ``seed_root``'s files,
    the bolt databases copied."""
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["cp", "-a", "--link", f"{seed_root}/.", str(root)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise OSError(errno.EXDEV, f"cp --link {seed_root} {root}: {proc.stderr.strip()[-500:]}")
    for db in BOLT_DATABASES:
        if (seed_root / db).exists():
            (root / db).unlink()
            shutil.copy2(seed_root / db, root / db)


def _make(refs: Sequence[str], seed: Path) -> None:
    """Import ``refs`` into a containerd of its own whose root is ``seed``/root, starting from the
    newest other seed's images; ``seed`` is renamed into place when complete."""
    building = seed.with_name(f"{seed.name}.building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    previous = next(iter(_seeds()), None)
    if previous is not None:
        link_root(previous / "root", building / "root")
    (building / "root").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="flowkube-seed-") as state:  # short: the socket's path
        socket = Path(state) / "containerd.sock"
        config = Path(state) / "config.toml"
        config.write_text(f'version = 2\nroot = "{building / "root"}"\nstate = "{Path(state) / "state"}"\n'
                          'disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.aufs", '
                          '"io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", '
                          '"io.containerd.snapshotter.v1.devmapper"]\n'
                          f'[grpc]\n  address = "{socket}"\n')
        with (building / "containerd.log").open("wb") as log:
            proc = subprocess.Popen(["containerd", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            ctr = ["ctr", "--address", str(socket), "-n", "k8s.io"]
            deadline = time.monotonic() + 60
            while subprocess.run([*ctr, "version"], capture_output=True).returncode != 0:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise build.BuildError(f"the image seed's containerd did not start: {building / 'containerd.log'}")
                time.sleep(0.1)
            extra = set(images.run([*ctr, "images", "ls", "-q"]).split()) - set(refs)
            if extra:  # the previous seed's images this set does not hold (their blobs are collected)
                images.run([*ctr, "images", "rm", "--sync", *sorted(extra)])
            images.load_into_containerd(str(socket), refs)
        finally:
            procs.terminate(proc, grace=30.0)
    (building / READY).touch()
    building.rename(seed)


def _seed_for(refs: Sequence[str]) -> Path:
    """(Under the lock.) The root of the seed holding ``refs``, made now if there is none; the
    others but the newest ``KEEP`` go."""
    seed = seeds_dir() / seed_key(refs)
    if not (seed / READY).exists():
        shutil.rmtree(seed, ignore_errors=True)
        started = time.monotonic()
        _make(refs, seed)
        print(f"flowkube: containerd image seed {seed.name} made in {time.monotonic() - started:.1f} s", flush=True)
    (seed / READY).touch()
    for old in _seeds()[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in seeds_dir().glob("*.building-*"):
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)
    return seed / "root"


def lay_down(root: Path, refs: Sequence[str]) -> bool:
    """Lay a node's containerd ``root`` down with ``refs`` imported; False when it cannot be linked
    (then ``root`` is left empty and the node imports them itself)."""
    with _lock():  # no seed is pruned while it is linked from
        seed_root = _seed_for(refs)
        try:
            link_root(seed_root, root)
        except OSError as e:
            print(f"flowkube: warning: the node imports its images itself: {e}", flush=True)
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            return False
    return True


def prepare(refs: Sequence[str]) -> None:
    """Make the seed of ``refs`` now (``./dev test`` before pytest: not in a test's time). Without
    containerd there is nothing to make: a cluster's start says what is missing."""
    if shutil.which("containerd") is None or shutil.which("ctr") is None:
        return
    with _lock():
        _seed_for(refs)
