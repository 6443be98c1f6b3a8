"""Build the control-plane binaries (and helm) from their Go modules, cached by version.

Each component is built in a scratch directory and moved into place only when every binary
is there; a manifest with the SHA-256 of each binary is written last. A cache entry whose
manifest is missing or does not match its files is treated as absent and rebuilt, so a build
killed halfway, or a truncated binary, never poisons later runs.

    python -m flowkube_devstack.build            # build (or verify) everything, print the paths
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from flowkube_devstack.versions import (
    COREDNS_VERSION,
    ETCD_VERSION,
    HELM_VERSION,
    JAEGER_VERSION,
    KIND_VERSION,
    KUBERNETES_VERSION,
)

MANIFEST = "manifest.json"


class BuildError(RuntimeError):
    """A component could not be built; the message says which command failed and why."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flowkube"


def go_version() -> str:
    go = shutil.which("go")
    if go is None:
        raise BuildError(
            "the Go toolchain is not on PATH; the local control plane is built from the "
            "Kubernetes Go modules and needs Go >= 1.26 (https://go.dev/dl/)"
        )
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


@dataclass(frozen=True)
class Component:
    name: str
    version: str
    module: str
    binaries: tuple[str, ...]
    packages: tuple[str, ...]
    ldflags: tuple[str, ...] = ()
    replaces: dict[str, str] = field(default_factory=dict)
    main_go: str | None = None  # a tiny main package of our own, when upstream has none we can build

    def key(self, go: str) -> str:
        return f"{self.name}-{self.version}-{go}"


def _kubernetes_ldflags(version: str) -> tuple[str, ...]:
    major, minor = version.lstrip("v").split(".")[:2]
    values = {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "gitCommit": "0000000000000000000000000000000000000000",
        "buildDate": "1970-01-01T00:00:00Z",
    }
    flags = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X '{pkg}.{k}={v}'" for k, v in values.items()]
    return tuple(flags)


def _staging_replaces(version: str) -> dict[str, str]:
    """k8s.io/kubernetes replaces its staging modules with local paths; map them to published ones."""
    info = _go_json(["go", "mod", "download", "-json", f"k8s.io/kubernetes@{version}"])
    gomod = Path(info["GoMod"]).read_text()
    staging_version = "v0." + version.lstrip("v").split(".", 1)[1]
    mods = re.findall(r"^\s*(k8s\.io/[\w.-]+)\s*=>\s*\./staging/", gomod, flags=re.M)
    if not mods:
        raise BuildError(f"found no staging modules in k8s.io/kubernetes@{version}'s go.mod")
    return {m: f"{m} {staging_version}" for m in mods}


def _go_json(cmd: list[str]) -> dict[str, str]:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"`{' '.join(cmd)}` failed:\n{proc.stderr.strip() or proc.stdout.strip()}")
    data: dict[str, str] = json.loads(proc.stdout)
    return data


def _kubernetes_component(name: str, binaries: tuple[str, ...]) -> Component:
    """Commands of the pinned k8s.io/kubernetes module, built with its version stamped in."""
    return Component(
        name=name,
        version=KUBERNETES_VERSION,
        module="k8s.io/kubernetes",
        binaries=binaries,
        packages=tuple(f"k8s.io/kubernetes/cmd/{b}" for b in binaries),
        ldflags=_kubernetes_ldflags(KUBERNETES_VERSION),
    )


def kubernetes() -> Component:
    return _kubernetes_component("kubernetes", ("kube-apiserver", "kube-controller-manager", "kube-scheduler",
                                                "kubectl"))


def kubernetes_node() -> Component:
    """The node's own binaries, from the same module and version as the control plane."""
    return _kubernetes_component("kubernetes-node", ("kubelet", "kube-proxy"))


def kubeadm() -> Component:
    """kubeadm, which sets up a kind node, from the same module and version as the control plane."""
    return _kubernetes_component("kubeadm", ("kubeadm",))


def kind() -> Component:
    """kind (Kubernetes in Docker or podman), for hack/kind-e2e.sh, from its Go module."""
    return Component(
        name="kind",
        version=KIND_VERSION,
        module="sigs.k8s.io/kind",
        binaries=("kind",),
        packages=("sigs.k8s.io/kind",),
    )


def coredns() -> Component:
    """The cluster DNS server Kubernetes ships by default (kubeadm, kind), from its Go module."""
    return Component(
        name="coredns",
        version=COREDNS_VERSION,
        module="github.com/coredns/coredns",
        binaries=("coredns",),
        packages=("github.com/coredns/coredns",),
    )


def jaeger() -> Component:
    """Jaeger v2 (an OpenTelemetry Collector build with Jaeger's storage and query), from its Go module."""
    return Component(
        name="jaeger",
        version=JAEGER_VERSION,
        module="github.com/jaegertracing/jaeger",
        binaries=("jaeger",),
        packages=("github.com/jaegertracing/jaeger/cmd/jaeger",),
    )


def etcd() -> Component:
    return Component(
        name="etcd",
        version=ETCD_VERSION,
        module="go.etcd.io/etcd/server/v3",
        binaries=("etcd",),
        packages=(".",),
        ldflags=(),
        main_go=(
            "package main\n\n"
            'import (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\n'
            "func main() { etcdmain.Main(os.Args) }\n"
        ),
    )


def helm() -> Component:
    major = HELM_VERSION.split(".")[0]
    module = f"helm.sh/helm/{major}"
    # Without these, `helm template` and `helm lint` assume Kubernetes 1.20 (upstream's Makefile
    # derives them from client-go); we pin them to the control plane we actually test against.
    kube_major, kube_minor = KUBERNETES_VERSION.lstrip("v").split(".")[:2]
    ldflags = [f"-X '{module}/internal/version.version={HELM_VERSION}'"]
    for pkg in ("pkg/lint/rules", "pkg/chartutil"):
        ldflags += [f"-X '{module}/{pkg}.k8sVersionMajor={kube_major}'",
                    f"-X '{module}/{pkg}.k8sVersionMinor={kube_minor}'"]
    return Component(
        name="helm",
        version=HELM_VERSION,
        module=module,
        binaries=("helm",),
        packages=(f"{module}/cmd/helm",),
        ldflags=tuple(ldflags),
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify(dest: Path, comp: Component) -> bool:
    """True when dest holds every binary of comp, byte for byte as the manifest recorded them."""
    try:
        manifest = json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    sums = manifest.get("sha256", {})
    for b in comp.binaries:
        p = dest / b
        if not p.is_file() or not os.access(p, os.X_OK) or sums.get(b) != _sha256(p):
            return False
    return True


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise BuildError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}); log {log}:\n{tail}")


def _build(comp: Component, dest: Path, go: str) -> dict[str, float]:
    scratch = dest.with_name(dest.name + f".building-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    src = scratch / "src"
    out = scratch / "bin"
    src.mkdir(parents=True)
    out.mkdir()
    log = scratch / "build.log"
    env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-mod=mod", GOTOOLCHAIN="local")
    started = time.monotonic()

    replaces = _staging_replaces(comp.version) if comp.module == "k8s.io/kubernetes" else comp.replaces
    gomod = [f"module flowkube.local/build/{comp.name}", "", f"go {go.removeprefix('go')}", ""]
    gomod.append(f"require {comp.module} {comp.version}")
    gomod += [f"replace {m} => {target}" for m, target in sorted(replaces.items())]
    if comp.main_go is None:
        gomod += [f"tool {p}" for p in comp.packages]
    (src / "go.mod").write_text("\n".join(gomod) + "\n")
    if comp.main_go is not None:
        (src / "main.go").write_text(comp.main_go)

    _run(["go", "mod", "tidy"], src, env, log)
    flags = ["-trimpath", "-ldflags", "-s -w " + " ".join(comp.ldflags)]
    if comp.main_go is not None:
        _run(["go", "build", *flags, "-o", str(out / comp.binaries[0]), "."], src, env, log)
    else:
        _run(["go", "build", *flags, "-o", str(out) + "/", *comp.packages], src, env, log)

    sums = {b: _sha256(out / b) for b in comp.binaries}
    elapsed = time.monotonic() - started
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    (out / MANIFEST).write_text(
        json.dumps({"component": comp.key(go), "sha256": sums, "build_seconds": round(elapsed, 1),
                    "peak_child_rss_mb": round(peak_mb)}, indent=2)
    )
    shutil.rmtree(dest, ignore_errors=True)
    out.rename(dest)
    shutil.rmtree(scratch, ignore_errors=True)
    return {"seconds": elapsed, "peak_rss_mb": peak_mb}


def ensure(comp: Component, *, quiet: bool = False) -> Path:
    """Return the directory holding comp's verified binaries, building them first if needed."""
    go = go_version()
    dest = cache_root() / "bin" / comp.key(go)
    if verify(dest, comp):
        return dest
    with _lock(cache_root() / "locks" / f"{comp.name}.lock"):
        if verify(dest, comp):  # another process finished it while we waited
            return dest
        if dest.exists() and not quiet:
            print(f"flowkube: cached {comp.key(go)} is incomplete or corrupt; rebuilding",
                  file=sys.stderr)
        if not quiet:
            print(f"flowkube: building {comp.key(go)} from source (one time, cached in {dest})",
                  file=sys.stderr, flush=True)
        figures = _build(comp, dest, go)
        if not quiet:
            print(f"flowkube: built {comp.name} in {figures['seconds']:.0f}s, "
                  f"peak child RSS {figures['peak_rss_mb']:.0f} MB", file=sys.stderr)
    if not verify(dest, comp):
        raise BuildError(f"{dest} does not verify right after building it")
    return dest


def control_plane(*, node: bool = False) -> dict[str, Path]:
    """Paths of etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kubectl; with
    ``node``, also kubelet, kube-proxy and coredns."""
    paths: dict[str, Path] = {}
    for comp in (etcd(), kubernetes(), *((kubernetes_node(), coredns()) if node else ())):
        d = ensure(comp)
        paths.update({b: d / b for b in comp.binaries})
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    factories = {"etcd": etcd, "kubernetes": kubernetes, "kubernetes-node": kubernetes_node,
                 "coredns": coredns, "helm": helm, "jaeger": jaeger}
    defaults = list(factories)
    factories |= {"kubeadm": kubeadm, "kind": kind}  # hack/kind-e2e.sh's own, built only when named
    # Checked here, not with `choices`: argparse checks an empty `nargs="*"` against them as one value.
    parser.add_argument("components", nargs="*", metavar="COMPONENT",
                        help=f"any of {', '.join(factories)} (default: {', '.join(defaults)})")
    args = parser.parse_args(argv)
    if unknown := set(args.components) - set(factories):
        parser.error(f"unknown component(s): {', '.join(sorted(unknown))}; choose from {', '.join(factories)}")
    try:
        for name in args.components or defaults:
            print(ensure(factories[name]()))
    except BuildError as e:
        print(f"flowkube: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
