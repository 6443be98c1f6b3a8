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


def _raw(**fields: object) -> dict[str, object]:
    import json

    raw: dict[str, object] = json.loads(REPORT.to_json())
    raw.update(fields)
    return raw


def _request(**fields: object) -> dict[str, object]:
    return {"id": "review-1", "method": "review", "emit": ["approved", "rejected"], **fields}


def _largest() -> dict[str, object]:
    """A report with every bounded field at its bound: what a runner may send at most."""
    from flowkube_api import report as r

    method, name = "m" * r.ID_LIMIT, "o" * r.ID_LIMIT
    models = {f"{i:03d}" + "x" * (r.MODEL_NAME_LIMIT - 3): {"totalTokens": 1} for i in range(r.MODELS_LIMIT)}
    return _raw(pod="p" * r.NAME_LIMIT, flow="f" * r.NAME_LIMIT, message="é" * r.TEXT_LIMIT, flowId=name,
                output="x" * r.TEXT_LIMIT, exitCode=(1 << 31) - 1,
                usage={"totalTokens": r.COUNT_LIMIT, "cost": str(r.COST_LIMIT), "byModel": models},
                feedbackRequest=_request(id="i" * r.REQUEST_ID_LIMIT, method=method, message="x" * r.TEXT_LIMIT,
                                         emit=[name] * r.EMIT_LIMIT, defaultOutcome=name, output="x" * r.TEXT_LIMIT),
                feedbackApplied={"requestId": "i" * r.REQUEST_ID_LIMIT, "method": method,
                                 "response": "x" * r.TEXT_LIMIT, "outcome": name},
                conversation={"sessionId": name, "turn": 3, "reply": "x" * r.TEXT_LIMIT})


def test_a_report_with_every_field_at_its_bound_is_accepted() -> None:
    import json

    largest = RunReport.decode(gzip.compress(json.dumps(_largest()).encode()))
    assert largest.feedback_request is not None and len(largest.feedback_request.emit or ()) == 64
    assert len(largest.usage.by_model) == 64


@pytest.mark.parametrize(("path", "value", "named"), [
    (("pod",), "p" * 254, "pod is 254 characters; the limit is 253"),
    (("flow",), "f" * 254, "flow is 254 characters"),
    (("message",), "x" * 4097, "message is 4097 characters; the limit is 4096"),
    (("flowId",), "x" * 241, "flowId is 241 characters"),
    (("exitCode",), 1 << 40, "exitCode"),
    (("feedbackRequest", "id"), "i" * 254, "feedbackRequest.id is 254 characters; the limit is 253"),
    (("feedbackRequest", "method"), "m" * 241, "feedbackRequest.method is 241 characters; the limit is 240"),
    (("feedbackRequest", "message"), "x" * 4097, "feedbackRequest.message is 4097"),
    (("feedbackRequest", "emit"), ["a"] * 65, "feedbackRequest.emit has 65 items; the limit is 64"),
    (("feedbackRequest", "emit"), ["a", "o" * 241], r"feedbackRequest.emit\[1\] is 241 characters"),
    (("feedbackRequest", "defaultOutcome"), "o" * 241, "feedbackRequest.defaultOutcome is 241"),
    (("feedbackApplied", "response"), "x" * 4097, "feedbackApplied.response is 4097"),
    (("feedbackApplied", "outcome"), "o" * 241, "feedbackApplied.outcome is 241"),
    (("conversation", "sessionId"), "s" * 241, "conversation.sessionId is 241"),
    (("conversation", "reply"), "x" * 4097, "conversation.reply is 4097"),
    (("usage", "byModel"), {f"m{i}": {} for i in range(65)}, "usage.byModel has 65 models; the limit is 64"),
    (("usage", "byModel"), {"m" * 513: {}}, "usage.byModel key is 513 characters; the limit is 512"),
    (("usage", "totalTokens"), 1 << 60, "usage.totalTokens is over its limit"),
    (("usage", "cost"), "1e30", "usage.cost is over its limit"),
    (("usage", "byModel"), {"gpt": {"promptTokens": 1 << 60}}, r"usage.byModel\[gpt\].promptTokens is over"),
])
def test_a_report_over_any_bound_is_refused_naming_the_field(path: tuple[str, ...], value: object, named: str) -> None:
    """Every field a runner sends that reaches status or metrics: refused where the bytes are decoded."""
    import json

    from pydantic import ValidationError

    raw = _raw(feedbackRequest=_request(), feedbackApplied={"requestId": "review-1", "method": "review"},
               conversation={"sessionId": "s-1"})
    where: dict[str, object] = raw
    for key in path[:-1]:
        where = where.setdefault(key, {})  # type: ignore[assignment]
    where[path[-1]] = value
    with pytest.raises(ValidationError, match=named):
        RunReport.decode(gzip.compress(json.dumps(raw).encode()))
    with pytest.raises(ValidationError, match=named):  # the termination message's path
        RunReport.model_validate_json(json.dumps(raw))


def test_what_a_runner_encodes_is_never_refused_for_its_text_or_its_number_of_models() -> None:
    """The runner's own encoder clips free text (a long exception, a long feedback prompt) and folds
    models past the bound into ``other``, keeping every token."""
    from flowkube_api.report import MODELS_LIMIT, OTHER_MODEL, FeedbackRequest, TokenUsage

    report = REPORT.model_copy(update={
        "message": "boom " * 10_000,
        "usage": Usage(total_tokens=200, by_model={f"model-{i:03d}": TokenUsage(total_tokens=2) for i in range(100)}),
        "feedback_request": FeedbackRequest(id="review-1", method="review", message="please " * 5_000),
    })
    decoded = RunReport.decode(report.encode())
    assert len(decoded.message.encode()) <= 4096 and decoded.message.startswith("boom")
    assert len(decoded.usage.by_model) == MODELS_LIMIT
    assert decoded.usage.by_model[OTHER_MODEL].total_tokens == 2 * (100 - MODELS_LIMIT + 1)
    assert sum(u.total_tokens for u in decoded.usage.by_model.values()) == 200
    assert RunReport.model_validate_json(report.termination_summary()).usage.total_tokens == 200


def test_the_plugins_standard_library_reader_reads_what_the_usage_model_writes() -> None:
    """kubectl's reader (no pydantic) and the model agree on every name they share."""
    from flowkube_api.report import TokenUsage, Usage
    from flowkube_api.usagecounts import UsageCounts, usage_counts

    one = TokenUsage(total_tokens=7, prompt_tokens=5, completion_tokens=2, successful_requests=1)
    written = Usage(total_tokens=7, prompt_tokens=5, completion_tokens=2, successful_requests=1,
                    by_model={"gpt-4o-mini": one}).model_dump(mode="json", by_alias=True)
    counts = UsageCounts(total_tokens=7, prompt_tokens=5, completion_tokens=2, successful_requests=1)
    assert usage_counts(written) == UsageCounts(**{**vars(counts), "by_model": {"gpt-4o-mini": counts}})
    assert usage_counts({"totalTokens": -3, "promptTokens": "9", "byModel": []}) == UsageCounts()
    assert Usage.read({"totalTokens": -3}) == Usage() and Usage.read(None) == Usage()
