"""`bench_apply --kind` refuses any cluster it was not made for, before it touches one."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.benchmarks.kindtarget import KindTarget, NotThrowaway, kubeconfig_path


def test_a_cluster_without_the_scripts_kubeconfig_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(NotThrowaway) as e:
        KindTarget.open("prod", tmp_path)
    assert "refused" in str(e.value.code) and "KEEP_CLUSTER=1 CLUSTER=prod hack/kind-e2e.sh" in str(e.value.code)
    assert "no kubeconfig" in str(e.value.code)


def test_a_kubeconfig_for_another_context_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = kubeconfig_path("bench")
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump({"current-context": "production", "clusters": [], "users": []}))
    with pytest.raises(NotThrowaway) as e:
        KindTarget.open("bench", tmp_path)
    assert "'production', not kind-bench" in str(e.value.code)
