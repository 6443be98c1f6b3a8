"""kind for hack/kind-e2e.sh: the kind binary, a node image assembled here, the cluster's config, images.

    python -m flowkube_devstack.kind env          # check prerequisites, choose the provider and the images;
                                                  # print them as shell assignments (the script evals them)
    python -m flowkube_devstack.kind node-image   # build (or find cached) the local node image; print its ref
    python -m flowkube_devstack.kind images       # the project's images for the cluster (see `env`)
    python -m flowkube_devstack.kind config       # the kind cluster config for the chosen node image
    python -m flowkube_devstack.kind load NODE REF...    # stream images into a kind node's containerd
    python -m flowkube_devstack.kind stub-model IMAGE    # deploy the stub model in the cluster (KUBECONFIG)

kind itself is built from its Go module (``build.kind()``), cached like the other binaries. Its node image
comes from one of two places:

- ``stock``: kind's own image from Docker Hub, when the provider is Docker and a registry is reachable;
  the project's images are then built with ``docker build`` as any user would.
- ``local``: an image assembled here for the pinned Kubernetes version, because kind's own
  ``kind build node-image`` clones and downloads its parts from the internet. A Debian rootfs
  (mmdebstrap: systemd, containerd, runc, the CNI plugins) with kind's base files from its Go module,
  kubelet/kubeadm/kubectl built here, and, as OCI archives imported before kubelet starts, the images a
  kubeadm cluster runs (kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy, etcd,
  CoreDNS from the binaries built here; the pause image of ``images.pause()``). The project's images
  come from the local stack's build (``images.ensure_all()``). Cached by content, like those.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from flowkube_devstack import build, images, stack
from flowkube_devstack.versions import COREDNS_VERSION, ETCD_VERSION, KIND_VERSION, KUBERNETES_VERSION

REPO = Path(__file__).resolve().parents[2]
KIND_DIR = REPO / "hack" / "kind"
NODE_RECIPE_VERSION = "1"  # bump to rebuild the node image after a change to how it is built

# kind's base image packages (images/base/Dockerfile) that Debian has; containerd, runc and the CNI
# plugins are Debian's too (kind builds its own from git, which needs the internet).
NODE_PACKAGES = ("systemd", "conntrack", "iptables", "iproute2", "ethtool", "kmod", "libseccomp2", "procps",
                 "ca-certificates", "jq", "containerd", "runc", "containernetworking-plugins")
KUBE_PROXY_PACKAGES = ("iptables",)
POD_SUBNET = "10.244.0.0/16"  # kind's default; the node image's bridge CNI config hands out addresses in it
REGISTRY_PROBE = "https://registry-1.docker.io/v2/"  # where kind's stock node image comes from
MMDEBSTRAP_OPTIONS = ('--aptopt=APT::Install-Recommends "false"', "--skip=output/dev")


def kind_binary() -> Path:
    return build.ensure(build.kind()) / "kind"


# -- prerequisites and choices ------------------------------------------------------------------------


@dataclass(frozen=True)
class Missing:
    what: str
    how: str

    def __str__(self) -> str:
        return f"{self.what} is missing: {self.how}"


LOCAL_TOOLS = {
    "podman": "apt-get install podman (builds the images; no registry is needed)",
    "buildah": "apt-get install buildah",
    "skopeo": "apt-get install skopeo",
    "mmdebstrap": "apt-get install mmdebstrap (the Debian root filesystems of the images)",
    "gcc": "apt-get install gcc libc6-dev (the pause image is a static binary)",
}


def choose_provider(env: Mapping[str, str], works: Callable[[str], bool]) -> str | None:
    """kind's provider: KIND_EXPERIMENTAL_PROVIDER when set, else Docker when its daemon answers, else
    podman when it runs. ``works(tool)`` says whether the tool's engine answers (``docker info``)."""
    chosen = env.get("KIND_EXPERIMENTAL_PROVIDER", "")
    if chosen:
        return chosen
    for provider in ("docker", "podman"):
        if works(provider):
            return provider
    return None


def choose_node_image(provider: str, env: Mapping[str, str], registry_reachable: Callable[[], bool]) -> str:
    """``stock`` (kind's own node image, and the project's images built by docker) or ``local``: NODE_IMAGE
    says which when set; otherwise stock only with Docker and a reachable registry."""
    forced = env.get("NODE_IMAGE", "")
    if forced in ("stock", "local"):
        return forced
    if forced:
        raise ValueError(f"NODE_IMAGE={forced!r}: expected `stock` or `local`")
    return "stock" if provider == "docker" and registry_reachable() else "local"


def missing_prerequisites(provider: str | None, node_image: str, which: Callable[[str], str | None],
                          lib_modules: bool) -> list[Missing]:
    """What the chosen way needs and this machine lacks, each with how to get it."""
    if provider is None:
        return [Missing("a container engine", "install Docker (https://docs.docker.com/engine/install/) and "
                        "start its daemon, or podman (apt-get install podman)")]
    missing: list[Missing] = []
    if provider not in ("docker", "podman"):
        missing.append(Missing(f"a provider kind supports (KIND_EXPERIMENTAL_PROVIDER={provider})",
                               "set KIND_EXPERIMENTAL_PROVIDER to docker or podman, or unset it"))
    tools = {"go": "Go >= 1.26 (https://go.dev/dl/): kind, kubectl and helm are built from their Go modules",
             "curl": "apt-get install curl (reads /metrics)"}
    if node_image == "local":
        tools |= LOCAL_TOOLS
    missing += [Missing(tool, how) for tool, how in tools.items() if which(tool) is None]
    if not lib_modules:
        missing.append(Missing("/lib/modules", "kind mounts the host's /lib/modules into its nodes; "
                               "create it (even empty): mkdir -p /lib/modules"))
    return missing


def engine_works(tool: str) -> bool:
    if shutil.which(tool) is None:
        return False
    env = images.podman_env() if tool == "podman" else dict(os.environ)
    try:
        return subprocess.run([tool, "info"], capture_output=True, env=env, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _registry_reachable(url: str = REGISTRY_PROBE, timeout: float = 5.0) -> bool:
    """Any HTTP answer (a registry's /v2/ says 401 without a token) means it is reachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


# -- the kind config ------------------------------------------------------------------------------------


def render_config(name: str, node_image: str, image_ref: str | None = None) -> str:
    """The kind Cluster config. Always: containerd's ``restrict_oom_score_adj`` (pod sandboxes ask for an
    oom_score_adj that root without CAP_SYS_RESOURCE may not set; elsewhere a no-op) and kubelet's
    ``failCgroupV1: false`` (Kubernetes 1.36 refuses cgroup v1 otherwise; on cgroup v2 it changes
    nothing). For the local node image also: its image, its bridge CNI instead of kind's kindnet
    (whose image is not built here), and the etcd and CoreDNS versions built here."""
    kubelet = {"apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration", "failCgroupV1": False}
    node: dict[str, Any] = {"role": "control-plane"}
    config: dict[str, Any] = {
        "kind": "Cluster",
        "apiVersion": "kind.x-k8s.io/v1alpha4",
        "name": name,
        "nodes": [node],
        "containerdConfigPatches": ['[plugins."io.containerd.grpc.v1.cri"]\n  restrict_oom_score_adj = true\n'],
        "kubeadmConfigPatches": [yaml.safe_dump(kubelet, sort_keys=False)],
    }
    if node_image == "local":
        if image_ref is None:
            raise ValueError("the local node image needs its reference")
        node["image"] = image_ref
        config["networking"] = {"disableDefaultCNI": True, "podSubnet": POD_SUBNET}
        cluster = {"apiVersion": "kubeadm.k8s.io/v1beta4", "kind": "ClusterConfiguration",
                   "etcd": {"local": {"imageTag": etcd_tag()}}, "dns": {"imageTag": COREDNS_VERSION}}
        config["kubeadmConfigPatches"].append(yaml.safe_dump(cluster, sort_keys=False))
    return yaml.dump(config, Dumper=_BlockDumper, sort_keys=False)


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the patches) as literal blocks, as one writes them by hand."""


_BlockDumper.add_representer(str, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))


def etcd_tag() -> str:
    """etcd's image tag in kubeadm's form (``3.6.16-0``: version and image revision)."""
    return ETCD_VERSION.removeprefix("v") + "-0"


def control_plane_images() -> dict[str, str]:
    """Image name -> the binary it runs, under the names kubeadm uses for the pinned version (etcd and
    CoreDNS: their versions built here, which the config's ClusterConfiguration names)."""
    return {
        f"registry.k8s.io/kube-apiserver:{KUBERNETES_VERSION}": "kube-apiserver",
        f"registry.k8s.io/kube-controller-manager:{KUBERNETES_VERSION}": "kube-controller-manager",
        f"registry.k8s.io/kube-scheduler:{KUBERNETES_VERSION}": "kube-scheduler",
        f"registry.k8s.io/etcd:{etcd_tag()}": "etcd",
        f"registry.k8s.io/coredns/coredns:{COREDNS_VERSION}": "coredns",
    }


KUBE_PROXY_IMAGE = f"registry.k8s.io/kube-proxy:{KUBERNETES_VERSION}"


# -- image layers -----------------------------------------------------------------------------------------


def binary_layer(dest: Path, files: Mapping[str, Path]) -> Path:
    """An uncompressed layer holding ``files`` (path in the image -> file here), executable, owned by root."""
    with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tar:
        dirs = {str(d) for p in files for d in Path(p.lstrip("/")).parents if str(d) != "."}
        for d in sorted(dirs):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for inside, src in sorted(files.items()):
            info = tar.gettarinfo(str(src), arcname=inside.lstrip("/"))
            info.mode, info.uid, info.gid, info.uname, info.gname, info.mtime = 0o755, 0, 0, "root", "root", 0
            with src.open("rb") as f:
                tar.addfile(info, f)
    return dest


# -- the local node image -----------------------------------------------------------------------------------


def _rootfs_command(packages: Iterable[str], out: Path) -> list[str]:
    """mmdebstrap for a node's Debian: without recommended packages or device files (the container has its own)."""
    return images.mmdebstrap_command(packages, out, cleanup=images.APT_CLEANUP, extra=MMDEBSTRAP_OPTIONS)


def node_rootfs(*, quiet: bool = False) -> str:
    """Debian with what a kind node runs (systemd, containerd, runc, CNI plugins, iptables), as a podman image."""
    key = images.content_key(REPO, (), NODE_RECIPE_VERSION, *_rootfs_command(NODE_PACKAGES, Path("rootfs.tar")))
    ref = f"localhost/flowkube-kind-rootfs:{key}"

    def make() -> None:
        with tempfile.TemporaryDirectory(prefix="flowkube-kind-rootfs-") as tmp:
            rootfs = Path(tmp) / "rootfs.tar"
            images.run(_rootfs_command(NODE_PACKAGES, rootfs), log=images.log_path(ref))
            images.run(["podman", "import", "-q", str(rootfs), ref], log=images.log_path(ref))

    return images.ensure_image(ref, make, f"Debian {images.DEBIAN_SUITE} for a kind node, by mmdebstrap", quiet=quiet)


def _kind_module() -> Path:
    cmd = ["go", "mod", "download", "-json", f"sigs.k8s.io/kind@{KIND_VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise build.BuildError(f"`{' '.join(cmd)}` failed:\n{(proc.stdout + proc.stderr).strip()[-2000:]}")
    return Path(json.loads(proc.stdout)["Dir"])


def _copy_tree(src: Path, dest: Path) -> None:
    """Copy a read-only module tree with kind's permissions: scripts 0755, other files 0644."""
    for f in sorted(src.rglob("*")):
        target = dest / f.relative_to(src)
        if f.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            target.chmod(0o755)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)
            executable = f.parent.name == "bin" or os.access(f, os.X_OK)
            target.chmod(0o755 if executable else 0o644)


def _binaries() -> dict[str, Path]:
    paths: dict[str, Path] = {}
    for comp in (build.etcd(), build.kubernetes(), build.kubernetes_node(), build.coredns(), build.kubeadm()):
        d = build.ensure(comp)
        paths.update({b: d / b for b in comp.binaries})
    return paths


def _node_context(ctx: Path, bins: Mapping[str, Path], pause: str, log: Path) -> None:
    """The build context of node.Containerfile: kind's base files, our files, binaries, image archives."""
    _copy_tree(_kind_module() / "images" / "base" / "files", ctx / "kind-base")
    _copy_tree(KIND_DIR / "node", ctx / "node")
    (ctx / "node" / "kind" / "version").write_text(KUBERNETES_VERSION)
    (ctx / "bin").mkdir()
    for b in ("kubelet", "kubeadm", "kubectl"):
        shutil.copyfile(bins[b], ctx / "bin" / b)
        (ctx / "bin" / b).chmod(0o755)
    layers = ctx / "layers"
    layers.mkdir()
    built = [images.OciImage(name, (binary_layer(layers / f"{b}.tar", {f"/usr/local/bin/{b}": bins[b]}),),
                             entrypoint=("/usr/local/bin/coredns",) if b == "coredns" else ())
             for name, b in control_plane_images().items()]
    # kube-proxy writes iptables rules: a Debian rootfs with iptables, and a wrapper choosing its backend.
    proxy_rootfs = layers / "kube-proxy-rootfs.tar"
    images.run(_rootfs_command(KUBE_PROXY_PACKAGES, proxy_rootfs), log=log)
    proxy = binary_layer(layers / "kube-proxy.tar", {
        "/usr/local/bin/kube-proxy.bin": bins["kube-proxy"],
        "/usr/local/bin/kube-proxy": KIND_DIR / "kube-proxy" / "kube-proxy"})
    built.append(images.OciImage(KUBE_PROXY_IMAGE, (proxy_rootfs, proxy)))
    (ctx / "images").mkdir()
    with (ctx / "images" / "kubernetes.tar").open("wb") as out:
        images.write_oci_archive(out, built, {pause: pause})
    shutil.rmtree(layers)


def node_image_key(go: str, rootfs: str, pause: str) -> str:
    files = ("hack/kind/node.Containerfile", "hack/kind/node", "hack/kind/kube-proxy")
    return images.content_key(REPO, files, NODE_RECIPE_VERSION, KUBERNETES_VERSION, KIND_VERSION, ETCD_VERSION,
                              COREDNS_VERSION, go, rootfs, pause, *_rootfs_command(KUBE_PROXY_PACKAGES, Path("p.tar")))


def node_image(*, quiet: bool = False) -> str:
    """The local kind node image for the pinned Kubernetes version (``localhost/flowkube-kind-node``)."""
    rootfs = node_rootfs(quiet=quiet)
    pause = images.pause(quiet=quiet)
    bins = _binaries()
    ref = f"localhost/flowkube-kind-node:{KUBERNETES_VERSION}-{node_image_key(build.go_version(), rootfs, pause)}"

    def make() -> None:
        log = images.log_path(ref)
        images.ensure_in_podman(rootfs)
        with tempfile.TemporaryDirectory(prefix="flowkube-kind-node-") as tmp:
            ctx = Path(tmp)
            _node_context(ctx, bins, pause, log)
            images.run(["podman", "build", "--pull=never", "--network=none", "--build-arg", f"ROOTFS={rootfs}",
                        "--build-arg", f"PAUSE_IMAGE={pause}", "-f", str(KIND_DIR / "node.Containerfile"),
                        "-t", ref, str(ctx)], log=log)

    return images.ensure_image(ref, make, f"a kind node for Kubernetes {KUBERNETES_VERSION}", quiet=quiet)


# -- the project's images, and loading them into a node ---------------------------------------------------


def engine_env(provider: str) -> dict[str, str]:
    return images.podman_env() if provider == "podman" else dict(os.environ)


def to_docker(ref: str) -> None:
    """Copy an image of the local store into Docker's (the docker provider with local images)."""
    if subprocess.run(["docker", "image", "inspect", ref], capture_output=True).returncode == 0:
        return
    with images.store_lock(shared=True):
        images.run(["skopeo", "copy", "-q", "--src-shared-blob-dir", str(images.blob_dir()),
                    f"oci:{images.layout_path(ref)}:{ref}", f"docker-daemon:{ref}"])


def load(provider: str, node: str, refs: Sequence[str]) -> float:
    """Stream images of the local store into a kind node's containerd (``ctr images import`` in the node,
    the way ``kind load`` does it), each blob once. Returns the seconds it took."""
    started = time.monotonic()
    cmd = [provider, "exec", "-i", node, "ctr", "--namespace", "k8s.io", "images", "import", "--all-platforms", "-"]
    images.import_archive(cmd, refs, env=engine_env(provider))
    return time.monotonic() - started


# -- the stub model in the cluster ------------------------------------------------------------------------


def deploy_stub_model(kubectl: str, devstack_image: str) -> str:
    """The local stack's stub model (its Deployment, Service and the demo's rules) in the kind cluster
    that KUBECONFIG names, through the ``kubectl`` binary."""

    def run_kubectl(*args: str, check: bool = True, input: str | None = None,
                    timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([kubectl, *args], capture_output=True, text=True, input=input, timeout=timeout)
        if check and proc.returncode != 0:
            raise build.BuildError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc

    return stack.deploy_stub_model(run_kubectl, devstack_image, stack.DEMO_RULES)


# -- figures ------------------------------------------------------------------------------------------------


def node_memory(provider: str, node: str) -> str:
    """The node container's memory from its cgroup: the peak (page cache included: image imports fill
    it) and what its processes hold now (cgroup v1 total_rss, v2 anon)."""
    out = subprocess.run([provider, "inspect", "-f", "{{.State.Pid}}", node], capture_output=True, text=True,
                         env=engine_env(provider))
    try:
        lines = Path(f"/proc/{int(out.stdout.strip())}/cgroup").read_text().splitlines()
    except (OSError, ValueError):
        return f"node memory: unknown (cannot inspect {node})"
    groups = {parts[1]: parts[2] for parts in (line.split(":", 2) for line in lines) if len(parts) == 3}
    if "memory" in groups:  # cgroup v1
        d = Path("/sys/fs/cgroup/memory") / groups["memory"].lstrip("/")
        peak_file, stat_key = "memory.max_usage_in_bytes", "total_rss"
    else:
        d = Path("/sys/fs/cgroup") / groups.get("", "").lstrip("/")
        peak_file, stat_key = "memory.peak", "anon"
    if d.name == "init.scope":
        d = d.parent
    try:
        peak = int((d / peak_file).read_text())
        stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
        resident = int(stat[stat_key])
    except (OSError, ValueError, KeyError):
        return f"node memory: unknown (no {peak_file} under {d})"
    return (f"node memory: peak {peak / 2**20:.0f} MiB (cgroup, page cache included), "
            f"resident now {resident / 2**20:.0f} MiB")


# -- command line -------------------------------------------------------------------------------------------


def _env(args: argparse.Namespace) -> int:
    """Prerequisites and choices, as shell assignments on stdout; what is missing on stderr (exit 1)."""
    provider = choose_provider(os.environ, engine_works)
    try:
        mode = choose_node_image(provider or "", os.environ, _registry_reachable) if provider else "local"
    except ValueError as e:
        print(f"kind-e2e: {e}", file=sys.stderr)
        return 1
    missing = missing_prerequisites(provider, mode, shutil.which, Path("/lib/modules").is_dir())
    if missing:
        for m in missing:
            print(f"kind-e2e: {m}", file=sys.stderr)
        return 1
    assert provider is not None
    started = time.monotonic()
    kind = kind_binary()
    # KUBECTL and HELM may name the user's own (kubectl within one minor of the cluster's Kubernetes).
    kubectl = os.environ.get("KUBECTL") or build.ensure(build.kubernetes()) / "kubectl"
    helm = os.environ.get("HELM") or build.ensure(build.helm()) / "helm"
    out = {"PROVIDER": provider, "NODE_IMAGE": mode, "KIND": str(kind), "KUBECTL": str(kubectl), "HELM": str(helm),
           "TOOLS_SECONDS": f"{time.monotonic() - started:.0f}"}
    if provider == "podman":
        out |= {k: v for k, v in images.podman_env().items() if k.startswith("CONTAINERS_")}
        out["KIND_EXPERIMENTAL_PROVIDER"] = "podman"
    print("\n".join(f"{k}={shlex.quote(v)}" for k, v in out.items()))
    return 0


def _images(args: argparse.Namespace) -> int:
    """The local stack's images for the cluster: KEY=ref lines (operator, runner, devstack)."""
    refs = images.ensure_all()
    print(f"OPERATOR_IMAGE={refs.operator}\nRUNNER_IMAGE={refs.runner}\nDEVSTACK_IMAGE={refs.devstack}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env", help="check prerequisites, choose provider and node image, build kind/kubectl/helm")
    sub.add_parser("node-image", help="build (or find) the local node image and print its reference")
    sub.add_parser("images", help="build (or find) the project's images and print their references")
    c = sub.add_parser("config", help="print the kind cluster config")
    c.add_argument("--name", required=True)
    c.add_argument("--node-image", choices=("stock", "local"), required=True)
    c.add_argument("--image-ref")
    ld = sub.add_parser("load", help="stream images of the local store into a kind node")
    ld.add_argument("--provider", choices=("docker", "podman"), required=True)
    ld.add_argument("node")
    ld.add_argument("refs", nargs="+")
    d = sub.add_parser("to-docker", help="copy images of the local store into Docker")
    d.add_argument("refs", nargs="+")
    m = sub.add_parser("memory", help="the node container's memory figures")
    m.add_argument("--provider", choices=("docker", "podman"), required=True)
    m.add_argument("node")
    s = sub.add_parser("stub-model", help="deploy the stub model (kubectl from KUBECTL, cluster from KUBECONFIG)")
    s.add_argument("--kubectl", required=True)
    s.add_argument("devstack_image")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "env":
            return _env(args)
        if args.cmd == "node-image":
            print(node_image())
        elif args.cmd == "images":
            return _images(args)
        elif args.cmd == "config":
            print(render_config(args.name, args.node_image, args.image_ref), end="")
        elif args.cmd == "load":
            seconds = load(args.provider, args.node, args.refs)
            print(f"kind-e2e: loaded {len(args.refs)} images into {args.node} in {seconds:.1f} s", file=sys.stderr)
        elif args.cmd == "to-docker":
            for ref in args.refs:
                to_docker(ref)
        elif args.cmd == "memory":
            print(node_memory(args.provider, args.node))
        elif args.cmd == "stub-model":
            print(deploy_stub_model(args.kubectl, args.devstack_image))
    except build.BuildError as e:
        print(f"kind-e2e: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
