"""The image cache, without podman: tags are keys of exactly what goes into an image, a store entry counts
only when complete, and pruning keeps the recent entries and every blob they use."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from flowkube_devstack import images
from flowkube_devstack.build import BuildError


def _tree(root: Path) -> None:
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("x = 1\n")
    (root / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    (root / "Dockerfile").write_text("FROM base\n")


def test_the_key_follows_the_files_that_go_into_the_image(tmp_path: Path) -> None:
    _tree(tmp_path)
    key = images.content_key(tmp_path, ("pkg", "Dockerfile"), "parent:1")
    assert re.fullmatch(r"[0-9a-f]{12}", key)
    assert key == images.content_key(tmp_path, ("pkg", "Dockerfile"), "parent:1")
    (tmp_path / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"changed")
    (tmp_path / "pkg" / "__pycache__" / "new.cpython-311.pyc").write_bytes(b"new")
    (tmp_path / "pkg" / "stray.pyc").write_bytes(b"stray")
    (tmp_path / "unrelated.txt").write_text("not in the context")
    assert images.content_key(tmp_path, ("pkg", "Dockerfile"), "parent:1") == key
    (tmp_path / "pkg" / "mod.py").write_text("x = 2\n")
    assert images.content_key(tmp_path, ("pkg", "Dockerfile"), "parent:1") != key


def test_the_key_follows_the_parent_image_file_names_and_the_dockerfile(tmp_path: Path) -> None:
    _tree(tmp_path)
    key = images.content_key(tmp_path, ("pkg", "Dockerfile"), "parent:1")
    assert images.content_key(tmp_path, ("pkg", "Dockerfile"), "parent:2") != key
    (tmp_path / "Dockerfile").write_text("FROM base\nUSER 1\n")
    key2 = images.content_key(tmp_path, ("pkg", "Dockerfile"), "parent:1")
    assert key2 != key
    (tmp_path / "pkg" / "mod.py").rename(tmp_path / "pkg" / "other.py")
    assert images.content_key(tmp_path, ("pkg", "Dockerfile"), "parent:1") != key2
    (tmp_path / "pkg" / "empty.py").write_text("")  # a new empty file counts too
    assert images.content_key(tmp_path, ("pkg", "Dockerfile"), "parent:1") != key2


def test_a_missing_context_path_is_an_error_not_an_empty_key(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="does not exist"):
        images.content_key(tmp_path, ("nowhere",))


def test_the_build_context_is_the_dockerignore_allow_list() -> None:
    # The images are keyed on what the Dockerfiles may COPY: .dockerignore's allow-list, no more.
    allowed = [line.lstrip("!").rstrip("/") for line in (images.REPO / ".dockerignore").read_text().splitlines()
               if line.startswith("!")]
    assert sorted(allowed) == sorted(images.CONTEXT)
    ignored = (images.REPO / ".dockerignore").read_text().splitlines()
    assert "**/__pycache__" in ignored and "**/*.pyc" in ignored  # what content_key skips too


@pytest.mark.parametrize("component", ["operator", "runner"])
def test_the_final_stage_declares_the_keys_that_rerun_its_cached_installs(component: str) -> None:
    # Buildah reuses a `RUN --mount=...,from=builder` layer even when the builder's output changed; the keys
    # images.py passes must be declared before the RUNs that mount the dependencies and the project.
    final = (images.REPO / component / "Dockerfile").read_text().rsplit("\nFROM ", 1)[1]
    deps_arg, deps_run = final.index("ARG DEPS_KEY"), final.index("source=/deps")
    source_arg, source_run = final.index("ARG SOURCE_KEY"), final.index("source=/dist")
    assert deps_arg < deps_run < source_arg < source_run


def test_pause_version_comes_from_the_makefile() -> None:
    assert images.pause_version("# x\nTAG ?= 3.10.2\nREV = $(shell git describe)\n") == "3.10.2"
    with pytest.raises(BuildError):
        images.pause_version("REV = 1\n")


# -- the store ----------------------------------------------------------------------------------------


def _blob(data: bytes) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = images._blob(digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"digest": digest, "size": len(data)}


def _layout(ref: str, *layers: bytes, age: float = 0.0) -> Path:
    """A store entry as skopeo writes it: index.json in the layout, blobs in the shared store."""
    config = _blob(json.dumps({"ref": ref}).encode())
    manifest = json.dumps({"schemaVersion": 2, "config": config, "layers": [_blob(x) for x in layers]}).encode()
    entry = {**_blob(manifest), "annotations": {"org.opencontainers.image.ref.name": ref}}
    layout = images.layout_path(ref)
    layout.mkdir(parents=True)
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [entry]}))
    then = time.time() - age
    os.utime(layout / "index.json", (then, then))
    return layout


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """An empty cache directory; podman calls are recorded, never run."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], *args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_run)  # what images calls podman with
    return calls


def test_an_entry_counts_only_with_every_blob_at_its_size(cache: list[list[str]]) -> None:
    ref = "localhost/flowkube-runner:0123456789ab"
    assert not images.cached(ref)
    _layout(ref, b"base layer", b"top layer")
    assert images.cached(ref)
    top = images._blob("sha256:" + hashlib.sha256(b"top layer").hexdigest())
    top.write_bytes(b"top la")  # truncated
    assert not images.cached(ref)
    top.unlink()
    assert not images.cached(ref)


def test_pruning_keeps_recent_entries_and_the_blobs_they_share(cache: list[list[str]]) -> None:
    old = [f"localhost/flowkube-runner:{i:012x}" for i in range(5)]
    for i, ref in enumerate(old):  # the first is the most recently used
        _layout(ref, b"shared base", f"top {i}".encode(), age=3600.0 + i)
    oldest = "localhost/flowkube-runner:fffffffffff0"
    _layout(oldest, b"shared base", b"oldest top", age=3700.0)
    just_used = "localhost/flowkube-runner:fffffffffff1"
    _layout(just_used, b"shared base", b"just used top", age=1.0)
    other = "localhost/flowkube-operator:000000000000"
    _layout(other, b"operator layer", age=9000.0)

    images._prune()

    kept = {ref for ref in [*old, oldest, just_used, other] if images.cached(ref)}
    # The three most recently used runners, and the operator (its image's only entry).
    assert kept == {just_used, *old[:2], other}
    removed = [*old[2:], oldest]
    assert all(not images.layout_path(ref).exists() for ref in removed)
    assert sorted(c[-1] for c in cache if c[:2] == ["podman", "rmi"]) == sorted(removed)
    remaining = {p.read_bytes() for p in images.blob_dir().rglob("*") if p.is_file()}
    assert {b"shared base", b"top 0", b"top 1", b"just used top", b"operator layer"} <= remaining
    assert not {b"top 2", b"top 4", b"oldest top"} & remaining


def test_pruning_never_drops_an_entry_used_in_the_last_minutes(cache: list[list[str]]) -> None:
    refs = [f"localhost/flowkube-devstack:{i:012x}" for i in range(images.KEEP_PER_IMAGE + 2)]
    for i, ref in enumerate(refs):
        _layout(ref, f"layer {i}".encode(), age=float(i))
    images._prune()
    assert all(images.cached(ref) for ref in refs)
    assert not cache
