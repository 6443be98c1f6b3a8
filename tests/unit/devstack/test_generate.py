"""`./dev generate --check` (run by `./dev test`) fails on any generated file that no longer matches
its source, and `./dev generate` makes it current again."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowkube_devstack import generate


def test_every_generated_file_is_current() -> None:
    assert generate.stale() == [], "run `./dev generate`"


def test_a_stale_file_fails_the_check_and_generate_rewrites_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "generated.md"
    target.write_text("edited by hand\n")
    monkeypatch.setattr(generate, "REPO", tmp_path)
    monkeypatch.setattr(generate, "generators", lambda: {target: lambda: "from the source\n"})
    assert generate.main(["--check"]) == 1
    assert "stale: generated.md (run `./dev generate`)" in capsys.readouterr().err
    assert generate.main([]) == 0
    assert target.read_text() == "from the source\n"
    assert generate.main(["--check"]) == 0
