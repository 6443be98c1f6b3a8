"""A node's containerd root laid down from a seed, without containerd: hard links to what is never
written in place, copies of the two databases containerd writes, a fallback where links fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowkube_devstack import imageseed


def _seed(root: Path) -> dict[str, Path]:
    files = {
        "blob": root / "io.containerd.content.v1.content" / "blobs" / "sha256" / "ab",
        "layer": root / "io.containerd.snapshotter.v1.overlayfs" / "snapshots" / "1" / "fs" / "bin" / "sh",
        **{db: root / db for db in imageseed.BOLT_DATABASES},
    }
    for name, path in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(name)
    return files


def test_blobs_and_layers_are_linked_and_the_databases_copied(tmp_path: Path) -> None:
    seed = _seed(tmp_path / "seed")
    imageseed.link_root(tmp_path / "seed", tmp_path / "node")
    for name, path in seed.items():
        mine = tmp_path / "node" / path.relative_to(tmp_path / "seed")
        assert mine.read_text() == name
        assert mine.samefile(path) == (name not in imageseed.BOLT_DATABASES), name
    (tmp_path / "node" / imageseed.BOLT_DATABASES[0]).write_text("the node's own")
    assert seed[imageseed.BOLT_DATABASES[0]].read_text() == imageseed.BOLT_DATABASES[0]


def test_where_links_cannot_be_made_the_node_starts_empty_and_imports(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _seed(tmp_path / "seed")
    monkeypatch.setattr(imageseed, "seeds_dir", lambda: tmp_path / "seeds")
    monkeypatch.setattr(imageseed, "_seed_for", lambda refs: tmp_path / "seed")

    def cross_device(seed_root: Path, root: Path) -> None:
        (root / "partial").mkdir(parents=True)
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(imageseed, "link_root", cross_device)
    assert not imageseed.lay_down(tmp_path / "node", ["localhost/x:1"])
    assert list((tmp_path / "node").iterdir()) == []
