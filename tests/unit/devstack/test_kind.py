"""hack/kind-e2e.sh's pure parts: which engine and node image it picks, what it says is missing, the kind
config it writes, and the OCI archives of the node image's images."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
import yaml

from flowkube_devstack import images, kind
from flowkube_devstack.versions import COREDNS_VERSION, KUBERNETES_VERSION


def test_the_provider_is_the_one_asked_for_else_docker_else_podman() -> None:
    assert kind.choose_provider({"KIND_EXPERIMENTAL_PROVIDER": "podman"}, lambda tool: True) == "podman"
    assert kind.choose_provider({}, lambda tool: True) == "docker"
    # A docker CLI without a daemon (this machine kind) does not count as Docker.
    assert kind.choose_provider({}, lambda tool: tool == "podman") == "podman"
    assert kind.choose_provider({}, lambda tool: False) is None


def test_the_stock_node_image_needs_docker_and_a_registry() -> None:
    reachable, unreachable = (lambda: True), (lambda: False)
    assert kind.choose_node_image("docker", {}, reachable) == "stock"
    assert kind.choose_node_image("docker", {}, unreachable) == "local"
    assert kind.choose_node_image("podman", {}, reachable) == "local"
    assert kind.choose_node_image("podman", {"NODE_IMAGE": "stock"}, unreachable) == "stock"
    with pytest.raises(ValueError, match="NODE_IMAGE='kindest'"):
        kind.choose_node_image("docker", {"NODE_IMAGE": "kindest"}, reachable)


def test_missing_prerequisites_say_what_and_how() -> None:
    everything = lambda tool: f"/usr/bin/{tool}"  # noqa: E731
    assert kind.missing_prerequisites("podman", "local", everything, lib_modules=True) == []
    [engine] = kind.missing_prerequisites(None, "local", everything, lib_modules=True)
    assert "Docker" in engine.how and "podman" in engine.how
    no_mmdebstrap = lambda tool: None if tool == "mmdebstrap" else f"/usr/bin/{tool}"  # noqa: E731
    [m] = kind.missing_prerequisites("podman", "local", no_mmdebstrap, lib_modules=True)
    assert str(m).startswith("mmdebstrap is missing: apt-get install mmdebstrap")
    # The stock node image builds with docker alone: no local image tools are asked for.
    assert kind.missing_prerequisites("docker", "stock", no_mmdebstrap, lib_modules=True) == []
    [mods] = kind.missing_prerequisites("docker", "stock", everything, lib_modules=False)
    assert "mkdir -p /lib/modules" in mods.how
    [go] = kind.missing_prerequisites("docker", "stock", lambda t: None if t == "go" else t, lib_modules=True)
    assert go.what == "go" and "go.dev" in go.how


def _patches(config: dict[str, object], kind_name: str) -> list[dict[str, object]]:
    docs = [yaml.safe_load(p) for p in config["kubeadmConfigPatches"]]  # type: ignore[attr-defined]
    return [d for d in docs if d["kind"] == kind_name]


def test_the_stock_config_carries_only_the_patches_harmless_anywhere() -> None:
    config = yaml.safe_load(kind.render_config("c1", "stock"))
    assert config["name"] == "c1" and config["nodes"] == [{"role": "control-plane"}]
    assert "networking" not in config  # kind's own CNI (kindnet) on its own image
    [patch] = config["containerdConfigPatches"]
    assert "restrict_oom_score_adj = true" in patch
    [kubelet] = _patches(config, "KubeletConfiguration")
    assert kubelet["failCgroupV1"] is False
    assert not _patches(config, "ClusterConfiguration")


def test_the_local_config_names_its_image_cni_and_the_versions_built_here() -> None:
    config = yaml.safe_load(kind.render_config("c2", "local", "localhost/flowkube-kind-node:v1-abc"))
    assert config["nodes"] == [{"role": "control-plane", "image": "localhost/flowkube-kind-node:v1-abc"}]
    assert config["networking"] == {"disableDefaultCNI": True, "podSubnet": kind.POD_SUBNET}
    [cluster] = _patches(config, "ClusterConfiguration")
    assert cluster["dns"]["imageTag"] == COREDNS_VERSION  # type: ignore[index]
    etcd_image = f"registry.k8s.io/etcd:{cluster['etcd']['local']['imageTag']}"  # type: ignore[index]
    assert kind.control_plane_images()[etcd_image] == "etcd"
    assert kind.control_plane_images()[f"registry.k8s.io/kube-apiserver:{KUBERNETES_VERSION}"] == "kube-apiserver"
    with pytest.raises(ValueError, match="reference"):
        kind.render_config("c3", "local")


def test_the_node_bridge_cni_hands_out_the_configs_pod_subnet() -> None:
    path = kind.KIND_DIR / "node" / "etc" / "cni" / "net.d" / "10-flowkube-bridge.conflist"
    conflist = json.loads(path.read_text())
    assert conflist["plugins"][0]["ipam"]["ranges"] == [[{"subnet": kind.POD_SUBNET}]]


def test_an_oci_archive_names_its_images_and_holds_each_blob_once(tmp_path: Path) -> None:
    binary = tmp_path / "tool"
    binary.write_bytes(b"\x7fELF pretend")
    layer = kind.binary_layer(tmp_path / "layer.tar", {"/usr/local/bin/tool": binary})
    with tarfile.open(layer) as t:
        assert t.getnames() == ["usr", "usr/local", "usr/local/bin", "usr/local/bin/tool"]
        assert t.getmember("usr/local/bin/tool").mode == 0o755 and t.getmember("usr/local/bin/tool").uid == 0
    built = [images.OciImage("registry.k8s.io/a:v1", (layer,)),
             images.OciImage("registry.k8s.io/b:v1", (layer,), entrypoint=("/usr/local/bin/tool",))]
    out = io.BytesIO()
    images.write_oci_archive(out, built)
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as t:
        names = t.getnames()
        assert len(names) == len(set(names))
        files = {n: t.extractfile(n).read() for n in names}  # type: ignore[union-attr]
    for name, data in files.items():  # every blob is stored under its own digest
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]
    index = json.loads(files["index.json"])
    assert [m["annotations"]["io.containerd.image.name"] for m in index["manifests"]] == \
        ["registry.k8s.io/a:v1", "registry.k8s.io/b:v1"]
    manifest = json.loads(files["blobs/" + index["manifests"][1]["digest"].replace(":", "/")])
    config = json.loads(files["blobs/" + manifest["config"]["digest"].replace(":", "/")])
    assert config["config"]["Entrypoint"] == ["/usr/local/bin/tool"]
    assert config["rootfs"]["diff_ids"] == [manifest["layers"][0]["digest"]]
