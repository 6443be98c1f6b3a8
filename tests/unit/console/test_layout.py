"""The console's Flows table as a browser lays it out (Debian's chromium, headless; no stack needed)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from types import SimpleNamespace

import pytest

from flowkube_console.pages import templates
from tests.integration.browser import browser, chromium_available

CSS = Path(__file__).resolve().parents[3] / "console" / "flowkube_console" / "static" / "console.css"
NOW = dt.datetime(2026, 11, 28, 12, 0, tzinfo=dt.UTC)


def row(phase: str, message: str, i: int) -> SimpleNamespace:
    return SimpleNamespace(namespace=f"team-research-and-publishing-{i:03d}-staging", name=f"weekly-digest-{i}",
                           phase=phase, definition="ResearchAndPublishWithHumanReview", tokens=1234567,
                           cost="12.345678", created=f"2026-11-28T{12 - i:02d}:00:00Z", message=message)


@pytest.mark.slow
@pytest.mark.skipif(not chromium_available(), reason="chromium and chromedriver are not installed")
def test_the_flows_tables_titles_and_phase_badges_stay_on_one_line_at_1400_pixels(tmp_path: Path) -> None:
    """At 1400 pixels the titles, badges and figures broke inside words ("Token s", "AwaitingFeedbac k",
    "123456 7", "60 m"); the message and the long names take the breaks."""
    long_message = "runner pod is waiting (ImagePullBackOff): " + "x" * 120
    items = [row("AwaitingFeedback", "awaiting feedback: Publish this draft?", 1),
             row("Running", long_message, 2), row("Succeeded", "the flow finished", 3)]
    table = templates().get_template("_flows.html").render(items=items, now=NOW)
    page = tmp_path / "flows.html"
    page.write_text(f'<!doctype html><html><head><link rel="stylesheet" href="{CSS.as_uri()}"></head>'
                    f"<body><main>{table}</main></body></html>")
    with browser(tmp_path, "layout") as b:
        b.resize(1400, 900)
        b.open(page.as_uri())
        b.wait(lambda: b.has("td .phase"), 10, "the table")
        b.screenshot("flows-table-1400")
        assert b.wrapped("th, .phase, td.num, td.age") == []
