"""Docs that list what the repository holds are kept true by a test (a list that drifts misleads)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_every_benchmark_is_listed_in_the_development_and_benchmarks_pages() -> None:
    benches = sorted(p.stem for p in (REPO / "tests" / "benchmarks").glob("bench_*.py"))
    assert benches
    for page in ("development.md", "benchmarks.md"):
        text = (REPO / "docs" / page).read_text()
        missing = [b for b in benches if f"`{b}" not in text]
        assert not missing, f"docs/{page} does not name {missing}"


PACKAGES = ("api/flowkube_api", "operator/flowkube_operator", "runner/flowkube_runner", "console/flowkube_console",
            "kubectl/flowkube_kubectl")


def layout_entry(text: str, package: str) -> str:
    """development.md's repository map, the entry of one package: from its line to the next entry."""
    block = text.split("## Repository layout", 1)[1].split("```", 2)[1]
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{package}/"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace()), len(lines))
    return "\n".join(lines[start:end])


def test_every_module_of_the_shipped_packages_is_on_the_development_pages_map() -> None:
    """A module added, renamed or moved without the map saying where it is fails here: a top-level
    module anywhere in its package's entry; a subpackage's module (and folder) in the part of the
    entry that its subpackage's name opens (up to the next subpackage's name)."""
    text = (REPO / "docs" / "development.md").read_text()
    for package in PACKAGES:
        entry, root = layout_entry(text, package), REPO / package
        subpackages = sorted(p.parent.name for p in root.glob("*/__init__.py"))
        missing = [n for n in [f"{d}/" for d in subpackages] + [p.name for p in root.glob("*.py")]
                   if n != "__init__.py" and n not in entry]
        assert not missing, f"docs/development.md's map of {package}/ does not name {missing}"
        heads = {d: m.start() for d in subpackages if (m := re.search(rf"(?<![\w/]){d}/", entry))}
        for d, start in heads.items():
            ends = [i for i in heads.values() if i > start]
            part = entry[start:min(ends, default=len(entry))]
            inside = [p for p in (root / d).rglob("*") if p.name != "__init__.py" and "__pycache__" not in p.parts]
            names = [f"{p.name}/" if p.is_dir() else p.name for p in inside if p.is_dir() or p.suffix == ".py"]
            missing = [n for n in names if n not in part]
            assert not missing, f"docs/development.md's map of {package}/{d}/ does not name {missing}"


def test_the_architecture_page_names_every_admission_handler_and_every_watched_kind() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    handlers = (REPO / "operator" / "flowkube_operator" / "handlers.py").read_text()
    ids = re.findall(r'id="([a-z-]+)"', handlers)
    assert 'id=f"validate-{plural}"' in handlers  # the templates' two, one per plural
    ids += ["validate-flowtemplates", "validate-clusterflowtemplates"]
    assert len(ids) == 6, ids
    missing = [i for i in ids if f"`{i}`" not in text]
    assert not missing, f"docs/architecture.md does not name the admission handlers {missing}"
    sources = "\n".join(p.read_text() for p in (REPO / "operator" / "flowkube_operator").rglob("*.py"))
    kinds = set(re.findall(r'"(Pod|Secret|Node|ServiceCIDR)"', sources)) | {
        "Flow", "FlowTemplate", "ClusterFlowTemplate", "CronFlow", "ControllerRevision"}
    missing = [k for k in sorted(kinds) if k not in text.split("**What the operator itself does per event.**")[1][:900]]
    assert not missing, f"docs/architecture.md's list of watches does not name {missing}"
