"""What the console's pages show of Flows, without a cluster: the inbox's choice and order, the
rendering of hostile text, and the patches an answer sends."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from flowkube_api.inbox import feedback_patch, message_patch
from flowkube_console import views
from flowkube_console.pages import templates

NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)


def flow(name: str, phase: str, *, ns: str = "team-a", requested: str = "2026-11-27T11:00:00Z",
         definition: str = "review", **status: Any) -> dict[str, Any]:
    st: dict[str, Any] = {"phase": phase, "definition": definition, **status}
    if phase == "AwaitingFeedback":
        st.setdefault("feedback", {"request": {"id": f"{name}-r1", "method": "review_draft", "message": "Approve?",
                                               "emit": ["approved", "rejected"], "requestedAt": requested}})
    return {"metadata": {"namespace": ns, "name": name, "uid": f"uid-{name}",
                         "creationTimestamp": "2026-11-27T10:00:00Z"}, "spec": {}, "status": st}


def test_the_inbox_holds_waiting_flows_only_newest_request_first_and_filters() -> None:
    flows = [
        flow("old", "AwaitingFeedback", requested="2026-11-27T09:00:00Z"),
        flow("new", "AwaitingFeedback", requested="2026-11-27T11:30:00Z", ns="team-b", definition="triage"),
        flow("busy", "Running"),
        flow("chat", "AwaitingMessage", conversation={
            "sessionId": "s", "idleSince": "2026-11-27T10:30:00Z",
            "messages": [{"role": "assistant", "content": "Hi, how can I help?"}]}),
        flow("chat-queued", "AwaitingMessage", conversation={"sessionId": "s", "inbox": {"text": "hello"}}),
        flow("done", "Succeeded"),
    ]
    summaries = [views.summarise(f) for f in flows]
    inbox = views.inbox(summaries, views.Filters())
    assert [s.name for s in inbox] == ["new", "chat", "old"]
    assert inbox[0].waiting == "feedback" and inbox[0].outcomes == ("approved", "rejected")
    assert inbox[1].waiting == "message" and inbox[1].asked == "Hi, how can I help?"
    assert [s.name for s in views.inbox(summaries, views.Filters(namespace="team-a"))] == ["chat", "old"]
    assert [s.name for s in views.inbox(summaries, views.Filters(definition="triage"))] == ["new"]
    assert views.choices(summaries) == (["team-a", "team-b"], ["review", "triage"])


HOSTILE = ('<script>alert(1)</script><img src=x onerror=alert(2)> [click](javascript:alert(3)) '
           '"><svg onload=alert(4)>')


def test_what_a_flow_produced_is_escaped_everywhere_it_is_shown() -> None:
    f = flow("evil", "AwaitingFeedback", message=HOSTILE, result={"output": HOSTILE},
             feedback={"request": {"id": "r1", "method": HOSTILE, "message": HOSTILE, "output": HOSTILE,
                                   "emit": [HOSTILE]},
                       "history": [{"requestId": "r0", "method": "m", "response": HOSTILE, "respondedBy": HOSTILE}]},
             conversation={"sessionId": "s", "messages": [{"role": "assistant", "content": HOSTILE}]})
    f["spec"]["inputs"] = {"topic": HOSTILE}
    env = templates()
    d = views.detail(f)
    html = env.get_template("_flow_live.html").render(d=d, events=[], may_answer=True, grafana="", now=NOW,
                                                      csrf="c", draft=HOSTILE)
    inbox = env.get_template("_inbox.html").render(items=[views.summarise(f)], now=NOW)
    listing = env.get_template("_flows.html").render(items=[views.summarise(f)], now=NOW)
    for page in (html, inbox, listing):
        assert "<script>" not in page and "<img" not in page and "<svg" not in page
        assert "&lt;script&gt;" in page
    assert 'href="javascript' not in html


def test_huge_text_is_cut_with_a_note_and_renders_fast() -> None:
    big = "x" * (1 << 20)
    f = flow("big", "AwaitingFeedback", result={"output": big})
    f["status"]["feedback"]["request"]["output"] = big
    started = time.perf_counter()
    d = views.detail(f)
    html = templates().get_template("_flow_live.html").render(d=d, events=[], may_answer=True, grafana="", now=NOW,
                                                              csrf="c", draft="")
    took = time.perf_counter() - started
    assert d.result.cut == (1 << 20) - views.SHOWN_LIMIT
    assert f"{(1 << 20) - views.SHOWN_LIMIT} more characters not shown" in html
    assert len(html) < 3 * views.SHOWN_LIMIT
    print(f"1 MiB output rendered in {took * 1000:.1f} ms")


def test_an_answer_is_the_documented_status_patch() -> None:
    assert feedback_patch("approved", "r1") == {
        "status": {"feedback": {"response": {"text": "approved", "requestId": "r1"}}}}
    assert message_patch("hello") == {"status": {"conversation": {"inbox": {"text": "hello"}}}}


def test_a_reader_without_patch_sees_the_request_read_only() -> None:
    d = views.detail(flow("f", "AwaitingFeedback"))
    html = templates().get_template("_flow_live.html").render(d=d, events=[], may_answer=False, grafana="", now=NOW,
                                                              csrf="c", draft="")
    assert "Approve?" in html and 'id="read-only"' in html and 'id="answer"' not in html


def test_ages_read_as_kubectl_prints_them() -> None:
    assert views.age("2026-11-27T11:59:15Z", NOW) == "45s"
    assert views.age("2026-11-27T11:00:00Z", NOW) == "60m"
    assert views.age("2026-11-25T12:00:00Z", NOW) == "2d"
    assert views.age(None, NOW) == "-"


def test_a_flow_of_a_template_shows_the_inputs_it_runs_with() -> None:
    tspec = {"parameters": [{"name": "words", "default": 200}],
             "template": {"flowRef": "a:B", "inputs": {"style": "plain"}}}
    f = flow("t", "Running", template={"kind": "FlowTemplate", "name": "report", "spec": tspec})
    f["spec"] = {"templateRef": {"name": "report"}, "inputs": {"topic": "operators"}}
    shown = views.detail(f).inputs.text
    assert '"topic": "operators"' in shown and '"words": 200' in shown and '"style": "plain"' in shown


def test_a_flow_that_took_a_snapshot_shows_its_inputs_or_says_the_templates_part_could_not_be_read() -> None:
    from flowkube_api import templates

    tspec = {"parameters": [{"name": "words", "default": 200}], "template": {"flowRef": "a:B"}}
    data = templates.snapshot({"kind": "FlowTemplate", "metadata": {"name": "report", "uid": "t", "generation": 1},
                               "spec": tspec})
    f = flow("t", "Running", template=templates.snapshot_ref(data))
    f["spec"] = {"templateRef": {"name": "report"}, "inputs": {"topic": "operators"}}
    assert views.taken_snapshot(f) == templates.snapshot_name(data)
    spec, note = views.snapshot_spec(f, templates.snapshot_object("ns", data))
    shown = views.detail(f, spec, note).inputs.text
    assert '"words": 200' in shown and '"topic": "operators"' in shown and note == ""
    spec, note = views.snapshot_spec(f, None)
    d = views.detail(f, spec, note)
    assert '"topic": "operators"' in d.inputs.text and '"words"' not in d.inputs.text
    assert "is gone" in d.template_note


def test_the_checkpoint_timeline_and_a_forks_origin_are_escaped_and_edits_are_checked() -> None:
    import pytest

    f = flow("evil", "Succeeded", result={"output": HOSTILE},
             checkpoints=[{"id": 1, "method": HOSTILE, "kind": "Completed", "time": "2026-11-28T07:00:00Z",
                           "usage": {"totalTokens": 42, "cost": "0.001"}},
                          {"id": 2, "method": "review", "kind": "Paused", "time": "2026-11-28T07:01:00Z"}],
             forkedFrom={"namespace": "team", "name": "origin", "checkpoint": 3, "kind": "Completed",
                         "method": HOSTILE}, inheritedUsage={"totalTokens": 9, "cost": "0.5"})
    rows = views.checkpoint_rows(f)
    assert [(r.id, r.kind, r.tokens, r.cost, r.fork_name) for r in rows] == [
        (1, "Completed", 42, "0.001", "evil-fork-1"), (2, "Paused", 0, "", "evil-fork-2")]
    origin = views.fork_origin(f)
    assert origin is not None
    assert (origin.name, origin.checkpoint, origin.tokens, origin.cost) == ("origin", 3, 9, "0.5")
    page = templates().get_template("flow.html").render(
        d=views.detail(f), live="", checkpoints=rows, origin=origin, origin_result=views.shown(HOSTILE),
        origin_note="", may_fork=True, csrf="c", events=[], grafana="", now=NOW)
    assert "<script>" not in page and "<img" not in page and "&lt;script&gt;" in page
    assert page.count('class="fork-form"') == 2 and 'id="fork-output-1"' in page and 'id="fork-output-2"' not in page
    assert views.fork_edits("", "", "draft") == (None, None)
    assert views.fork_edits('{"topic": "x"}', "new text", "draft") == ({"topic": "x"}, {"draft": "new text"})
    with pytest.raises(ValueError, match="JSON object"):
        views.fork_edits("[1]", "", "draft")
    with pytest.raises(ValueError, match="not JSON"):
        views.fork_edits("topic=x", "", "draft")


def test_a_flows_trace_link_needs_a_template_and_a_real_trace_id() -> None:
    flow = {"metadata": {"namespace": "team a", "name": "f"}, "status": {"trace": {"traceId": "ab" * 16}}}
    link = views.trace_link("https://j/trace/{traceId}?ns={namespace}", flow)
    assert link == f"https://j/trace/{'ab' * 16}?ns=team%20a"
    assert views.trace_link("", flow) == ""
    for bad in ("", "AB" * 16, "ab" * 15, "ab" * 16 + '"><script>'):
        assert views.trace_link("https://j/{traceId}", {**flow, "status": {"trace": {"traceId": bad}}}) == ""
