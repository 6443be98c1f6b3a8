"""The binary cache: a complete entry is reused, a partial or corrupt one is detected."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from flowkube_devstack.build import MANIFEST, Component, verify

COMP = Component(name="thing", version="v1", module="example.com/thing", binaries=("a", "b"), packages=("x",))


def entry(tmp_path: Path) -> Path:
    d = tmp_path / "thing-v1"
    d.mkdir(parents=True)
    sums = {}
    for b in COMP.binaries:
        (d / b).write_bytes(b"binary " + b.encode())
        (d / b).chmod(0o755)
        sums[b] = hashlib.sha256((d / b).read_bytes()).hexdigest()
    (d / MANIFEST).write_text(json.dumps({"sha256": sums}))
    return d


def test_a_complete_entry_verifies(tmp_path: Path) -> None:
    assert verify(entry(tmp_path), COMP)


def test_a_truncated_binary_or_a_missing_manifest_is_detected(tmp_path: Path) -> None:
    d = entry(tmp_path)
    (d / "a").write_bytes(b"bin")  # a build killed while writing
    assert not verify(d, COMP)
    d2 = entry(tmp_path / "other")
    (d2 / MANIFEST).unlink()  # the manifest is written last: without it the entry is incomplete
    assert not verify(d2, COMP)
    d3 = entry(tmp_path / "third")
    (d3 / "b").unlink()
    assert not verify(d3, COMP)
