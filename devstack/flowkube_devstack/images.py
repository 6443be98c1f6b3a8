"""Every container image the local cluster runs, built here with podman: no registry is needed.

    python -m flowkube_devstack.images      # build (or find cached) each image; print refs, sizes, build times

- ``python``: a Python 3.11 base from Debian bookworm (``mmdebstrap``, imported with podman), the
  local stand-in for the Dockerfiles' public ``python:3.11-slim-bookworm`` base: their base is a
  build argument, so the same Dockerfiles build on Docker with the public image.
- ``operator`` and ``runner``: ``operator/Dockerfile`` and ``runner/Dockerfile`` on that base.
- ``example_runner``: ``examples/runner-image/Dockerfile`` on the runner image (a user's flowRef image).
- ``devstack``: the runner image plus the stub model and the scripted test runner (``devstack/Dockerfile``).
- ``pause``: the pod sandbox image, from the Kubernetes module's own ``build/pause/linux/pause.c``.

Each image's tag is a hash of everything that goes into it (its Dockerfile, the files of its build
context, its parent's tag), so an unchanged tree never rebuilds and a changed one never runs a stale
image. A built image is also kept under the cache directory as an OCI image layout (``images/oci/<name>@<tag>``,
renamed into place when complete: its presence is the cache entry) whose blobs, uncompressed, live in one
store shared by all images (``images/blobs``): an image that adds a small layer to the runner's costs a
small layer there too, and is saved in well under a second. containerd imports any set of them from one
tar stream holding each blob once. podman's own storage and configuration live under the cache as well,
so nothing depends on /var/lib/containers or /etc.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import IO, Any

from flowkube_devstack import build
from flowkube_devstack.versions import KUBERNETES_VERSION

REPO = Path(__file__).resolve().parents[2]
DEVSTACK_DIR = "/opt/flowkube-dev"
FAKE_RUNNER_COMMAND = f"python {DEVSTACK_DIR}/fakerunner.py"
STUB_MODEL_COMMAND = ("python", f"{DEVSTACK_DIR}/stubmodel.py")

# Bump to rebuild every image after a change to how this module builds them.
IMAGES_VERSION = "3"
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # Debian's path, in the host and in the base

DEBIAN_SUITE = "bookworm"
DEBIAN_SOURCES = (
    f"deb http://deb.debian.org/debian {DEBIAN_SUITE} main",
    f"deb http://deb.debian.org/debian {DEBIAN_SUITE}-updates main",
    f"deb http://deb.debian.org/debian-security {DEBIAN_SUITE}-security main",
)
# What the Dockerfiles need of their base: pip (wheel, install), venv, `python`, CAs, groupadd/useradd.
PYTHON_PACKAGES = ("python3", "python3-pip", "python3-venv", "python-is-python3", "ca-certificates", "passwd")
# No documentation (but the copyright files), manuals or translations, as in the slim images.
_DPKG_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/info/*", "/usr/share/locale/*",
                  "/usr/share/lintian/*")
_DPKG_INCLUDES = ("/usr/share/doc/*/copyright",)
# mmdebstrap runs a hook with the new root as "$1": apt's caches, lists and logs go. For the Python base
# PEP 668's marker goes too, so that the Dockerfiles' `pip install` installs system-wide as on the public image.
APT_CLEANUP = 'rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/apt/* "$1"/var/log/dpkg.log'
_PYTHON_CLEANUP = f'rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED && {APT_CLEANUP}'
_PYTHON_CONFIG = ("ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "ENV LANG=C.UTF-8",
                  'CMD ["python3"]')
BASE_VERSION = "3"  # bump to rebuild the base with the same package list (e.g. for security updates)

# The build context the project's Dockerfiles use (their .dockerignore allow-list).
CONTEXT = ("pyproject.toml", "README.md", "api/flowkube_api", "operator/flowkube_operator", "runner/flowkube_runner",
           "kubectl/flowkube_kubectl", "console/flowkube_console")
EXAMPLE_CONTEXT = ("Dockerfile", "pyproject.toml", "myflows")
DEVSTACK_FILES = {"stubmodel.py": "devstack/flowkube_devstack/stubmodel.py",
                  "fakerunner.py": "tests/integration/fakerunner.py"}
_PAUSE_CFLAGS = ("-Os", "-Wall", "-Werror", "-static", "-s")
_PAUSE_CONTAINERFILE = 'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n'

STALE_STAGE = "on host to bind mount into container"  # podman's warning for a cached stage gone missing
KEEP_PER_IMAGE = 3  # layouts (and podman tags) kept per image name, most recently used first
_KEEP_RECENT_SECONDS = 600.0  # never prune a layout used this recently (another checkout may be loading it)


@dataclass(frozen=True)
class Images:
    """Full references (``localhost/<name>:<key>``) of the images the local cluster runs."""

    operator: str
    runner: str
    example_runner: str
    devstack: str
    pause: str

    def all(self) -> list[str]:
        return list(astuple(self))


# -- content keys -----------------------------------------------------------------------------------


def _ignored(rel: Path) -> bool:
    return "__pycache__" in rel.parts or rel.suffix == ".pyc"


def context_files(root: Path, paths: Iterable[str]) -> Iterator[Path]:
    """The files under ``paths`` (files or directories, relative to ``root``) in a stable order,
    without Python's bytecode caches (which .dockerignore keeps out of the build context too)."""
    for rel in paths:
        p = root / rel
        if p.is_file():
            yield p
        elif p.is_dir():
            yield from sorted(f for f in p.rglob("*") if f.is_file() and not _ignored(f.relative_to(root)))
        else:
            raise build.BuildError(f"{p} is part of an image's build context but does not exist")


def content_key(root: Path, paths: Iterable[str], *extra: str) -> str:
    """12 hex digits over the names and bytes of the files under ``paths``, and ``extra`` strings."""
    h = hashlib.sha256(IMAGES_VERSION.encode() + b"\0")
    for f in context_files(root, paths):
        name = f.relative_to(root).as_posix().encode()
        data = f.read_bytes()
        h.update(b"F%d:%s%d:" % (len(name), name, len(data)) + data)
    for e in extra:
        h.update(b"X%d:%s" % (len(e.encode()), e.encode()))
    return h.hexdigest()[:12]


def _split(ref: str) -> tuple[str, str]:
    """("flowkube-runner", "0123abcd4567") for "localhost/flowkube-runner:0123abcd4567"."""
    name, tag = ref.removeprefix("localhost/").rsplit(":", 1)
    return name, tag


def images_dir() -> Path:
    return build.cache_root() / "images"


def layout_path(ref: str) -> Path:
    """The OCI image layout of ``ref`` (index.json, oci-layout; its blobs are in ``blob_dir()``)."""
    name, tag = _split(ref)
    return images_dir() / "oci" / f"{name}@{tag}"


def blob_dir() -> Path:
    return images_dir() / "blobs"


def blob(digest: str) -> Path:
    algorithm, hexdigest = digest.split(":", 1)
    return blob_dir() / algorithm / hexdigest


def log_path(ref: str) -> Path:
    name, tag = _split(ref)
    return images_dir() / "logs" / f"{name}@{tag}.log"


@contextlib.contextmanager
def store_lock(*, shared: bool = False) -> Iterator[None]:
    """Writers of the blob store (saves, pruning) hold it alone; readers (imports) together."""
    path = build.cache_root() / "locks" / "image-store.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# -- podman -----------------------------------------------------------------------------------------


def _write_if_changed(path: Path, text: str) -> None:
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


@functools.cache
def _podman_env_for(root: Path) -> Mapping[str, str]:
    d = root / "podman"
    d.mkdir(parents=True, exist_ok=True)
    _write_if_changed(d / "containers.conf",
                      '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]\n'
                      '[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n')
    _write_if_changed(d / "storage.conf",
                      f'[storage]\ndriver = "overlay"\ngraphroot = "{d / "storage"}"\nrunroot = "{d / "run"}"\n')
    return {"CONTAINERS_CONF": str(d / "containers.conf"), "CONTAINERS_STORAGE_CONF": str(d / "storage.conf")}


def podman_env() -> dict[str, str]:
    """The environment for podman with its storage under the cache and the settings this machine kind
    needs: runc (crun refuses cgroup v1 in hybrid mode), ulimits within the host's caps (root without
    CAP_SYS_RESOURCE cannot raise them to podman's defaults), no systemd."""
    return {**os.environ, **_podman_env_for(build.cache_root())}


def _tail(text: str, limit: int = 3000) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def run(cmd: Sequence[str], *, log: Path | None = None, cwd: Path | None = None) -> str:
    """Run ``cmd`` (with podman's environment); its output is returned, or appended to ``log`` when
    given. A failure raises BuildError with the command and the tail of its output."""
    shown = " ".join(cmd)
    if shutil.which(cmd[0]) is None:
        raise build.BuildError(f"`{cmd[0]}` is not on PATH; the local images need the Debian packages podman, "
                               "buildah, skopeo, mmdebstrap, gcc and libc6-dev (pause), and containerd (ctr)")
    if log is None:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, env=podman_env(), cwd=cwd)
        if proc.returncode != 0:
            raise build.BuildError(f"`{shown}` failed (exit {proc.returncode}):\n"
                                   f"{_tail((proc.stdout + proc.stderr).strip())}")
        return proc.stdout
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        out.write(f"\n$ {shown}\n")
        out.flush()
        code = subprocess.run(list(cmd), stdout=out, stderr=subprocess.STDOUT, env=podman_env(), cwd=cwd).returncode
    if code != 0:
        raise build.BuildError(f"`{shown}` failed (exit {code}); log {log}:\n"
                               f"{_tail(log.read_text(errors='replace').strip())}")
    return ""


def in_podman(ref: str) -> bool:
    return subprocess.run(["podman", "image", "exists", ref], env=podman_env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def ensure_in_podman(ref: str) -> None:
    """A parent image, copied from its layout when podman's storage does not have it (any more)."""
    if not in_podman(ref):
        with store_lock(shared=True):
            run(["skopeo", "copy", "-q", "--src-shared-blob-dir", str(blob_dir()),
                 f"oci:{layout_path(ref)}:{ref}", f"containers-storage:{ref}"])


def _podman_size(ref: str) -> int:
    return int(run(["podman", "image", "inspect", "--format", "{{.Size}}", ref]).strip())


def _save(ref: str, record: Record) -> None:
    """``ref``'s layout, written beside its place and renamed into it when complete. Its layers are
    stored uncompressed, so a layer already in the blob store is recognised by its digest and skipped."""
    layout = layout_path(ref)
    layout.parent.mkdir(parents=True, exist_ok=True)
    with store_lock():
        for stale in layout.parent.glob(".*.tmp"):  # a save killed halfway (we hold the store's lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = layout.with_name(f".{layout.name}.{os.getpid()}.tmp")
        run(["skopeo", "copy", "-q", "--dest-oci-accept-uncompressed-layers", "--dest-shared-blob-dir",
             str(blob_dir()), f"containers-storage:{ref}", f"oci:{tmp}:{ref}"], log=log_path(ref))
        (tmp / RECORD).write_text(json.dumps(asdict(record), indent=2) + "\n")
        shutil.rmtree(layout, ignore_errors=True)
        tmp.rename(layout)
        _prune()


# -- the cache --------------------------------------------------------------------------------------


RECORD = "flowkube.json"


@dataclass(frozen=True)
class Record:
    """What the cache knows of a built image (in its layout, as RECORD)."""

    ref: str
    build_seconds: float
    size_bytes: int

    @classmethod
    def read(cls, ref: str) -> Record | None:
        try:
            data = json.loads((layout_path(ref) / RECORD).read_text())
            return cls(ref=ref, build_seconds=float(data["build_seconds"]), size_bytes=int(data["size_bytes"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def cached(ref: str) -> bool:
    """Whether the store has ``ref``: its layout, and every blob it refers to at its recorded size."""
    try:
        return all(blob(d["digest"]).stat().st_size == d["size"] for d in _blobs_of(layout_path(ref)))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _progress(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"flowkube: {message}", file=sys.stderr, flush=True)


def ensure_image(ref: str, make: Callable[[], None], what: str, *, quiet: bool) -> str:
    """``ref``, built with ``make()`` unless its layout exists (or podman still has it: then it is only
    saved). One process at a time builds a given image; the others wait for it and find it cached."""
    name, _ = _split(ref)
    if cached(ref):
        with contextlib.suppress(OSError):
            os.utime(layout_path(ref) / "index.json")  # most recently used: the last to be pruned
        _progress(f"image {name}: cached ({ref})", quiet)
        return ref
    with build._lock(build.cache_root() / "locks" / f"image-{name}.lock"):
        if cached(ref):  # another process built it while we waited
            _progress(f"image {name}: cached ({ref}, built by another process)", quiet)
            return ref
        started = time.monotonic()
        if in_podman(ref):
            _progress(f"image {name}: in podman's storage, saving its layout", quiet)
        else:
            _progress(f"image {name}: building {ref} ({what}); log {log_path(ref)}", quiet)
            log_path(ref).unlink(missing_ok=True)
            make()
        built_in = time.monotonic() - started
        size = _podman_size(ref)
        _save(ref, Record(ref=ref, build_seconds=round(built_in, 1), size_bytes=size))
        _progress(f"image {name}: built in {built_in:.0f} s, {size / 1e6:.0f} MB, saved in "
                  f"{time.monotonic() - started - built_in:.1f} s ({ref})", quiet)
    return ref


def manifests(layout: Path) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(index entry, manifest) of each image in an OCI layout whose blobs are in the store."""
    for entry in json.loads((layout / "index.json").read_text())["manifests"]:
        yield entry, json.loads(blob(entry["digest"]).read_bytes())


def _blobs_of(layout: Path) -> Iterator[dict[str, Any]]:
    for entry, manifest in manifests(layout):
        yield from (entry, manifest["config"], *manifest["layers"])


def _prune() -> None:
    """Drop all but the KEEP_PER_IMAGE most recently used layouts of each image (and their podman tags),
    never one used in the last few minutes; then the blobs no layout refers to. Holds the store's lock."""
    now = time.time()
    by_name: dict[str, list[tuple[float, Path]]] = {}
    for layout in (images_dir() / "oci").iterdir():
        with contextlib.suppress(OSError):
            mtime = (layout / "index.json").stat().st_mtime
            by_name.setdefault(layout.name.rsplit("@", 1)[0], []).append((mtime, layout))
    removed = False
    for name, layouts in by_name.items():
        for mtime, layout in sorted(layouts, reverse=True)[KEEP_PER_IMAGE:]:
            if now - mtime < _KEEP_RECENT_SECONDS:
                continue
            shutil.rmtree(layout, ignore_errors=True)
            tag = layout.name.rsplit("@", 1)[1]
            log_path(f"localhost/{name}:{tag}").unlink(missing_ok=True)
            subprocess.run(["podman", "rmi", f"localhost/{name}:{tag}"], env=podman_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            removed = True
    if not removed:
        return
    try:
        referenced = {d["digest"] for layouts in by_name.values() for _, layout in layouts if layout.exists()
                      for d in _blobs_of(layout)}
    except (OSError, ValueError, KeyError, TypeError):
        return  # a layout we cannot read: keep every blob rather than guess
    for algorithm in blob_dir().iterdir():
        for path in algorithm.iterdir():
            if f"{algorithm.name}:{path.name}" not in referenced:
                path.unlink(missing_ok=True)


def _dockerfile_build(ref: str, dockerfile: Path, context: Path, build_args: Mapping[str, str]) -> None:
    """``podman build`` without any registry (``--pull=never``: every base is local), with the host's
    network, and with the host's CA bundle mounted over the image's own in RUN steps, for the build only:
    the builder stages fetch wheels from PyPI, through whatever TLS interception the host's CAs allow
    (Debian's pip uses that bundle). Only paths the base has are mounted: buildah leaves an empty file
    in the layer for a mount point it had to create (so the host's /etc/pip.conf, which the base lacks,
    is not mounted)."""
    cmd = ["podman", "build", "--pull=never", "--layers", "--network=host"]
    if Path(HOST_CA_BUNDLE).is_file():
        cmd += ["-v", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"]
    for k, v in build_args.items():
        cmd += ["--build-arg", f"{k}={v}"]
    try:
        run([*cmd, "-f", str(dockerfile), "-t", ref, str(context)], log=log_path(ref))
    except build.BuildError:
        # podman's layer cache can name a builder stage whose layers are gone (another checkout's
        # build pruned the images that held them: _prune's `podman rmi`); its `RUN --mount=from=`
        # then mounts nothing and pip finds no wheels. That stage is rebuilt without the cache.
        if STALE_STAGE not in log_path(ref).read_text(errors="replace"):
            raise
        run([*cmd, "--no-cache", "-f", str(dockerfile), "-t", ref, str(context)], log=log_path(ref))


# -- the images -------------------------------------------------------------------------------------


def mmdebstrap_command(packages: Iterable[str], rootfs: Path, *, cleanup: str, extra: Sequence[str] = ()) -> list[str]:
    """mmdebstrap writing a minimal Debian DEBIAN_SUITE with ``packages`` to the tar file ``rootfs``: no
    documentation (but the copyright files), ``extra`` options, and the shell hook ``cleanup`` run on the
    new root ("$1") at the end. The list is part of the images' keys: the same arguments, the same list."""
    cmd = ["mmdebstrap", "--variant=minbase", "--quiet", "--format=tar", f"--include={','.join(packages)}",
           "--aptopt=Acquire::Languages \"none\"", *extra]
    cmd += [f"--dpkgopt=path-exclude={p}" for p in _DPKG_EXCLUDES]
    cmd += [f"--dpkgopt=path-include={p}" for p in _DPKG_INCLUDES]
    # Merged /usr as symlinks, as debootstrap and the official images make it: otherwise apt satisfies
    # init-system-helpers with the usrmerge package, which brings all of perl (50 MB).
    cmd.append("--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr")
    return [*cmd, f"--customize-hook={cleanup}", DEBIAN_SUITE, str(rootfs), *DEBIAN_SOURCES]


def _python_rootfs(rootfs: Path) -> list[str]:
    return mmdebstrap_command(PYTHON_PACKAGES, rootfs, cleanup=_PYTHON_CLEANUP)


def python_base(*, quiet: bool = False) -> str:
    """The Python 3.11 base image (Debian bookworm), keyed on the suite, sources, packages and recipe."""
    key = content_key(REPO, (), BASE_VERSION, *_python_rootfs(Path("rootfs.tar")), *_PYTHON_CONFIG)
    ref = f"localhost/flowkube-python:{key}"

    def make() -> None:
        with tempfile.TemporaryDirectory(prefix="flowkube-rootfs-") as tmp:
            rootfs = Path(tmp) / "rootfs.tar"
            run(_python_rootfs(rootfs), log=log_path(ref))
            changes = [arg for change in _PYTHON_CONFIG for arg in ("--change", change)]
            run(["podman", "import", "-q", *changes, str(rootfs), ref], log=log_path(ref))
        # What the Dockerfiles rely on, checked here rather than halfway through their builds.
        check = ("python --version && pip --version && command -v groupadd useradd"
                 " && ! ls /usr/lib/python3*/EXTERNALLY-MANAGED 2>/dev/null")
        run(["podman", "run", "--rm", "--network=none", ref, "sh", "-c", check], log=log_path(ref))

    return ensure_image(ref, make, f"Debian {DEBIAN_SUITE} with Python by mmdebstrap", quiet=quiet)


def project_image(component: str, base: str, *, quiet: bool = False) -> str:
    """``<component>/Dockerfile`` (operator or runner) built on ``base``."""
    key = content_key(REPO, (*CONTEXT, f"{component}/Dockerfile", ".dockerignore"), base)
    ref = f"localhost/flowkube-{component}:{key}"

    # Buildah reuses a cached `RUN --mount=...,from=builder` even when the builder's output changed
    # (containers/podman#17119): the final stage declares these arguments so that new values rerun the
    # dependencies' install (DEPS_KEY) and the project's (SOURCE_KEY). BuildKit needs no such help.
    deps_key = content_key(REPO, ("pyproject.toml", f"{component}/Dockerfile"), base)

    def make() -> None:
        ensure_in_podman(base)
        _dockerfile_build(ref, REPO / component / "Dockerfile", REPO,
                          {"PYTHON_IMAGE": base, "DEPS_KEY": deps_key, "SOURCE_KEY": key})

    return ensure_image(ref, make, f"{component}/Dockerfile", quiet=quiet)


def example_runner(runner: str, *, quiet: bool = False) -> str:
    """examples/runner-image: a user's flowRef image on the runner image."""
    context = REPO / "examples" / "runner-image"
    ref = f"localhost/flowkube-example-runner:{content_key(context, EXAMPLE_CONTEXT, runner)}"

    def make() -> None:
        ensure_in_podman(runner)
        _dockerfile_build(ref, context / "Dockerfile", context, {"RUNNER_IMAGE": runner})

    return ensure_image(ref, make, "examples/runner-image/Dockerfile", quiet=quiet)


def devstack(runner: str, *, quiet: bool = False) -> str:
    """The runner image plus the stub model and the scripted runner, in DEVSTACK_DIR."""
    key = content_key(REPO, ("devstack/Dockerfile", *DEVSTACK_FILES.values()), runner)
    ref = f"localhost/flowkube-devstack:{key}"

    def make() -> None:
        ensure_in_podman(runner)
        with tempfile.TemporaryDirectory(prefix="flowkube-devstack-ctx-") as tmp:
            for name, src in DEVSTACK_FILES.items():
                shutil.copyfile(REPO / src, Path(tmp) / name)
            _dockerfile_build(ref, REPO / "devstack" / "Dockerfile", Path(tmp), {"RUNNER_IMAGE": runner})

    return ensure_image(ref, make, "devstack/Dockerfile: the stub model and the scripted runner", quiet=quiet)


def _kubernetes_module() -> Path:
    cmd = ["go", "mod", "download", "-json", f"k8s.io/kubernetes@{KUBERNETES_VERSION}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise build.BuildError("the Go toolchain is not on PATH; the pause image's source comes from the "
                               "k8s.io/kubernetes Go module") from e
    if proc.returncode != 0:
        raise build.BuildError(f"`{' '.join(cmd)}` failed:\n{_tail((proc.stdout + proc.stderr).strip())}")
    return Path(json.loads(proc.stdout)["Dir"])


def pause_version(makefile: str) -> str:
    """The pause release the module's build/pause/Makefile names (``TAG ?= 3.10.2``)."""
    m = re.search(r"^TAG\s*\??=\s*(\S+)\s*$", makefile, flags=re.M)
    if m is None:
        raise build.BuildError("found no `TAG ?= ...` in the Kubernetes module's build/pause/Makefile")
    return m.group(1)


def pause(*, quiet: bool = False) -> str:
    """The pod sandbox image: upstream's pause.c from the Kubernetes module, a static binary FROM scratch."""
    source_dir = _kubernetes_module() / "build" / "pause"
    source = source_dir / "linux" / "pause.c"
    version = pause_version((source_dir / "Makefile").read_text())
    flags = (*_PAUSE_CFLAGS, f"-DVERSION=v{version}-flowkube")
    key = content_key(source.parent, (source.name,), version, *flags, _PAUSE_CONTAINERFILE)
    ref = f"localhost/flowkube-pause:{version}-{key}"

    def make() -> None:
        with tempfile.TemporaryDirectory(prefix="flowkube-pause-") as tmp:
            run(["gcc", *flags, "-o", f"{tmp}/pause", str(source)], log=log_path(ref))
            Path(tmp, "Containerfile").write_text(_PAUSE_CONTAINERFILE)
            run(["podman", "build", "--pull=never", "-t", ref, tmp], log=log_path(ref))

    return ensure_image(ref, make, "pause.c from the Kubernetes module, gcc -static", quiet=quiet)


def ensure_all(*, quiet: bool = False) -> Images:
    """Every image the local cluster runs, built (or found cached): their full references."""
    base = python_base(quiet=quiet)
    runner = project_image("runner", base, quiet=quiet)
    return Images(operator=project_image("operator", base, quiet=quiet), runner=runner,
                  example_runner=example_runner(runner, quiet=quiet), devstack=devstack(runner, quiet=quiet),
                  pause=pause(quiet=quiet))


# -- OCI archives and containerd ---------------------------------------------------------------------


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _file_digest(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest(), path.stat().st_size


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


@dataclass(frozen=True)
class OciImage:
    """One image of an archive: its name, its layers (uncompressed tar files) and its config."""

    name: str
    layers: tuple[Path, ...]
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()

    def blobs(self) -> tuple[dict[str, Any], bytes, bytes, list[tuple[str, Path]]]:
        """(index entry, manifest, config, [(digest, layer file)])."""
        layers = [(*_file_digest(p), p) for p in self.layers]
        config: dict[str, Any] = {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]}
        if self.entrypoint:
            config["Entrypoint"] = list(self.entrypoint)
        if self.cmd:
            config["Cmd"] = list(self.cmd)
        config_blob = json.dumps({"architecture": "amd64", "os": "linux", "config": config,
                                  "rootfs": {"type": "layers", "diff_ids": [d for d, _, _ in layers]}},
                                 sort_keys=True).encode()
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": _digest(config_blob),
                       "size": len(config_blob)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": s}
                       for d, s, _ in layers],
        }, sort_keys=True).encode()
        entry = {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": _digest(manifest),
                 "size": len(manifest), "platform": {"architecture": "amd64", "os": "linux"},
                 "annotations": {"io.containerd.image.name": self.name,
                                 "org.opencontainers.image.ref.name": self.name}}
        return entry, manifest, config_blob, [(d, p) for d, _, p in layers]


def _require_cached(ref: str) -> None:
    if not cached(ref):
        raise build.BuildError(f"{ref} is not in the image store ({layout_path(ref)}); build it first")


def write_oci_archive(out: IO[bytes], built: Sequence[OciImage] = (), stored: Mapping[str, str] = {},
                      *, skip: Container[str] = frozenset()) -> None:
    """An OCI image layout as a tar stream (what ``ctr images import`` reads): the ``built`` images and,
    from the local image store, ``stored`` (ref in the store -> name in the archive; "" keeps the ref).
    Each blob is written once, and none whose digest is in ``skip`` (those the importer already has)."""
    entries: list[dict[str, Any]] = []
    written: set[str] = set()
    with tarfile.open(fileobj=out, mode="w|", bufsize=1 << 20) as tar:
        _add_bytes(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')

        def add(digest: str, data: bytes | Path) -> None:
            if digest in written or digest in skip:
                return
            written.add(digest)
            arcname = "blobs/" + digest.replace(":", "/")
            if isinstance(data, Path):
                tar.add(data, arcname=arcname, recursive=False)
            else:
                _add_bytes(tar, arcname, data)

        for image in built:
            entry, manifest, config, layers = image.blobs()
            add(entry["digest"], manifest)
            add(_digest(config), config)
            for digest, path in layers:
                add(digest, path)
            entries.append(entry)
        for ref, name in stored.items():
            _require_cached(ref)
            for index_entry, image_manifest in manifests(layout_path(ref)):
                for d in (index_entry, image_manifest["config"], *image_manifest["layers"]):
                    add(d["digest"], blob(d["digest"]))
                names = dict.fromkeys(("io.containerd.image.name", "org.opencontainers.image.ref.name"), name or ref)
                entries.append({**index_entry, "annotations": {**index_entry.get("annotations", {}), **names}})
        _add_bytes(tar, "index.json", json.dumps({"schemaVersion": 2, "manifests": entries}).encode())


def load_into_containerd(address: str, refs: Iterable[str]) -> None:
    """Import images into containerd's ``k8s.io`` namespace (the CRI's), skipping those it has already:
    one ``ctr images import`` of an OCI layout streamed from the store, holding each blob once (the
    runner-based images share all but their last layers) and none that containerd has already."""
    ctr = ["ctr", "--address", address, "-n", "k8s.io"]
    have = set(run([*ctr, "images", "ls", "-q"]).split())
    missing = [ref for ref in dict.fromkeys(refs) if ref not in have]
    if not missing:
        return
    have_blobs = set(run([*ctr, "content", "ls", "-q"]).split())
    import_archive([*ctr, "images", "import", "-"], missing, skip=have_blobs)


def import_archive(cmd: Sequence[str], refs: Iterable[str], *, skip: Container[str] = frozenset(),
                   env: Mapping[str, str] | None = None) -> None:
    """Stream the store's images ``refs`` as one OCI archive into ``cmd``, a ``ctr images import -``
    (here, or in a kind node), leaving out the blobs in ``skip``; a failure raises with ctr's output."""
    refs = list(dict.fromkeys(refs))
    with store_lock(shared=True):
        for ref in refs:  # before ctr starts, so that it is not left with half an archive
            _require_cached(ref)
        with tempfile.TemporaryFile() as out:
            proc = subprocess.Popen(list(cmd), stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env)
            assert proc.stdin is not None
            # ctr may stop reading: then its exit status and output say why
            with contextlib.suppress(BrokenPipeError), proc.stdin:
                write_oci_archive(proc.stdin, stored=dict.fromkeys(refs, ""), skip=skip)
            code = proc.wait()
            if code != 0:
                out.seek(0)
                raise build.BuildError(f"`{shlex.join(cmd)}` of {', '.join(refs)} failed (exit {code}):\n"
                                       f"{_tail(out.read().decode(errors='replace').strip())}")


# -- command line -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        images = ensure_all(quiet=args.quiet)
        base = python_base(quiet=True)
    except build.BuildError as e:
        print(f"flowkube: {e}", file=sys.stderr)
        return 1
    for ref in (base, *images.all()):
        record = Record.read(ref)
        figures = f"{record.size_bytes / 1e6:6.0f} MB  (built in {record.build_seconds:.0f} s)" if record else ""
        print(f"{ref:50} {figures}")
    store = sum(f.stat().st_size for d in blob_dir().iterdir() for f in d.iterdir()) if blob_dir().is_dir() else 0
    print(f"blob store {blob_dir()}: {store / 1e6:.0f} MB")
    _progress(f"all images ready in {time.monotonic() - started:.1f} s", args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
