"""`kubectl flow` against a fake kubectl: the exact argv it runs, and what it makes of the answers."""

from __future__ import annotations

import io
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from flowkube_api import forks
from flowkube_api.cron import cronflow_flow
from flowkube_kubectl import args, chat, cli, show, start

# Records its argv (and what `create -f -` reads), then answers the n-th call of a kind ("get flow",
# "patch flow", ...) with the n-th canned reply of that kind (the last one repeats).
FAKE = """\
import json, sys
from pathlib import Path
d = Path(__file__).parent
key = " ".join(sys.argv[1:3])
with (d / "argv.jsonl").open("a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1:4] == ["create", "-f", "-"]:
    with (d / "stdin.jsonl").open("a") as f:
        f.write(json.dumps(sys.stdin.read()) + "\\n")
n = sum(" ".join(json.loads(line)[:2]) == key for line in (d / "argv.jsonl").read_text().splitlines()) - 1
replies = json.loads((d / "replies.json").read_text()).get(key) or [{}]
r = replies[min(n, len(replies) - 1)]
sys.stdout.write(r.get("out", ""))
sys.stderr.write(r.get("err", ""))
sys.exit(r.get("rc", 0))
"""


class Kubectl:
    def __init__(self, d: Path) -> None:
        self.d = d
        self.replies: dict[str, list[dict[str, Any]]] = {}
        (d / "replies.json").write_text("{}")

    def on(self, key: str, *docs: dict[str, Any], rc: int = 0, err: str = "") -> None:
        self.replies[key] = [{"out": json.dumps(doc), "rc": rc, "err": err} for doc in docs] or [{"rc": rc, "err": err}]
        (self.d / "replies.json").write_text(json.dumps(self.replies))

    def calls(self) -> list[list[str]]:
        path = self.d / "argv.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def created(self) -> list[Any]:
        """The objects `create -f -` read, parsed."""
        path = self.d / "stdin.jsonl"
        return [json.loads(json.loads(line)) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def kubectl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Kubectl:
    script = tmp_path / "kubectl"
    script.write_text(f"#!{sys.executable}\n{FAKE}")
    script.chmod(0o755)
    monkeypatch.setenv("KUBECTL", str(script))
    monkeypatch.setattr(chat, "POLL_INTERVAL", 0)
    return Kubectl(tmp_path)


def flow(phase: str = "AwaitingMessage", name: str = "chat", ns: str = "team", **conv: Any) -> dict[str, Any]:
    st: dict[str, Any] = {"phase": phase, "definition": "Assistant"}
    if conv:
        st["conversation"] = conv
    return {"metadata": {"name": name, "namespace": ns, "creationTimestamp": "2024-05-01T10:00:00Z"}, "status": st}


GET = ["get", "flow", "chat", "-o", "json"]
PATCH_HI = ["patch", "flow", "chat", "--subresource=status", "--type=merge", "-p",
            '{"status":{"conversation":{"inbox":{"text":"hi"}}}}']


# --- kubectl's habits ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["get", "chat", "-n", "team"],
    ["-n", "team", "get", "chat"],
    ["get", "-n", "team", "chat"],
    ["get", "chat", "--namespace=team"],
    ["get", "chat", "-nteam"],
    ["get", "chat", "-n=team"],
])
def test_namespace_is_taken_anywhere(kubectl: Kubectl, argv: list[str]) -> None:
    kubectl.on("get flow", flow())
    assert cli.main(argv) == 0
    assert kubectl.calls() == [[*GET, "--namespace=team"]]


def test_kubectls_global_flags_reach_every_call_in_both_forms(kubectl: Kubectl) -> None:
    kubectl.on("get flow", flow(turns=0), flow(turns=1, lastReply="hello"))
    rc = cli.main(["--context", "prod", "say", "--kubeconfig=/k/cfg", "chat", "--cluster", "c1", "hi",
                   "--user=u", "--as", "alice", "--as-group=devs", "--request-timeout", "5s", "-s", "https://api:6443",
                   "--token=t0k", "--insecure-skip-tls-verify", "--certificate-authority", "/ca.crt"])
    assert rc == 0
    flags = ["--context=prod", "--kubeconfig=/k/cfg", "--cluster=c1", "--user=u", "--as=alice", "--as-group=devs",
             "--request-timeout=5s", "--server=https://api:6443", "--token=t0k", "--insecure-skip-tls-verify",
             "--certificate-authority=/ca.crt"]
    assert kubectl.calls() == [[*GET, *flags], [*PATCH_HI, *flags], [*GET, *flags]]


def test_feedback_with_flags_after_the_positionals(kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("patch flow", {"kind": "Flow"})
    assert cli.main(["feedback", "review", "approved", "--request-id", "req-1", "--context=dev"]) == 0
    assert kubectl.calls() == [["patch", "flow", "review", "--subresource=status", "--type=merge", "-p",
                                '{"status":{"feedback":{"response":{"text":"approved","requestId":"req-1"}}}}',
                                "--context=dev"]]


def test_double_dash_ends_flags(kubectl: Kubectl) -> None:
    kubectl.on("patch flow", {})
    assert cli.main(["feedback", "-n", "x", "review", "--", "-1 is my answer"]) == 0
    assert kubectl.calls()[0][-2:] == ['{"status":{"feedback":{"response":{"text":"-1 is my answer"}}}}',
                                       "--namespace=x"]


@pytest.mark.parametrize(("argv", "expected"), [
    (["get", "chat", "--colour"], "unknown flag --colour"),
    (["get", "chat", "--colour=red"], "unknown flag --colour"),
    (["get", "chat", "-x"], "unknown flag -x"),
    (["get", "chat", "--timeout", "3"], "unknown flag --timeout for get"),
    (["say", "chat", "hi", "--timeout", "soon"], "--timeout needs a number"),
    (["chat", "chat", "--timeout=-1"], "--timeout needs a number"),
    (["get", "chat", "--context"], "flag --context needs a value"),
    (["get", "chat", "-A"], "-A/--all-namespaces only applies"),
    (["say", "chat", "hi", "--all-namespaces"], "-A/--all-namespaces only applies"),
    (["say", "chat"], "usage: kubectl flow say NAME TEXT"),
    (["console", "--port", "http"], "--port needs a port number"),
    (["console", "chat"], "usage: kubectl flow console"),
    (["console", "--timeout", "3"], "unknown flag --timeout for console"),
    (["frobnicate"], "unknown command 'frobnicate'"),
    ([], "missing command"),
    (["run-template"], "usage: kubectl flow run-template TEMPLATE"),
    (["run-template", "t", "-p", "words"], "-p 'words' needs KEY=VALUE"),
    (["run-template", "t", "-p", "=300"], "-p '=300' needs KEY=VALUE"),
    (["run-template", "t", "-p", "a=1", "--param=a=2"], "-p a given twice"),
    (["run-template", "t", "-p", "notes=@/no/such/file"], "-p notes=@/no/such/file: cannot read '/no/such/file'"),
    (["run-template", "t", "--name", "x", "--generate-name"], "--name needs a name, and goes without"),
    (["run-template", "t", "--name="], "--name needs a name"),
    (["run-template", "t", "--dry-run=server"], "--dry-run is client-side only"),
    (["say", "chat", "hi", "-p", "a=1"], "unknown flag -p/--param for say"),
])
def test_usage_errors_name_the_problem_and_run_nothing(kubectl: Kubectl, capsys: pytest.CaptureFixture[str],
                                                       argv: list[str], expected: str) -> None:
    assert cli.main(argv) == 2
    assert expected in capsys.readouterr().err
    assert kubectl.calls() == []


def test_console_takes_its_flags_and_kubectls_anywhere() -> None:
    a = args.parse(["--context", "prod", "console", "--no-browser", "--port=9000", "-n", "team-a"])
    assert (a.cmd, a.pos, a.opts) == ("console", [], {"--no-browser": "true", "--port": "9000"})
    assert a.kube == ["--context=prod", "--namespace=team-a"]


def test_help_shows_the_usage_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["say", "--help"]) == 0
    out = capsys.readouterr().out
    assert "kubectl flow say NAME TEXT [--timeout SECONDS]" in out and "kubectl flow chat NAME" in out
    assert "kubectl flow run-template TEMPLATE [-p KEY=VALUE]... [--cluster-template]" in out


def test_kubectl_errors_pass_through(kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get flow", rc=1, err='Error from server (NotFound): flows.flowkube.io "nope" not found\n')
    assert cli.main(["get", "nope"]) == 1
    assert "not found" in capsys.readouterr().err


def test_get_without_name_lists_flows(kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    busy = flow("Running", name="research", ns="lab")
    busy["status"]["usage"] = {"totalTokens": 1234}
    kubectl.on("get flows", {"items": [flow(name="chat", ns="team"), busy]})
    assert cli.main(["get", "-A", "--context", "prod"]) == 0
    assert kubectl.calls() == [["get", "flows", "--all-namespaces", "-o", "json", "--context=prod"]]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAMESPACE", "NAME", "PHASE", "DEFINITION", "TOKENS", "AGE"]
    assert lines[1].split()[:4] == ["team", "chat", "AwaitingMessage", "Assistant"]
    assert lines[2].split()[:5] == ["lab", "research", "Running", "Assistant", "1234"]


def test_flow_table_in_one_namespace_with_ages() -> None:
    now = datetime(2024, 5, 1, 10, 0, 0, tzinfo=UTC)
    flows = [flow(name=n) for n in ("a", "b", "c", "d")]
    for f, ts in zip(flows, ["2024-05-01T09:59:30Z", "2024-05-01T09:00:00Z", "2024-04-30T09:00:00Z",
                             "2024-04-20T10:00:00Z"], strict=True):
        f["metadata"]["creationTimestamp"] = ts
    lines = show.flow_table(flows, False, now).splitlines()
    assert lines[0].split() == ["NAME", "PHASE", "DEFINITION", "TOKENS", "AGE"]
    assert [line.split()[-1] for line in lines[1:]] == ["30s", "60m", "25h", "11d"]


def test_no_flows(kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get flows", {"items": []})
    assert cli.main(["get"]) == 0
    assert kubectl.calls() == [["get", "flows", "-o", "json"]]
    assert "No flows found" in capsys.readouterr().err


# --- conversations ------------------------------------------------------------------------------------------------

def test_say_sends_the_message_and_prints_the_reply(kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get flow",
               flow(turns=2, sessionId="s1"),
               flow("AwaitingMessage", turns=2, inbox={"text": "hi"}),
               flow("Running", turns=2, pending={"turn": 3, "text": "hi", "sentBy": "alice"}),
               flow("AwaitingMessage", turns=3, lastReply="Hello, alice."))
    assert cli.main(["say", "chat", "hi", "-n", "team"]) == 0
    assert kubectl.calls() == [[*GET, "--namespace=team"], [*PATCH_HI, "--namespace=team"],
                               *[[*GET, "--namespace=team"]] * 3]
    out = capsys.readouterr()
    assert out.out == "Hello, alice.\n" and "ended" not in out.err


def test_say_notes_that_the_conversation_ended(kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get flow", flow(turns=1), flow("Succeeded", turns=2, ended=True, lastReply="Bye."))
    assert cli.main(["say", "chat", "bye"]) == 0
    out = capsys.readouterr()
    assert out.out == "Bye.\n" and "conversation has ended" in out.err


def test_say_refused_by_the_webhook(kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get flow", flow("Running", turns=1))
    denied = ('Error from server (Forbidden): admission webhook "status.flowkube.dev" denied the request: '
              "the conversation is not awaiting a message\n")
    kubectl.on("patch flow", rc=1, err=denied)
    assert cli.main(["say", "chat", "hi"]) == 1
    assert kubectl.calls() == [GET, PATCH_HI]
    assert "not awaiting a message" in capsys.readouterr().err


def test_say_refused_by_the_operator_shows_the_newest_event(kubectl: Kubectl,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get flow", flow(turns=1), flow(turns=1, inbox={"text": "hi"}), flow(turns=1))
    kubectl.on("get events", {"items": [
        {"metadata": {"name": "e1"}, "message": "old refusal", "lastTimestamp": "2024-05-01T10:00:00Z"},
        {"metadata": {"name": "e3"}, "message": "message too long (9000 > 4096 characters)",
         "eventTime": "2024-05-01T10:05:00.123456Z"},
        {"metadata": {"name": "e2"}, "message": "older refusal", "lastTimestamp": "2024-05-01T10:04:59Z"},
    ]})
    assert cli.main(["say", "chat", "hi", "--context=c"]) == 1
    assert kubectl.calls()[-1] == ["get", "events", "--field-selector",
                                   "involvedObject.name=chat,reason=MessageRefused", "-o", "json", "--context=c"]
    assert "message refused: message too long (9000 > 4096 characters)" in capsys.readouterr().err


def test_say_reports_a_failed_turn(kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    failed = flow("Failed", turns=1, pending={"turn": 2, "text": "hi"})
    failed["status"]["message"] = "runner exited with code 1: ValueError"
    kubectl.on("get flow", flow(turns=1), flow("Running", turns=1, pending={"turn": 2, "text": "hi"}), failed)
    assert cli.main(["say", "chat", "hi"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and "runner exited with code 1: ValueError" in out.err


def test_say_shows_a_feedback_request_a_turn_asked_for(kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    asking = flow("AwaitingFeedback", turns=1, pending={"turn": 2, "text": "hi"})
    asking["status"]["feedback"] = {"request": {"id": "req-7", "method": "confirm", "message": "Send the email?",
                                                "emit": ["yes", "no"]}}
    kubectl.on("get flow", flow(turns=1), asking)
    assert cli.main(["say", "chat", "hi"]) == 0
    out = capsys.readouterr().out
    assert "Send the email?" in out and "outcomes: yes, no" in out
    assert 'kubectl flow feedback chat "<text>" --request-id req-7' in out


def test_say_gives_up_at_the_deadline(kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get flow", flow(turns=1), flow(turns=1, inbox={"text": "hi"}))
    assert cli.main(["say", "chat", "hi", "--timeout", "0"]) == 1
    assert kubectl.calls() == [GET, PATCH_HI, GET]
    assert "no reply within 0s" in capsys.readouterr().err


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_chat_until_the_flow_ends_the_conversation(kubectl: Kubectl, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    history = [{"role": "user", "content": "earlier", "sender": "bob"},
               {"role": "assistant", "content": "an earlier reply"}]
    kubectl.on("get flow",
               flow(turns=1, messages=history),  # chat starts
               flow(turns=1), flow(turns=2, lastReply="Hi!"),  # "hi"
               flow(turns=2), flow(turns=3, lastReply="Goodbye.", ended=True))  # "exit"
    monkeypatch.setattr(sys, "stdin", Tty("hi\n\nexit\nnever sent\n"))
    assert cli.main(["chat", "chat", "-n", "team"]) == 0
    patches = [c[-2] for c in kubectl.calls() if c[0] == "patch"]
    assert patches == ['{"status":{"conversation":{"inbox":{"text":"hi"}}}}',
                       '{"status":{"conversation":{"inbox":{"text":"exit"}}}}']
    assert all(c[-1] == "--namespace=team" for c in kubectl.calls())
    out = capsys.readouterr()
    assert out.out == "bob> earlier\nflow> an earlier reply\nflow> Hi!\nflow> Goodbye.\n"
    assert out.err.count("you> ") == 3 and "conversation has ended" in out.err


def test_chat_keeps_going_after_a_refusal_and_stops_at_eof(kubectl: Kubectl, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    kubectl.on("get flow", flow(turns=0))
    kubectl.on("patch flow", rc=1, err="denied: message too long\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO("x" * 10 + "\n"))
    assert cli.main(["chat", "chat"]) == 0
    out = capsys.readouterr()
    assert "denied: message too long" in out.err and "session stays open" in out.err and "you> " not in out.err
    assert 'kubectl flow say chat "<text>"' in out.err


def test_chat_stops_when_a_turn_fails(kubectl: Kubectl, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    failed = flow("Failed", turns=0)
    failed["status"]["message"] = "boom"
    kubectl.on("get flow", flow(turns=0), flow(turns=0), failed)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nagain\n"))
    assert cli.main(["chat", "chat"]) == 1
    assert sum(c[0] == "patch" for c in kubectl.calls()) == 1
    assert "Flow failed: boom" in capsys.readouterr().err


def test_describe_shows_the_conversation() -> None:
    f = flow("Running", turns=2, sessionId="sess-42", ended=False,
             messages=[{"role": "user", "content": "What is the weather in Paris?", "time": "2024-05-01T10:00:00Z",
                        "sender": "alice"},
                       {"role": "assistant", "content": "Sunny. " * 40, "time": "2024-05-01T10:00:05Z"}],
             pending={"turn": 3, "text": "And tomorrow?", "sentBy": "alice", "sentAt": "2024-05-01T10:01:00Z"})
    text = show.describe(f)
    assert "Conversation (session sess-42): 2 turns, ended: no" in text
    assert "2024-05-01T10:00:00Z user (alice)" in text and "What is the weather in Paris?" in text
    reply_line = next(line for line in text.splitlines() if "assistant" in line)
    assert reply_line.endswith("...") and len(reply_line) < 160
    assert "pending turn 3 from alice at 2024-05-01T10:01:00Z: And tomorrow?" in text
    assert 'kubectl flow say chat "<text>"' in text


def test_describe_of_an_ended_conversation_offers_no_next_message() -> None:
    text = show.describe(flow("Succeeded", turns=4, sessionId="s", ended=True, lastReply="Bye."))
    assert "ended: yes" in text and "last reply: Bye." in text and "kubectl flow say" not in text


def test_get_shows_each_sinks_last_delivery() -> None:
    f = flow("AwaitingFeedback")
    f["status"]["notifications"] = [
        {"name": "team-slack", "event": "FeedbackRequested", "outcome": "Delivered", "reason": "Delivered",
         "attempts": 1, "code": 200, "time": "2024-05-01T10:00:01Z", "handled": ["u/r1/FeedbackRequested"]},
        {"name": "pager", "event": "FeedbackRequested", "outcome": "Failed", "reason": "Rejected", "attempts": 1,
         "code": 404, "time": "2024-05-01T10:00:02Z", "message": "404: no such hook"},
    ]
    text = show.describe(f)
    assert "Notifications (last delivery per sink):" in text
    slack = next(line for line in text.splitlines() if "team-slack" in line)
    assert "FeedbackRequested" in slack and "Delivered" in slack
    assert "HTTP 200, 1 attempt(s) at 2024-05-01T10:00:01Z" in slack
    pager = next(line for line in text.splitlines() if "pager" in line)
    assert "Failed" in pager and "Rejected HTTP 404" in pager
    assert "404: no such hook" in text


# --- run-template -------------------------------------------------------------------------------------------------

def template(kind: str = "FlowTemplate", name: str = "summarize", ns: str | None = "team") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name} | ({"namespace": ns} if ns else {})
    return {"apiVersion": "flowkube.io/v1alpha1", "kind": kind, "metadata": meta, "spec": {
        "parameters": [
            {"name": "topic", "type": "string", "required": True, "description": "What to summarize"},
            {"name": "words", "type": "integer", "default": 300},
            {"name": "tags", "type": "array"},
            {"name": "version", "type": "string"},
        ],
        "template": {"definition": {"name": "Summarize"}},
    }}


GET_TEMPLATE = ["get", "flowtemplates", "summarize", "-o", "json"]
CREATE = ["create", "-f", "-", "-o", "json"]


@pytest.mark.parametrize(("text", "value"), [
    ("300", 300), ("-2", -2), ("2.5", 2.5), ("true", True), ("false", False), ("null", None),
    ('["a", "b"]', ["a", "b"]), ('{"k": 1}', {"k": 1}), ('"300"', "300"), ('"@x"', "@x"),
    ("hello", "hello"), ("hello world", "hello world"), ("", ""), ("007", "007"), ("1.2.3", "1.2.3"),
    ("NaN", "NaN"), ("-Infinity", "-Infinity"), ("[1,", "[1,"), ("[" * 100_000, "[" * 100_000),
])
def test_a_param_is_json_when_it_parses_else_text(text: str, value: Any) -> None:
    assert start.param_value(text) == value


def test_a_string_parameter_keeps_the_text_unless_it_is_a_json_string() -> None:
    texts = {"version": "1.10", "topic": '"quoted"', "words": "300", "tags": '["a"]', "other": "true"}
    assert start.template_inputs(texts, template()["spec"]) == {
        "version": "1.10", "topic": "quoted", "words": 300, "tags": ["a"], "other": True}


def test_params_in_every_flag_form_and_from_a_file(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("line one\nline two\n")
    (tmp_path / "tags.json").write_text('["x", "y"]\n')
    a = args.parse(["run-template", "summarize", "-pa=1", "-p=b=x=y", "--param", "c=3", "--param=d=4",
                   "-p", f"notes=@{tmp_path}/notes.txt", "-p", f"tags=@{tmp_path}/tags.json"])
    texts = start.read_params(a.params)
    assert texts == {"a": "1", "b": "x=y", "c": "3", "d": "4", "notes": "line one\nline two\n",
                     "tags": '["x", "y"]\n'}
    assert start.template_inputs(texts, template()["spec"])["tags"] == ["x", "y"]


def test_run_template_creates_the_flow_and_prints_its_name(kubectl: Kubectl,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get flowtemplates", template())
    kubectl.on("create -f", {"kind": "Flow", "metadata": {"name": "summarize-x7k2p", "namespace": "team"}})
    rc = cli.main(["run-template", "summarize", "-p", "topic=kubernetes", "-p", "words=300", "-n", "team",
                   "-p", 'tags=["a", "b"]', "-p", "version=1.10"])
    assert rc == 0
    assert kubectl.calls() == [[*GET_TEMPLATE, "--namespace=team"], [*CREATE, "--namespace=team"]]
    assert kubectl.created() == [{
        "apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"generateName": "summarize-"},
        "spec": {"templateRef": {"name": "summarize", "kind": "FlowTemplate"},
                 "inputs": {"topic": "kubernetes", "words": 300, "tags": ["a", "b"], "version": "1.10"}}}]
    out = capsys.readouterr()
    assert out.out == "summarize-x7k2p\n" and "kubectl flow get summarize-x7k2p" in out.err


def test_run_template_from_a_cluster_template_with_a_name(kubectl: Kubectl,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get clusterflowtemplates", template("ClusterFlowTemplate", "weekly", ns=None))
    kubectl.on("create -f", {"kind": "Flow", "metadata": {"name": "weekly-1"}})
    # kubectl's --cluster (a kubeconfig cluster) still reaches kubectl beside --cluster-template
    assert cli.main(["run-template", "weekly", "--cluster-template", "--cluster", "c1", "--name", "weekly-1",
                     "-p", "topic=news"]) == 0
    assert kubectl.calls() == [["get", "clusterflowtemplates", "weekly", "-o", "json", "--cluster=c1"],
                               [*CREATE, "--cluster=c1"]]
    assert kubectl.created() == [{
        "apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": "weekly-1"},
        "spec": {"templateRef": {"name": "weekly", "kind": "ClusterFlowTemplate"}, "inputs": {"topic": "news"}}}]
    assert capsys.readouterr().out == "weekly-1\n"


def test_run_template_refuses_bad_inputs_and_creates_nothing(kubectl: Kubectl,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get flowtemplates", template())
    assert cli.main(["run-template", "summarize", "-p", "words=many", "-p", "colour=red", "-n", "team"]) == 1
    assert kubectl.calls() == [[*GET_TEMPLATE, "--namespace=team"]]
    err = capsys.readouterr().err
    where = 'FlowTemplate "summarize" in namespace "team"'
    assert f"spec.inputs.colour: {where} has no parameter 'colour'" in err
    assert f"spec.inputs.words: must be integer (a parameter of {where}), not string" in err
    assert f"spec.inputs.topic: required by {where} (What to summarize)" in err
    assert f"{where} takes:" in err and "-p topic=...  (string, required) What to summarize" in err
    assert "-p words=...  (integer, default 300)" in err


def test_run_template_dry_run_prints_the_flow_and_creates_nothing(kubectl: Kubectl,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get flowtemplates", template())
    assert cli.main(["run-template", "summarize", "-p", "topic=k8s", "--dry-run"]) == 0
    assert kubectl.calls() == [GET_TEMPLATE]
    assert json.loads(capsys.readouterr().out) == {
        "apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"generateName": "summarize-"},
        "spec": {"templateRef": {"name": "summarize", "kind": "FlowTemplate"}, "inputs": {"topic": "k8s"}}}


def test_run_template_of_a_missing_template(kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get flowtemplates", rc=1,
               err='Error from server (NotFound): flowtemplates.flowkube.io "summarize" not found\n')
    assert cli.main(["run-template", "summarize", "-p", "topic=k8s"]) == 1
    assert kubectl.calls() == [GET_TEMPLATE]
    err = capsys.readouterr().err
    assert 'kubectl flow: error: FlowTemplate "summarize" not found in the current namespace' in err
    assert "add --cluster-template" in err


def test_run_template_passes_other_kubectl_errors_through(kubectl: Kubectl,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get flowtemplates", template())
    denied = 'Error from server (Forbidden): admission webhook "flows.flowkube.io" denied the request: nope\n'
    kubectl.on("create -f", rc=1, err=denied)
    assert cli.main(["run-template", "summarize", "-p", "topic=k8s"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err == denied


# --- trigger ------------------------------------------------------------------------------------------------------

def cronflow(name: str = "nightly", ns: str = "team") -> dict[str, Any]:
    return {"apiVersion": "flowkube.io/v1alpha1", "kind": "CronFlow",
            "metadata": {"name": name, "namespace": ns, "uid": "cf-uid-1", "resourceVersion": "7"},
            "spec": {"schedule": "0 2 * * *", "timeZone": "Europe/Berlin", "concurrencyPolicy": "Forbid",
                     "flowTemplate": {
                         "metadata": {"labels": {"team": "platform"}, "annotations": {"owner": "alice"}},
                         "spec": {"templateRef": {"name": "nightly-report"}, "inputs": {"topic": "k8s"}}}}}


GET_CRONFLOW = ["get", "cronflows", "nightly", "-o", "json"]


def _stamp(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def test_trigger_creates_the_cronflows_flow_and_prints_its_name(kubectl: Kubectl,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get cronflows", cronflow())
    kubectl.on("create -f", {"kind": "Flow", "metadata": {"name": "nightly-manual-x7k2p", "namespace": "team"}})
    before = datetime.now(UTC).replace(microsecond=0)
    assert cli.main(["trigger", "nightly", "-n", "team"]) == 0
    after = datetime.now(UTC)
    assert kubectl.calls() == [[*GET_CRONFLOW, "--namespace=team"], [*CREATE, "--namespace=team"]]
    [created] = kubectl.created()
    scheduled = created["metadata"]["annotations"].pop("flowkube.io/scheduled-at")
    assert before <= _stamp(scheduled) <= after
    assert created == {
        "apiVersion": "flowkube.io/v1alpha1", "kind": "Flow",
        "metadata": {
            "generateName": "nightly-manual-", "namespace": "team",
            "labels": {"team": "platform", "flowkube.io/cronflow": "nightly"},
            "annotations": {"owner": "alice", "flowkube.io/triggered-by": "kubectl-flow"},
            "ownerReferences": [{"apiVersion": "flowkube.io/v1alpha1", "kind": "CronFlow", "name": "nightly",
                                 "uid": "cf-uid-1", "controller": True}],
        },
        "spec": {"templateRef": {"name": "nightly-report"}, "inputs": {"topic": "k8s"}}}
    out = capsys.readouterr()
    assert out.out == "nightly-manual-x7k2p\n" and "kubectl flow get nightly-manual-x7k2p" in out.err


def test_trigger_with_a_name(kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get cronflows", cronflow())
    kubectl.on("create -f", {"kind": "Flow", "metadata": {"name": "nightly-now", "namespace": "team"}})
    assert cli.main(["--context=prod", "trigger", "--name", "nightly-now", "nightly"]) == 0
    assert kubectl.calls() == [[*GET_CRONFLOW, "--context=prod"], [*CREATE, "--context=prod"]]
    [created] = kubectl.created()
    assert created["metadata"]["name"] == "nightly-now" and "generateName" not in created["metadata"]
    assert capsys.readouterr().out == "nightly-now\n"


def test_trigger_of_a_cronflow_without_template_metadata() -> None:
    cf = cronflow()
    del cf["spec"]["flowTemplate"]["metadata"]
    meta = start.trigger_flow(cf, datetime(2024, 5, 1, 10, 0, 30, 123, tzinfo=UTC))["metadata"]
    assert meta["labels"] == {"flowkube.io/cronflow": "nightly"}
    assert meta["annotations"] == {"flowkube.io/scheduled-at": "2024-05-01T10:00:30Z",
                                   "flowkube.io/triggered-by": "kubectl-flow"}


def test_trigger_dry_run_prints_the_flow_and_creates_nothing(kubectl: Kubectl,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get cronflows", cronflow())
    assert cli.main(["trigger", "nightly", "--dry-run"]) == 0
    assert kubectl.calls() == [GET_CRONFLOW]
    printed = json.loads(capsys.readouterr().out)
    assert printed["metadata"]["generateName"] == "nightly-manual-"
    assert printed["metadata"]["labels"]["flowkube.io/cronflow"] == "nightly"
    assert printed["metadata"]["annotations"]["flowkube.io/triggered-by"] == "kubectl-flow"
    assert printed["spec"] == cronflow()["spec"]["flowTemplate"]["spec"]


@pytest.mark.parametrize(("argv", "where"), [
    (["trigger", "nightly"], " in the current namespace"),
    (["trigger", "nightly", "-n", "team"], ' in namespace "team"'),
])
def test_trigger_of_a_missing_cronflow(kubectl: Kubectl, capsys: pytest.CaptureFixture[str],
                                       argv: list[str], where: str) -> None:
    kubectl.on("get cronflows", rc=1,
               err='Error from server (NotFound): cronflows.flowkube.io "nightly" not found\n')
    assert cli.main(argv) == 1
    assert [c[:5] for c in kubectl.calls()] == [GET_CRONFLOW]
    err = capsys.readouterr().err
    assert f'kubectl flow: error: CronFlow "nightly" not found{where} (kubectl get cronflows)' in err


def test_trigger_passes_other_kubectl_errors_through(kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get cronflows", cronflow())
    denied = ('Error from server (Forbidden): flows.flowkube.io is forbidden: User "bob" cannot create '
              'resource "flows" in API group "flowkube.io" in the namespace "team"\n')
    kubectl.on("create -f", rc=1, err=denied)
    assert cli.main(["trigger", "nightly"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err == denied


@pytest.mark.parametrize(("argv", "expected"), [
    (["trigger"], "usage: kubectl flow trigger CRONFLOW"),
    (["trigger", "a", "b"], "usage: kubectl flow trigger CRONFLOW"),
    (["trigger", "nightly", "--generate-name"], "unknown flag --generate-name for trigger"),
    (["trigger", "nightly", "--cluster-template"], "unknown flag --cluster-template for trigger"),
    (["trigger", "nightly", "-p", "a=1"], "unknown flag -p/--param for trigger"),
    (["trigger", "nightly", "--name="], "--name needs a name"),
    (["trigger", "nightly", "--dry-run=server"], "--dry-run is client-side only"),
])
def test_trigger_usage_errors(kubectl: Kubectl, capsys: pytest.CaptureFixture[str], argv: list[str],
                              expected: str) -> None:
    assert cli.main(argv) == 2
    assert expected in capsys.readouterr().err
    assert kubectl.calls() == []


def test_help_shows_trigger(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert "kubectl flow trigger CRONFLOW [--name NAME]" in capsys.readouterr().out


def _paths(doc: Any, at: tuple[Any, ...] = ()) -> set[tuple[Any, ...]]:
    """Every key path of a JSON document (list items by index)."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    return {at} | {p for k, v in items for p in _paths(v, (*at, k))}


def test_trigger_flow_is_the_operators_scheduled_flow_but_for_the_documented_differences() -> None:
    """One function (flowkube_api.cron.cronflow_flow) makes both; the plugin's differs only where it says."""
    now = datetime(2024, 5, 1, 10, 0, 0, tzinfo=UTC)
    theirs = cronflow_flow(cronflow(), now, name="nightly-28577040")  # the operator's call
    ours = start.trigger_flow(cronflow(), now)
    assert _paths(ours) - _paths(theirs) == {("metadata", "generateName"),
                                             ("metadata", "annotations", "flowkube.io/triggered-by")}
    assert _paths(theirs) - _paths(ours) == {("metadata", "name"),
                                             ("metadata", "ownerReferences", 0, "blockOwnerDeletion")}
    # and the same values, the differences taken out
    del theirs["metadata"]["name"], theirs["metadata"]["ownerReferences"][0]["blockOwnerDeletion"]
    del ours["metadata"]["generateName"], ours["metadata"]["annotations"]["flowkube.io/triggered-by"]
    assert ours == theirs
    named = start.trigger_flow(cronflow(), now, "nightly-28577040")
    assert _paths(named) - _paths(cronflow_flow(cronflow(), now, name="nightly-28577040")) == {
        ("metadata", "annotations", "flowkube.io/triggered-by")}


def test_run_template_of_a_cluster_template_one_may_not_read_leaves_the_check_to_the_server(
        kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get clusterflowtemplates", rc=1,
               err='Error from server (Forbidden): clusterflowtemplates.flowkube.io "weekly" is forbidden\n')
    kubectl.on("create -f", {"kind": "Flow", "metadata": {"name": "weekly-x1"}})
    assert cli.main(["run-template", "weekly", "--cluster-template", "-p", "words=300"]) == 0
    assert kubectl.created()[0]["spec"] == {"templateRef": {"name": "weekly", "kind": "ClusterFlowTemplate"},
                                            "inputs": {"words": 300}}
    out = capsys.readouterr()
    assert out.out == "weekly-x1\n" and "checked when the Flow is created" in out.err


# --- fork ---------------------------------------------------------------------------------------------------------

def origin(name: str = "research", ns: str = "team") -> dict[str, Any]:
    """A Flow with three checkpoints, itself a fork (its forkFrom is not copied), suspended (nor that)."""
    checkpoints = [
        {"id": 3, "method": "plan", "kind": "Completed", "time": "2024-05-01T10:00:00Z",
         "usage": {"totalTokens": 1200, "cost": "0.0012"}},
        {"id": 4, "method": "review", "kind": "Paused", "time": "2024-05-01T10:01:00Z",
         "usage": {"totalTokens": 2500, "cost": "0.0031"}},
        {"id": 5, "method": "write", "kind": "Completed", "time": "2024-05-01T10:02:00Z",
         "usage": {"totalTokens": 4000, "cost": "0.005"}},
    ]
    return {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow",
            "metadata": {"name": name, "namespace": ns, "uid": "uid-1", "resourceVersion": "42",
                         "labels": {"flowkube.io/cronflow": "nightly"}, "creationTimestamp": "2024-05-01T09:00:00Z"},
            "spec": {"definition": {"name": "Research", "methods": {"plan": {"start": True}}},
                     "inputs": {"topic": "k8s"}, "env": [{"name": "A", "value": "1"}],
                     "resources": {"limits": {"memory": "1Gi"}}, "retries": {"limit": 2},
                     "budget": {"maxTokens": 100000}, "checkpoints": {"keep": 5}, "suspend": True,
                     "forkFrom": {"name": "older", "checkpoint": 1}},
            "status": {"phase": "Succeeded", "checkpoints": checkpoints}}


GET_ORIGIN = ["get", "flow", "research", "-o", "json"]
SPEC_COPIED = {"definition": {"name": "Research", "methods": {"plan": {"start": True}}}, "inputs": {"topic": "k8s"},
               "env": [{"name": "A", "value": "1"}], "resources": {"limits": {"memory": "1Gi"}},
               "retries": {"limit": 2}, "budget": {"maxTokens": 100000}, "checkpoints": {"keep": 5}}


def test_fork_copies_the_spec_and_names_the_checkpoint_and_edits(kubectl: Kubectl,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get flow", origin())
    kubectl.on("create -f", {"kind": "Flow", "metadata": {"name": "research-fork-4", "namespace": "team"}})
    rc = cli.main(["fork", "research", "--at", "4", "-n", "team", "--input", "words=300", "--input=tone=dry",
                   "--input", 'extra={"k": [1, true]}', "--output", "plan=Only two sections.",
                   "--output=write=a=b"])
    assert rc == 0
    assert kubectl.calls() == [[*GET_ORIGIN, "--namespace=team"], [*CREATE, "--namespace=team"]]
    assert kubectl.created() == [{
        "apiVersion": "flowkube.io/v1alpha1", "kind": "Flow",
        "metadata": {"name": "research-fork-4", "labels": {"flowkube.io/forked-from": "research"}},
        "spec": {**SPEC_COPIED, "forkFrom": {
            "name": "research", "uid": "uid-1", "checkpoint": 4,
            "inputs": {"words": 300, "tone": "dry", "extra": {"k": [1, True]}},
            "outputs": {"plan": "Only two sections.", "write": "a=b"}}}}]
    out = capsys.readouterr()
    assert out.out == ("flow.flowkube.io/research-fork-4 created "
                       "(fork of team/research at checkpoint 4: Paused review)\n")


def test_fork_without_edits_with_a_name_from_another_namespace(kubectl: Kubectl,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get flow", origin(ns="lab"))
    kubectl.on("create -f", {"kind": "Flow", "metadata": {"name": "retry-write", "namespace": "team"}})
    rc = cli.main(["-n", "team", "fork", "research", "--at=5", "--from-namespace", "lab", "--name", "retry-write",
                   "--context=prod"])
    assert rc == 0
    # the origin is read in its namespace, the fork made in -n's; the other kubectl flags reach both
    assert kubectl.calls() == [[*GET_ORIGIN, "--context=prod", "--namespace=lab"],
                               [*CREATE, "--namespace=team", "--context=prod"]]
    [created] = kubectl.created()
    assert created["metadata"] == {"name": "retry-write", "labels": {"flowkube.io/forked-from": "research"}}
    assert created["spec"] == {**SPEC_COPIED, "forkFrom": {"name": "research", "namespace": "lab", "uid": "uid-1",
                                                           "checkpoint": 5}}
    assert capsys.readouterr().out == ("flow.flowkube.io/retry-write created "
                                       "(fork of lab/research at checkpoint 5: Completed write)\n")


def test_fork_from_the_namespace_it_is_made_in_leaves_forkfroms_namespace_out(kubectl: Kubectl) -> None:
    kubectl.on("get flow", origin())
    kubectl.on("create -f", {"kind": "Flow", "metadata": {"name": "research-fork-3", "namespace": "team"}})
    assert cli.main(["fork", "research", "--at", "3", "-n", "team", "--from-namespace", "team"]) == 0
    assert kubectl.created()[0]["spec"]["forkFrom"] == {"name": "research", "uid": "uid-1", "checkpoint": 3}


@pytest.mark.parametrize(("name", "checkpoint", "expected"), [
    ("research", 4, "research-fork-4"),
    ("a" * 63, 12, "a" * 55 + "-fork-12"),
    ("a" * 55 + "-" + "b" * 7, 7, "a" * 55 + "-fork-7"),  # cut right after a dash: the dash goes too
    ("a" * 55 + "." + "b" * 7, 7, "a" * 55 + "-fork-7"),
    ("x" * 40, 1 << 53, "x" * 40 + "-fork-9007199254740992"),
])
def test_the_default_name_fits_a_flows_63_characters(name: str, checkpoint: int, expected: str) -> None:
    assert forks.fork_name(name, checkpoint) == expected and len(expected) <= 63


def test_fork_dry_run_prints_the_flow_and_creates_nothing(kubectl: Kubectl,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get flow", origin())
    assert cli.main(["fork", "research", "--at", "3", "--dry-run"]) == 0
    assert kubectl.calls() == [GET_ORIGIN]
    printed = json.loads(capsys.readouterr().out)
    assert printed["metadata"]["name"] == "research-fork-3"
    assert printed["spec"] == {**SPEC_COPIED, "forkFrom": {"name": "research", "uid": "uid-1", "checkpoint": 3}}


@pytest.mark.parametrize(("at", "expected"), [
    ("7", "--at 7: Flow team/research has no checkpoint 7; it has 3, 4, 5 (kubectl flow get research)"),
    ("1", "--at 1: Flow team/research has no checkpoint 1; it has 3, 4, 5"),
])
def test_fork_refuses_a_checkpoint_the_origin_does_not_have(kubectl: Kubectl, capsys: pytest.CaptureFixture[str],
                                                            at: str, expected: str) -> None:
    kubectl.on("get flow", origin())
    assert cli.main(["fork", "research", "--at", at]) == 2
    assert kubectl.calls() == [GET_ORIGIN]  # read, nothing created
    assert f"kubectl flow: error: {expected}" in capsys.readouterr().err


def test_fork_of_a_flow_without_checkpoints(kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    bare = origin()
    del bare["status"]["checkpoints"]
    kubectl.on("get flow", bare)
    assert cli.main(["fork", "research", "--at", "1"]) == 2
    assert "--at 1: Flow team/research has no checkpoints to fork from" in capsys.readouterr().err
    assert [c[0] for c in kubectl.calls()] == ["get"]


@pytest.mark.parametrize(("argv", "where"), [
    (["fork", "research", "--at", "3"], 'in the current namespace (kubectl flow get; a Flow of another namespace: '
                                        "--from-namespace NS)"),
    (["fork", "research", "--at", "3", "-n", "team"], 'in namespace "team"'),
    (["fork", "research", "--at", "3", "-n", "team", "--from-namespace", "lab"],
     'in namespace "lab" (kubectl flow get)'),
])
def test_fork_of_a_missing_origin(kubectl: Kubectl, capsys: pytest.CaptureFixture[str], argv: list[str],
                                  where: str) -> None:
    kubectl.on("get flow", rc=1, err='Error from server (NotFound): flows.flowkube.io "research" not found\n')
    assert cli.main(argv) == 2
    assert [c[0] for c in kubectl.calls()] == ["get"]
    assert f'kubectl flow: error: NAME: Flow "research" not found {where}' in capsys.readouterr().err


def test_fork_onto_a_name_in_use_suggests_name(kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get flow", origin())
    taken = 'Error from server (AlreadyExists): flows.flowkube.io "research-fork-3" already exists\n'
    kubectl.on("create -f", rc=1, err=taken)
    assert cli.main(["fork", "research", "--at", "3"]) == 1
    err = capsys.readouterr().err
    assert taken in err and "--name NEW" in err


@pytest.mark.parametrize(("argv", "expected"), [
    (["fork", "research"], "fork needs --at CHECKPOINT"),
    (["fork", "research", "--at", "last"], "fork needs --at CHECKPOINT, the id of one of the Flow's checkpoints "
                                           "(kubectl flow get NAME lists them), got 'last'"),
    (["fork", "research", "--at", "-1"], "fork needs --at CHECKPOINT"),
    (["fork", "--at", "3"], "usage: kubectl flow fork NAME"),
    (["fork", "research", "--at", "3", "--output", "plan"], "--output 'plan' needs METHOD=TEXT"),
    (["fork", "research", "--at", "3", "--output", "=text"], "--output '=text' needs METHOD=TEXT"),
    (["fork", "research", "--at", "3", "--output", "a=1", "--output", "a=2"], "--output a given twice"),
    (["fork", "research", "--at", "3", "--input", "words"], "--input 'words' needs KEY=VALUE"),
    (["fork", "research", "--at", "3", "--input", "k=@/no/such/file"], "--input k=@/no/such/file: cannot read"),
    (["fork", "research", "--at", "3", "--from-namespace="], "--from-namespace needs a namespace"),
    (["fork", "research", "--at", "3", "-p", "a=1"], "unknown flag -p/--param for fork"),
    (["fork", "research", "--at", "3", "--generate-name"], "unknown flag --generate-name for fork"),
    (["run-template", "t", "--input", "a=1"], "unknown flag --input for run-template"),
    (["get", "research", "--at", "3"], "unknown flag --at for get"),
    (["trigger", "nightly", "--output", "a=b"], "unknown flag --output for trigger"),
])
def test_fork_usage_errors(kubectl: Kubectl, capsys: pytest.CaptureFixture[str], argv: list[str],
                           expected: str) -> None:
    assert cli.main(argv) == 2
    assert expected in capsys.readouterr().err
    assert kubectl.calls() == []


def test_fork_takes_an_output_from_a_file(kubectl: Kubectl, tmp_path: Path) -> None:
    (tmp_path / "plan.md").write_text("# Plan\n\n1. Only this.\n")
    kubectl.on("get flow", origin())
    kubectl.on("create -f", {"kind": "Flow", "metadata": {"name": "research-fork-3"}})
    assert cli.main(["fork", "research", "--at", "3", "--output", f"plan=@{tmp_path}/plan.md"]) == 0
    assert kubectl.created()[0]["spec"]["forkFrom"]["outputs"] == {"plan": "# Plan\n\n1. Only this.\n"}


def test_help_shows_fork(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert "kubectl flow fork NAME --at CHECKPOINT [--input KEY=VALUE]... [--output METHOD=TEXT]..." in (
        capsys.readouterr().out)


def test_get_lists_the_checkpoints_and_the_fork_origin(kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    f = origin(name="research-fork-4")
    f["status"]["forkedFrom"] = {"namespace": "team", "name": "research", "uid": "uid-1", "checkpoint": 4,
                                 "method": "review", "kind": "Paused"}
    f["status"]["inheritedUsage"] = {"totalTokens": 2500, "cost": "0.0031"}
    kubectl.on("get flow", f)
    assert cli.main(["get", "research-fork-4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("Forked from: team/research at checkpoint 4 (Paused review); inherited usage: 2500 tokens, "
                        "USD 0.0031 (not counted in usage)")
    at = lines.index("Checkpoints (fork one: kubectl flow fork research-fork-4 --at ID):")
    assert [line.split() for line in lines[at + 1:at + 4]] == [
        ["3", "Completed", "plan", "2024-05-01T10:00:00Z", "1200", "tokens", "USD", "0.0012"],
        ["4", "Paused", "review", "2024-05-01T10:01:00Z", "2500", "tokens", "USD", "0.0031"],
        ["5", "Completed", "write", "2024-05-01T10:02:00Z", "4000", "tokens", "USD", "0.005"],
    ]


def test_describe_without_checkpoints_or_origin_says_nothing_of_them() -> None:
    text = show.describe(flow("Running"))
    assert "Checkpoints" not in text and "Forked from" not in text
    partial = flow("Running")
    partial["status"]["forkedFrom"] = {"namespace": "team", "name": "research", "checkpoint": 2}
    partial["status"]["checkpoints"] = [{"id": 9, "method": "m", "kind": "Completed", "time": "t"}]
    text = show.describe(partial)
    assert "Forked from: team/research at checkpoint 2\n" in text + "\n" and "inherited" not in text
    assert any(line.split() == ["9", "Completed", "m", "t", "0", "tokens", "USD", "0"] for line in text.splitlines())


def test_quota_lists_each_cap_with_its_use_reservations_window_and_reset(
        kubectl: Kubectl, capsys: pytest.CaptureFixture[str]) -> None:
    team = {"metadata": {"name": "team-a", "namespace": "lab"},
            "spec": {"limits": [
                {"name": "monthly", "maxCost": "200", "maxTotalTokens": 5000000,
                 "window": {"kind": "Month", "timeZone": "Europe/Berlin"}},
                {"name": "hourly", "maxTotalTokens": 9000, "window": {"kind": "Rolling", "hours": 1}}]},
            "status": {"limits": [
                {"name": "monthly", "used": {"totalTokens": 1200, "cost": "0.42"},
                 "reserved": {"totalTokens": 300, "cost": "0.01"}, "resetsAt": "2026-12-01T00:00:00+01:00"},
                {"name": "hourly", "used": {"totalTokens": 50}}],
                       "conditions": [{"type": "Ready", "status": "True"}]}}
    waiting = {"metadata": {"name": "extra", "namespace": "lab"},
               "spec": {"limits": [{"name": "all", "maxTotalTokens": 1, "window": {"kind": "Lifetime"}}]},
               "status": {"conditions": [{"type": "Ready", "status": "False", "message": "namespace lab has 16"}]}}
    kubectl.on("get flowquotas", {"items": [team, waiting]})
    platform = {"metadata": {"name": "platform"}, "spec": {"namespaceSelector": {"matchLabels": {"org": "x"}},
                "limits": [{"name": "all", "maxCost": "1000", "window": {"kind": "Month"}}]}}
    kubectl.on("get clusterflowquotas", {"items": [platform]})
    assert cli.main(["quota", "-A"]) == 0
    assert kubectl.calls() == [["get", "flowquotas", "--all-namespaces", "-o", "json"],
                               ["get", "clusterflowquotas", "-o", "json"]]
    rows = [line.split("   ") for line in capsys.readouterr().out.splitlines()]
    cells = [[c.strip() for c in r if c.strip()] for r in rows]
    assert cells[0] == ["NAMESPACE", "QUOTA", "LIMIT", "USED", "OF", "RESERVED", "WINDOW", "RESETS"]
    assert cells[1] == ["lab", "team-a", "monthly", "1200", "5000000", "300", "month (Europe/Berlin)",
                        "2026-12-01T00:00:00+01:00"]
    assert cells[2] == ["lab", "team-a", "monthly", "USD 0.42", "USD 200", "USD 0.01", "month (Europe/Berlin)",
                        "2026-12-01T00:00:00+01:00"]
    assert cells[3] == ["lab", "team-a", "hourly", "50", "9000", "0", "rolling 1h", "-"]
    assert cells[4] == ["lab", "extra", "all", "not used", "1", "not used", "lifetime", "-"]
    assert cells[5] == ["cluster/platform", "all", "-", "USD 1000", "-", "month (UTC)", "-"]


def test_quota_leaves_out_cluster_quotas_a_user_may_not_list(kubectl: Kubectl,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    kubectl.on("get flowquotas", {"items": []})
    kubectl.on("get clusterflowquotas", rc=1, err='Error from server (Forbidden): clusterflowquotas.flowkube.io is '
               'forbidden: User "bob" cannot list resource "clusterflowquotas"')
    assert cli.main(["quota"]) == 0
    assert "No flowquotas found." in capsys.readouterr().err


def test_describe_names_the_flows_trace() -> None:
    f = flow("Succeeded", turns=1, sessionId="s", ended=True, lastReply="Bye.")
    assert "Trace:" not in show.describe(f)
    f["status"]["trace"] = {"traceId": "4bf92f3577b34da6a3ce929d0e0e4736"}
    assert "Trace: 4bf92f3577b34da6a3ce929d0e0e4736" in show.describe(f)
