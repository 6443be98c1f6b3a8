"""The image cache, without podman: tags are keys of exactly what goes into an image, a store entry counts
only when complete, and pruning keeps the recent entries and every blob they use."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from flowkube_devstack import images, kind
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
    path = images.blob(digest)
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
    top = images.blob("sha256:" + hashlib.sha256(b"top layer").hexdigest())
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


# -- mmdebstrap ---------------------------------------------------------------------------------------

_SUITE_TAIL = [
    "bookworm", "rootfs.tar",
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
]
_NO_DOCS = [
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/info/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    "--dpkgopt=path-exclude=/usr/share/lintian/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
    "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
]
_APT_CLEANUP = 'rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/apt/* "$1"/var/log/dpkg.log'


def test_the_mmdebstrap_commands_are_the_ones_the_image_keys_were_made_of() -> None:
    """These lists go into the keys of the Python base, the kind node's rootfs and its node image: one
    element more, less or moved rebuilds them all. The lists as they were when the keys were made."""
    assert images._python_rootfs(Path("rootfs.tar")) == [
        "mmdebstrap", "--variant=minbase", "--quiet", "--format=tar",
        "--include=python3,python3-pip,python3-venv,python-is-python3,ca-certificates,passwd",
        '--aptopt=Acquire::Languages "none"',
        *_NO_DOCS,
        f'--customize-hook=rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED && {_APT_CLEANUP}',
        *_SUITE_TAIL,
    ]
    node_options = ['--aptopt=Acquire::Languages "none"', '--aptopt=APT::Install-Recommends "false"',
                    "--skip=output/dev"]
    assert kind._rootfs_command(kind.NODE_PACKAGES, Path("rootfs.tar")) == [
        "mmdebstrap", "--variant=minbase", "--quiet", "--format=tar",
        "--include=systemd,conntrack,iptables,iproute2,ethtool,kmod,libseccomp2,procps,ca-certificates,jq,"
        "containerd,runc,containernetworking-plugins",
        *node_options, *_NO_DOCS, f"--customize-hook={_APT_CLEANUP}", *_SUITE_TAIL,
    ]
    assert kind._rootfs_command(kind.KUBE_PROXY_PACKAGES, Path("p.tar")) == [
        "mmdebstrap", "--variant=minbase", "--quiet", "--format=tar", "--include=iptables",
        *node_options, *_NO_DOCS, f"--customize-hook={_APT_CLEANUP}", "bookworm", "p.tar", *_SUITE_TAIL[2:],
    ]


# -- OCI archives and containerd ----------------------------------------------------------------------


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _archive(data: bytes) -> tuple[dict[str, bytes], list[dict[str, Any]]]:
    """An archive's members (name -> bytes, each name once) and its index's manifests."""
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        names = t.getnames()
        assert len(names) == len(set(names))
        files = {n: t.extractfile(n).read() for n in names if t.getmember(n).isfile()}  # type: ignore[union-attr]
    assert json.loads(files.pop("oci-layout")) == {"imageLayoutVersion": "1.0.0"}
    return files, json.loads(files.pop("index.json"))["manifests"]


def test_an_archive_of_stored_images_holds_each_blob_once_and_none_the_importer_has(
        cache: list[list[str]]) -> None:
    a, b = "localhost/flowkube-runner:00000000000a", "localhost/flowkube-devstack:00000000000b"
    _layout(a, b"shared base", b"runner top")
    _layout(b, b"shared base", b"devstack top")
    out = io.BytesIO()
    images.write_oci_archive(out, stored={a: "", b: "example.com/devstack:v1"}, skip={_digest(b"shared base")})
    files, manifests = _archive(out.getvalue())
    assert [m["annotations"]["io.containerd.image.name"] for m in manifests] == [a, "example.com/devstack:v1"]
    layers = {data for name, data in files.items() if data in (b"shared base", b"runner top", b"devstack top")}
    assert layers == {b"runner top", b"devstack top"}  # the shared base is skipped: the importer has it
    assert all(name == "blobs/" + _digest(data).replace(":", "/") for name, data in files.items())
    with pytest.raises(BuildError, match="not in the image store"):
        images.write_oci_archive(io.BytesIO(), stored={"localhost/flowkube-runner:0000000000ff": ""})


@pytest.fixture
def ctr(cache: list[list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """containerd as `ctr` sees it: the images and blobs it has ("images", "blobs"); what `ctr images
    import` reads is kept in "imported" (a shell stands in for ctr: "script" runs after reading)."""
    state: dict[str, Any] = {"images": [], "blobs": [], "imported": None, "script": "", "calls": 0}
    archive = tmp_path / "imported.tar"

    def fake_run(cmd: list[str], **kwargs: object) -> str:
        return "\n".join(state["images"] if cmd[-3:-1] == ["images", "ls"] else state["blobs"])

    real_popen = subprocess.Popen

    def fake_popen(cmd: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        assert cmd[-3:] == ["images", "import", "-"]
        state["calls"] += 1
        return real_popen(["sh", "-c", f'cat > "{archive}"; {state["script"]}'], **kwargs)

    monkeypatch.setattr(images, "run", fake_run)
    monkeypatch.setattr(subprocess, "Popen", fake_popen)
    state["archive"] = archive
    return state


def test_containerd_is_sent_only_the_images_and_blobs_it_lacks(ctr: dict[str, Any]) -> None:
    a, b = "localhost/flowkube-runner:00000000000a", "localhost/flowkube-devstack:00000000000b"
    _layout(a, b"shared base", b"runner top")
    _layout(b, b"shared base", b"devstack top")
    ctr["images"], ctr["blobs"] = [a], [_digest(b"shared base")]
    images.load_into_containerd("/run/containerd.sock", [a, b, b])
    files, manifests = _archive(ctr["archive"].read_bytes())
    assert [m["annotations"]["org.opencontainers.image.ref.name"] for m in manifests] == [b]
    assert b"devstack top" in files.values()
    assert not {b"shared base", b"runner top"} & set(files.values())

    ctr["images"] = [a, b]
    images.load_into_containerd("/run/containerd.sock", [a, b])
    assert ctr["calls"] == 1  # containerd has both: no import at all


def test_a_failed_import_says_so_with_ctrs_output(ctr: dict[str, Any]) -> None:
    ref = "localhost/flowkube-runner:00000000000a"
    _layout(ref, b"layer")
    ctr["script"] = "echo 'ctr: content digest mismatch'; exit 3"
    with pytest.raises(BuildError, match=r"(?s)exit 3.*content digest mismatch"):
        images.load_into_containerd("/run/containerd.sock", [ref])
    ctr["script"] = "exit 0"
    with pytest.raises(BuildError, match="not in the image store"):  # before ctr starts
        images.load_into_containerd("/run/containerd.sock", ["localhost/flowkube-runner:0000000000ff"])
    assert ctr["calls"] == 1


def test_a_build_whose_cached_stage_is_gone_is_built_again_without_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another checkout's prune had removed the layers of a cached builder stage: podman warned that it
    could not bind-mount it, and pip found no wheels (both kind and launcher tests failed on it once)."""
    from flowkube_devstack import build, images

    calls: list[list[str]] = []
    log = tmp_path / "build.log"
    monkeypatch.setattr(images, "log_path", lambda ref: log)

    def fake_run(cmd: list[str], *, log: Path | None = None, cwd: Path | None = None) -> str:
        calls.append(list(cmd))
        if len(calls) == 1:
            assert log is not None
            log.write_text(f'level=warning msg="couldn\'t find \\"/x/merged/dist\\" {images.STALE_STAGE}"\n')
            raise build.BuildError("pip found no wheels")
        return ""

    monkeypatch.setattr(images, "run", fake_run)
    images._dockerfile_build("localhost/x:1", tmp_path / "Dockerfile", tmp_path, {})
    assert "--no-cache" not in calls[0] and "--no-cache" in calls[1]

    calls.clear()
    log.write_text("a real failure\n")

    def failing(cmd: list[str], *, log: Path | None = None, cwd: Path | None = None) -> str:
        calls.append(list(cmd))
        raise build.BuildError("compile error")

    monkeypatch.setattr(images, "run", failing)
    with pytest.raises(build.BuildError):
        images._dockerfile_build("localhost/x:1", tmp_path / "Dockerfile", tmp_path, {})
    assert len(calls) == 1  # any other failure is the build's own: not tried again
