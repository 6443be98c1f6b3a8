"""Docs that list what the repository holds are kept true by a test (a list that drifts misleads)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_every_benchmark_is_listed_in_the_development_and_benchmarks_pages() -> None:
    benches = sorted(p.stem for p in (REPO / "tests" / "benchmarks").glob("bench_*.py"))
    assert benches
    for page in ("development.md", "benchmarks.md"):
        text = (REPO / "docs" / page).read_text()
        missing = [b for b in benches if f"`{b}" not in text]
        assert not missing, f"docs/{page} does not name {missing}"
