"""Every container image the local cluster runs, built here with podman: no registry is needed.

    python -m flowkube_devstack.images      # build (or find cached) and print each image's reference

- ``python``: a Python 3.11 base from Debian bookworm (``mmdebstrap``, imported with podman), the
  local stand-in for the Dockerfiles' public ``python:3.11-slim-bookworm`` base: their base is a
  build argument, so the same Dockerfiles build on Docker with the public image.
- ``operator`` and ``runner``: ``operator/Dockerfile`` and ``runner/Dockerfile`` on that base.
- ``example_runner``: ``examples/runner-image/Dockerfile`` on the runner image (a user's flowRef image).
- ``devstack``: the runner image plus the stub model and the scripted test runner (``devstack/Dockerfile``).
- ``pause``: the pod sandbox image, from the Kubernetes module's own ``build/pause/linux/pause.c``.

Each image's tag is a hash of everything that goes into it (its Dockerfile, the files of its build
context, its parent's tag), so an unchanged tree never rebuilds and a changed one never runs a stale
image. Built images are kept as OCI archives under the cache directory, from which containerd imports
them in well under a second; podman's own storage lives there too (nothing under /var/lib/containers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path

from flowkube_devstack import build
from flowkube_devstack.versions import KUBERNETES_VERSION

REPO = Path(__file__).resolve().parents[2]
DEVSTACK_DIR = "/opt/flowkube-dev"
FAKE_RUNNER_COMMAND = f"python {DEVSTACK_DIR}/fakerunner.py"
STUB_MODEL_COMMAND = ("python", f"{DEVSTACK_DIR}/stubmodel.py")

DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
PYTHON_PACKAGES = ("python3", "python3-pip", "python3-venv", "python-is-python3", "ca-certificates")
# What the base drops after install: docs, apt's lists and caches, and PEP 668's marker, so that the
# Dockerfiles' `pip install` installs system-wide as it does on the public python image.
# mmdebstrap runs a hook with the new root as "$1"; a hook without it would clean this host instead.
_PYTHON_CLEANUP = ('test -d "$1/usr/lib/python3" && cd "$1" && rm -rf usr/share/doc/* usr/share/man/* '
                   "usr/share/locale/* var/lib/apt/lists/* var/cache/apt/* usr/lib/python3*/EXTERNALLY-MANAGED")
BASE_VERSION = "1"  # bump to rebuild the base with the same package list
PAUSE_VERSION = "3.10"

# The build context the project's Dockerfiles use (their .dockerignore allow-list).
CONTEXT = ("pyproject.toml", "README.md", "crds/flowkube_api", "operator/flowkube_operator", "runner/flowkube_runner")
DEVSTACK_FILES = {"stubmodel.py": "devstack/flowkube_devstack/stubmodel.py",
                  "fakerunner.py": "tests/integration/fakerunner.py"}


@dataclass(frozen=True)
class Images:
    operator: str
    runner: str
    example_runner: str
    devstack: str
    pause: str

    def all(self) -> list[str]:
        return list(astuple(self))


# -- content keys -----------------------------------------------------------------------------------


def _files(root: Path, paths: Iterable[str]) -> Iterator[Path]:
    for rel in paths:
        p = root / rel
        if p.is_file():
            yield p
        else:
            yield from (f for f in sorted(p.rglob("*")) if f.is_file()
                        and "__pycache__" not in f.parts and f.suffix != ".pyc")


def content_key(root: Path, paths: Iterable[str], *extra: str) -> str:
    """12 hex digits over the names and bytes of the files under ``paths`` and ``extra`` strings."""
    h = hashlib.sha256()
    for f in _files(root, paths):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    for e in extra:
        h.update(e.encode() + b"\0")
    return h.hexdigest()[:12]


# -- podman -----------------------------------------------------------------------------------------


def _podman_env() -> dict[str, str]:
    """podman with its storage under the cache and the settings this machine kind needs: runc (crun
    refuses cgroup v1 in hybrid mode), ulimits within the host's caps (no CAP_SYS_RESOURCE)."""
    d = build.cache_root() / "podman"
    d.mkdir(parents=True, exist_ok=True)
    conf = d / "containers.conf"
    conf.write_text('[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]\n'
                    '[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n')
    storage = d / "storage.conf"
    storage.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{d / "storage"}"\nrunroot = "{d / "run"}"\n')
    return {**os.environ, "CONTAINERS_CONF": str(conf), "CONTAINERS_STORAGE_CONF": str(storage)}


def _run(cmd: Sequence[str], *, log: Path | None = None, cwd: Path | None = None) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, env=_podman_env(), cwd=cwd)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as f:
            f.write(f"\n$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    if proc.returncode != 0:
        raise build.BuildError(f"`{' '.join(cmd[:4])} ...` failed (exit {proc.returncode}):\n"
                               f"{(proc.stderr or proc.stdout)[-3000:]}")
    return proc.stdout


def _archive(ref: str) -> Path:
    name, tag = ref.removeprefix("localhost/").rsplit(":", 1)
    return build.cache_root() / "images" / f"{name}-{tag}.oci.tar"


def _in_podman(ref: str) -> bool:
    return subprocess.run(["podman", "image", "exists", ref], env=_podman_env()).returncode == 0


def _ensure_in_podman(ref: str) -> None:
    """A parent image, from its archive when podman's storage lost it."""
    if not _in_podman(ref):
        _run(["podman", "load", "-q", "-i", str(_archive(ref))])


def _size_mb(ref: str) -> float:
    out = _run(["podman", "image", "inspect", "--format", "{{.Size}}", ref])
    return int(out.strip()) / 1e6


def _save(ref: str) -> None:
    dest = _archive(ref)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    _run(["podman", "save", "-q", "--format", "oci-archive", "-o", str(tmp), ref])
    tmp.rename(dest)


def _ensure(ref: str, make: object, what: str) -> str:
    """Build ``ref`` with ``make()`` unless its archive exists; report either way on stderr."""
    if _archive(ref).exists():
        return ref
    assert callable(make)
    with build._lock(build.cache_root() / "locks" / "images.lock"):
        if _archive(ref).exists():
            return ref
        print(f"flowkube: building image {ref} ({what})", file=sys.stderr, flush=True)
        started = time.monotonic()
        make()
        _save(ref)
        print(f"flowkube: built {ref} in {time.monotonic() - started:.0f}s, {_size_mb(ref):.0f} MB",
              file=sys.stderr, flush=True)
    return ref


def _build_args() -> list[str]:
    """Builder stages fetch wheels from PyPI: the host's network and its pip settings and CA, for the
    build only (mounted into RUN steps, never copied into an image)."""
    args = ["--network=host", "--layers"]
    for f in ("/etc/pip.conf", "/etc/ssl/certs/ca-certificates.crt"):
        if Path(f).is_file():
            args += ["-v", f"{f}:{f}:ro"]
    return args


def _dockerfile_build(ref: str, dockerfile: Path, context: Path, build_args: dict[str, str]) -> None:
    cmd = ["podman", "build", "-q", *_build_args(), "-f", str(dockerfile), "-t", ref]
    for k, v in build_args.items():
        cmd += ["--build-arg", f"{k}={v}"]
    _run([*cmd, str(context)], log=build.cache_root() / "images" / "build.log")


# -- the images -------------------------------------------------------------------------------------


def python_base() -> str:
    key = content_key(REPO, (), DEBIAN_SUITE, DEBIAN_MIRROR, *PYTHON_PACKAGES, _PYTHON_CLEANUP, BASE_VERSION)
    ref = f"localhost/flowkube-python:3.11-{DEBIAN_SUITE}-{key}"

    def make() -> None:
        with tempfile.TemporaryDirectory(prefix="flowkube-rootfs-") as tmp:
            rootfs = Path(tmp) / "rootfs.tar"
            subprocess.run(["mmdebstrap", "--variant=minbase", "--quiet", f"--include={','.join(PYTHON_PACKAGES)}",
                            f"--customize-hook={_PYTHON_CLEANUP}", DEBIAN_SUITE, str(rootfs),
                            DEBIAN_MIRROR], check=True, capture_output=True)
            _run(["podman", "import", "-q", "--change", 'CMD ["python3"]', "--change", "ENV LANG=C.UTF-8",
                  str(rootfs), ref])

    return _ensure(ref, make, f"Debian {DEBIAN_SUITE} with Python, mmdebstrap")


def _project_image(name: str, base: str) -> str:
    dockerfile = REPO / name / "Dockerfile"
    key = content_key(REPO, (*CONTEXT, f"{name}/Dockerfile", ".dockerignore"), base)
    ref = f"localhost/flowkube-{name}:{key}"

    def make() -> None:
        _ensure_in_podman(base)
        _dockerfile_build(ref, dockerfile, REPO, {"PYTHON_IMAGE": base})

    return _ensure(ref, make, f"{name}/Dockerfile")


def example_runner(runner: str) -> str:
    context = REPO / "examples" / "runner-image"
    ref = f"localhost/flowkube-example-runner:{content_key(context, ('.',), runner)}"

    def make() -> None:
        _ensure_in_podman(runner)
        _dockerfile_build(ref, context / "Dockerfile", context, {"RUNNER_IMAGE": runner})

    return _ensure(ref, make, "examples/runner-image")


def devstack(runner: str) -> str:
    dockerfile = REPO / "devstack" / "Dockerfile"
    key = content_key(REPO, ("devstack/Dockerfile", *DEVSTACK_FILES.values()), runner)
    ref = f"localhost/flowkube-devstack:{key}"

    def make() -> None:
        _ensure_in_podman(runner)
        with tempfile.TemporaryDirectory(prefix="flowkube-devstack-ctx-") as tmp:
            for name, src in DEVSTACK_FILES.items():
                shutil.copy(REPO / src, Path(tmp) / name)
            _dockerfile_build(ref, dockerfile, Path(tmp), {"RUNNER_IMAGE": runner})

    return _ensure(ref, make, "devstack/Dockerfile: stub model and scripted runner")


def _pause_source() -> Path:
    proc = subprocess.run(["go", "mod", "download", "-json", f"k8s.io/kubernetes@{KUBERNETES_VERSION}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise build.BuildError(f"cannot fetch k8s.io/kubernetes@{KUBERNETES_VERSION}: {proc.stderr.strip()}")
    return Path(json.loads(proc.stdout)["Dir"]) / "build" / "pause" / "linux" / "pause.c"


def pause() -> str:
    source = _pause_source()
    key = hashlib.sha256(source.read_bytes() + PAUSE_VERSION.encode()).hexdigest()[:12]
    ref = f"localhost/flowkube-pause:{PAUSE_VERSION}-{key}"

    def make() -> None:
        with tempfile.TemporaryDirectory(prefix="flowkube-pause-") as tmp:
            subprocess.run(["gcc", "-Os", "-static", f"-DVERSION=v{PAUSE_VERSION}", "-o", f"{tmp}/pause",
                            str(source)], check=True, capture_output=True)
            Path(tmp, "Containerfile").write_text(
                'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n')
            _run(["podman", "build", "-q", "-t", ref, tmp])

    return _ensure(ref, make, "pause.c from the Kubernetes module, gcc -static")


def ensure_all() -> Images:
    base = python_base()
    runner = _project_image("runner", base)
    return Images(operator=_project_image("operator", base), runner=runner, example_runner=example_runner(runner),
                  devstack=devstack(runner), pause=pause())


def load_into_containerd(address: str, refs: Iterable[str]) -> None:
    """Import images into containerd's ``k8s.io`` namespace (the CRI's), skipping those it has."""
    ctr = ["ctr", "--address", address, "-n", "k8s.io"]
    have = set(subprocess.run([*ctr, "images", "ls", "-q"], capture_output=True, text=True, check=True).stdout.split())
    for ref in refs:
        if ref not in have:
            proc = subprocess.run([*ctr, "images", "import", str(_archive(ref))], capture_output=True, text=True)
            if proc.returncode != 0:
                raise build.BuildError(f"ctr import of {ref} failed: {proc.stderr.strip()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.parse_args(argv)
    try:
        images = ensure_all()
    except (build.BuildError, subprocess.CalledProcessError) as e:
        print(f"flowkube: {e}", file=sys.stderr)
        return 1
    for ref in images.all():
        print(f"{ref}  {_size_mb(ref):.0f} MB" if _in_podman(ref) else ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
