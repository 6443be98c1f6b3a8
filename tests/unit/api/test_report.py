"""The run report's wire form: bounded however it was compressed."""

from __future__ import annotations

import gzip
import tracemalloc

import pytest

from flowkube_api.constants import Reason, RunResult, Trigger
from flowkube_api.report import REPORT_LIMIT, ReportTooLarge, RunReport, Usage, gunzip
from tests.abuse import gzip_bomb

REPORT = RunReport(pod="demo-0", trigger=Trigger.KICKOFF, result=RunResult.SUCCEEDED, reason=Reason.RUN_SUCCEEDED,
                   exit_code=0, usage=Usage(total_tokens=7, prompt_tokens=7, successful_requests=1))


def test_a_report_round_trips() -> None:
    assert RunReport.decode(REPORT.encode()) == REPORT


def test_a_gzip_bomb_stops_at_the_bound_without_expanding() -> None:
    bomb = gzip_bomb(900 << 20)  # about 900 MiB of zeros in under the 900 KiB value limit
    assert len(bomb) < 900 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(ReportTooLarge):
            RunReport.decode(bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * REPORT_LIMIT, peak  # what gzip.decompress would have made: 900 MiB


def test_exactly_the_bound_is_accepted_and_truncated_or_trailing_bytes_are_not() -> None:
    assert len(gunzip(gzip.compress(bytes(REPORT_LIMIT)))) == REPORT_LIMIT
    whole = REPORT.encode()
    with pytest.raises(ValueError, match="not one whole gzip member"):
        gunzip(whole[:-5])
    with pytest.raises(ValueError, match="not one whole gzip member"):
        gunzip(whole + b"trailing")


def test_a_report_with_negative_counts_is_not_a_report() -> None:
    """A negative count would take spend off the Flow's usage, its budget and its metrics."""
    import json

    from pydantic import ValidationError

    raw = json.loads(REPORT.to_json())
    raw["usage"]["totalTokens"] = -1_000_000
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        RunReport.decode(gzip.compress(json.dumps(raw).encode()))
    raw = json.loads(REPORT.to_json())
    raw["usage"]["byModel"] = {"gpt-4o-mini": {"promptTokens": -5}}
    with pytest.raises(ValidationError):
        RunReport.model_validate(raw)
