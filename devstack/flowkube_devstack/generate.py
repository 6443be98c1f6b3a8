"""`./dev generate`: every generated file of the repository, from its one source.

    ./dev generate           rewrite the files that differ from their source
    ./dev generate --check   list the stale ones and exit 1 (run by `./dev test`, so CI fails on them)

| file | source |
|---|---|
| crds/flowkube.io_{flows,flowtemplates,clusterflowtemplates}.yaml | the pydantic models in api/flowkube_api/models/ |
| charts/flowkube/templates/crds/*.yaml | those CRDs, wrapped in the chart's `crds.*` switches |
| charts/flowkube/templates/status-policy.yaml | the Flow status model (who may write which status field) |
| charts/flowkube/README.md (values table) | the `# --` comments of charts/flowkube/values.yaml |
| charts/flowkube/dashboards/flowkube.json | the Grafana dashboard built in dashboard.py |
| docs/configuration.md | the operator's `Settings` and the chart's Deployment template |
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

from flowkube_api import crd
from flowkube_devstack import chart, dashboard, docsgen

REPO = Path(__file__).resolve().parents[2]
COMMAND = "./dev generate"


def generators() -> dict[Path, Callable[[], str]]:
    """Each generated file and the function that renders its content, in dependency order."""
    out: dict[Path, Callable[[], str]] = {}
    for kind in crd.KINDS:
        out[crd.CRD_FILES[kind]] = functools.partial(crd.render, kind)
        out[chart.CHART_CRD_FILES[kind]] = functools.partial(chart.render, None, kind)
    return out | {
        chart.STATUS_POLICY_FILE: chart.render_status_policy,
        chart.README_FILE: chart.render_readme,
        dashboard.OUT: dashboard.render,
        docsgen.CONFIGURATION_FILE: docsgen.render_configuration,
    }


def _current(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def stale() -> list[Path]:
    """The generated files whose content differs from what their source renders today."""
    return [path for path, render in generators().items() if _current(path) != render()]


def write() -> list[Path]:
    """Rewrite what differs (in order: a chart's CRD is rendered from its CRD file); return it."""
    changed = []
    for path, render in generators().items():
        text = render()
        if _current(path) != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 when a generated file is stale")
    args = parser.parse_args(argv)
    if args.check:
        old = stale()
        for path in old:
            print(f"stale: {path.relative_to(REPO)} (run `{COMMAND}`)", file=sys.stderr)
        if not old:
            print(f"generated files are current ({len(generators())} checked)")
        return 1 if old else 0
    for path in write():
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
