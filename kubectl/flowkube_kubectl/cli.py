"""`kubectl flow`: a kubectl plugin over the same patch and reads a person would type.

    kubectl flow get [-A]                              list Flows: phase, definition, tokens, age
    kubectl flow get NAME                              pending request, conversation, runs and usage
    kubectl flow feedback NAME TEXT [--request-id ID]  answer a pending feedback request
    kubectl flow say NAME TEXT [--timeout SECONDS]     send one message to a conversation, print the reply
    kubectl flow chat NAME [--timeout SECONDS]         talk to a conversation, one message per line
    kubectl flow console [--port PORT] [--no-browser]  the web console on this machine, with your kubeconfig
    kubectl flow run-template TEMPLATE [-p KEY=VALUE]... [--cluster-template] [--name NAME | --generate-name]
                              [--dry-run]              start a Flow from a FlowTemplate, print its name
    kubectl flow trigger CRONFLOW [--name NAME]
                              [--dry-run]              start a CronFlow's Flow now, print its name

run-template reads the template (a ClusterFlowTemplate with --cluster-template: kubectl's own --cluster
names a kubeconfig cluster) and checks the parameters before it creates anything. The Flow is named
NAME, or TEMPLATE-<suffix> by the API server (--generate-name, the default); --dry-run prints it
instead. -p/--param KEY=VALUE sets spec.inputs.KEY, once per key: VALUE is JSON when it parses as
JSON (300, true, '["a", "b"]', '{"k": 1}', '"quoted text"') and text otherwise, and kept as text for
a parameter of type string; KEY=@FILE reads VALUE from FILE (quote a text that starts with @: '"@x"').

trigger starts one Flow of a CronFlow now, as `kubectl create job --from=cronjob/NAME` does for a
CronJob: its flowTemplate, labelled flowkube.io/cronflow and owned by the CronFlow like a scheduled
one (so its concurrencyPolicy, history limits and usage count it), annotated flowkube.io/scheduled-at
(now) and flowkube.io/triggered-by: kubectl-flow. The Flow is named NAME, or CRONFLOW-manual-<suffix>
by the API server; --dry-run prints it instead.

Flags go anywhere on the line; `--` ends them (for a TEXT that starts with `-`). kubectl's own
-n/--namespace, --context, --kubeconfig, --cluster, --user, --as, --as-group, --request-timeout,
-s/--server, --token, --insecure-skip-tls-verify and --certificate-authority are passed to every
kubectl call. It calls `kubectl` itself (or $KUBECTL), so contexts, namespaces and credentials
behave exactly as in kubectl.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import webbrowser
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flowkube_api.constants import (
    API_VERSION,
    CLUSTER_TEMPLATE_KIND,
    CLUSTER_TEMPLATE_PLURAL,
    CRONFLOW_KIND,
    CRONFLOW_PLURAL,
    KIND,
    PLURAL,
    SINGULAR,
    TEMPLATE_KIND,
    TEMPLATE_PLURAL,
    Phase,
    Reason,
)
from flowkube_api.cron import cronflow_flow
from flowkube_api.inbox import feedback_patch, message_patch
from flowkube_api.templates import describe_ref, parameter_problems

POLL_INTERVAL = 0.3  # seconds between reads of a Flow while `say` waits for its reply
HISTORY = 6  # messages `chat` shows when it starts
TRIGGERED_BY = "kubectl-flow"  # the value of ANNOTATION_TRIGGERED_BY on a Flow `trigger` started

_KUBE_VALUE_FLAGS = {"-n": "--namespace", "-s": "--server"} | {
    f: f for f in ("--namespace", "--context", "--kubeconfig", "--cluster", "--user", "--as", "--as-group",
                   "--request-timeout", "--server", "--token", "--certificate-authority")}
_KUBE_BOOL_FLAGS = {"--insecure-skip-tls-verify"}
_SHORT_VALUE_FLAGS = {"-n", "-s", "-p"}  # also -nNAME and -n=NAME, as kubectl takes them
_PARAM_FLAGS = {"-p", "--param"}  # run-template's, repeatable
# command: (positionals, least of them, its own flags)
_COMMANDS: dict[str, tuple[str, int, frozenset[str]]] = {
    "get": ("[NAME]", 0, frozenset()),
    "feedback": ("NAME TEXT", 2, frozenset({"--request-id"})),
    "say": ("NAME TEXT", 2, frozenset({"--timeout"})),
    "chat": ("NAME", 1, frozenset({"--timeout"})),
    "console": ("", 0, frozenset({"--port", "--no-browser"})),
    "run-template": ("TEMPLATE", 1, frozenset({"--name", "--generate-name", "--cluster-template", "--dry-run"})),
    "trigger": ("CRONFLOW", 1, frozenset({"--name", "--dry-run"})),
}
_BOOL_COMMAND_FLAGS = frozenset({"--no-browser", "--generate-name", "--cluster-template", "--dry-run"})
_OFF = ("false", "0", "none")  # a boolean flag's values that turn it off (--dry-run=none as in kubectl)
_COMMAND_FLAGS = frozenset().union(*(spec[2] for spec in _COMMANDS.values()))


class UsageError(Exception):
    pass


class KubectlError(Exception):
    def __init__(self, out: subprocess.CompletedProcess[str]) -> None:
        super().__init__(out.stderr)
        self.returncode = out.returncode or 1


@dataclass
class Args:
    cmd: str = ""
    pos: list[str] = field(default_factory=list)
    opts: dict[str, str] = field(default_factory=dict)
    kube: list[str] = field(default_factory=list)  # kubectl's global flags, as --flag=value
    params: list[str] = field(default_factory=list)  # run-template's -p KEY=VALUE, in order
    all_namespaces: bool = False
    help: bool = False


def parse(argv: list[str]) -> Args:
    """Flags anywhere, kubectl style; positionals in order, the first one is the command."""
    a, i = Args(), 0
    while i < len(argv):
        tok, i = argv[i], i + 1
        if tok == "--":
            a.pos += argv[i:]
            break
        if not tok.startswith("-") or tok == "-":
            a.pos.append(tok)
            continue
        i = _take_flag(a, tok, argv, i)
    if not a.help:
        _check(a)
    return a


def _split(tok: str) -> tuple[str, str, str]:
    """(flag, "=" or "", value) of ``--flag=value``, ``-nNAMESPACE`` or ``-n=NAMESPACE``."""
    if tok[:2] in _SHORT_VALUE_FLAGS and len(tok) > 2:
        return tok[:2], "=", tok[2:].removeprefix("=")
    return tok.partition("=")


def _take_flag(a: Args, tok: str, argv: list[str], i: int) -> int:
    """Record the flag ``tok`` (its value from the next argument if it needs one and has no ``=``);
    returns the index of the argument after it."""
    flag, eq, value = _split(tok)
    if flag in ("-h", "--help"):
        a.help = True
    elif flag in ("-A", "--all-namespaces"):
        a.all_namespaces = value.lower() not in ("false", "0")
    elif flag in _KUBE_BOOL_FLAGS:
        a.kube.append(tok)
    elif flag in _BOOL_COMMAND_FLAGS:
        a.opts[flag] = value or "true"
    elif flag in _KUBE_VALUE_FLAGS or flag in _COMMAND_FLAGS or flag in _PARAM_FLAGS:
        if not eq:
            if i == len(argv):
                raise UsageError(f"flag {flag} needs a value")
            value, i = argv[i], i + 1
        if flag in _PARAM_FLAGS:
            a.params.append(value)
        elif flag in _KUBE_VALUE_FLAGS:
            a.kube.append(f"{_KUBE_VALUE_FLAGS[flag]}={value}")
        else:
            a.opts[flag] = value
    else:
        raise UsageError(f"unknown flag {flag} (put -- before a TEXT that starts with -)")
    return i


def _check(a: Args) -> None:
    if not a.pos:
        raise UsageError(f"missing command: one of {', '.join(_COMMANDS)}")
    a.cmd, *a.pos = a.pos
    if a.cmd not in _COMMANDS:
        raise UsageError(f"unknown command {a.cmd!r}: one of {', '.join(_COMMANDS)}")
    usage, least, flags = _COMMANDS[a.cmd]
    if not least <= len(a.pos) <= len((usage or "").split()):
        raise UsageError(f"usage: kubectl flow {a.cmd} {usage} (got {len(a.pos)} arguments: {a.pos})")
    for flag in a.opts:
        if flag not in flags:
            raise UsageError(f"unknown flag {flag} for {a.cmd}")
    if a.params and a.cmd != "run-template":
        raise UsageError(f"unknown flag -p/--param for {a.cmd}")
    if a.all_namespaces and (a.cmd != "get" or a.pos):
        raise UsageError("-A/--all-namespaces only applies to `kubectl flow get` without NAME")
    _check_values(a)


def _check_values(a: Args) -> None:
    try:
        if not float(a.opts.get("--timeout", 0)) >= 0:
            raise ValueError
    except ValueError:
        raise UsageError(f"--timeout needs a number of seconds, got {a.opts['--timeout']!r}") from None
    if not a.opts.get("--port", "0").isdigit() or int(a.opts.get("--port", "0")) > 65535:
        raise UsageError(f"--port needs a port number, got {a.opts['--port']!r}")
    if "--name" in a.opts and (not a.opts["--name"] or _on(a, "--generate-name")):
        raise UsageError("--name needs a name, and goes without --generate-name")
    if a.opts.get("--dry-run", "true").lower() not in ("true", "1", "client", *_OFF):
        raise UsageError(f"--dry-run is client-side only (--dry-run or --dry-run=client), got {a.opts['--dry-run']!r}")


def _on(a: Args, flag: str) -> bool:
    return a.opts.get(flag, "false").lower() not in _OFF


def _namespace(a: Args) -> str:
    """The -n/--namespace given (the last one, as kubectl takes it), or "" for kubeconfig's."""
    return next((k.partition("=")[2] for k in reversed(a.kube) if k.startswith("--namespace=")), "")


def _kubectl(args: list[str], kube: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([os.environ.get("KUBECTL", "kubectl"), *args, *kube], capture_output=True, text=True,
                          input=stdin)


def _json(args: list[str], kube: list[str], stdin: str | None = None) -> dict[str, Any]:
    out = _kubectl([*args, "-o", "json"], kube, stdin)
    if out.returncode != 0:
        raise KubectlError(out)
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def _patch(name: str, patch: dict[str, Any], kube: list[str]) -> subprocess.CompletedProcess[str]:
    return _kubectl(["patch", SINGULAR, name, "--subresource=status", "--type=merge", "-p",
                     json.dumps(patch, separators=(",", ":"))], kube)


def _short(text: str, width: int = 100) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _feedback_lines(name: str, req: dict[str, Any]) -> list[str]:
    lines = [f"Feedback requested by {req['method']} (request {req['id']}):", f"  {req.get('message', '')}"]
    if req.get("emit"):
        lines.append(f"  outcomes: {', '.join(req['emit'])}"
                     + (f" (default {req['defaultOutcome']})" if req.get("defaultOutcome") else ""))
    if req.get("deadline"):
        lines.append(f"  deadline: {req['deadline']}")
    if req.get("output"):
        lines.append("  output:\n    " + req["output"].replace("\n", "\n    "))
    lines.append(f'  answer: kubectl flow feedback {name} "<text>" --request-id {req["id"]}')
    return lines


def _conversation_lines(name: str, conv: dict[str, Any]) -> list[str]:
    lines = [f"\nConversation (session {conv.get('sessionId') or '-'}): {conv.get('turns') or 0} turns, "
             f"ended: {'yes' if conv.get('ended') else 'no'}"]
    for m in conv.get("messages") or []:
        who = m.get("role", "?") + (f" ({m['sender']})" if m.get("sender") else "")
        lines.append(f"  {m.get('time', ''):<20} {who:<24} {_short(m.get('content', ''))}")
    if not conv.get("messages") and conv.get("lastReply"):
        lines.append(f"  last reply: {_short(conv['lastReply'])}")
    for label, m in (("queued", conv.get("inbox")), ("pending", conv.get("pending"))):
        if m:
            turn = f" turn {m['turn']}" if m.get("turn") else ""
            lines.append(f"  {label}{turn} from {m.get('sentBy') or '?'}"
                         f"{' at ' + m['sentAt'] if m.get('sentAt') else ''}: {_short(m.get('text', ''))}")
    if not conv.get("ended"):
        lines.append(f'  send: kubectl flow say {name} "<text>"   (or: kubectl flow chat {name})')
    return lines


def describe(flow: dict[str, Any]) -> str:
    st = flow.get("status") or {}
    name = flow["metadata"]["name"]
    lines = [f"Flow {flow['metadata'].get('namespace', '')}/{name}: {st.get('phase', Phase.PENDING)}"
             f" ({st.get('definition', '')}) - {st.get('message', '')}"]
    req = (st.get("feedback") or {}).get("request")
    if req:
        lines += ["", *_feedback_lines(name, req)]
    if st.get("conversation"):
        lines += _conversation_lines(name, st["conversation"])
    runs = st.get("runs") or []
    if runs:
        lines.append("\nRuns:")
        for r in runs:
            tokens = (r.get("usage") or {}).get("totalTokens", 0)
            lines.append(f"  {r['pod']:<30} {r['trigger']:<8} {r.get('result', 'Running'):<10} "
                         f"{tokens:>8} tokens  {r.get('reason', '')}")
    usage = st.get("usage") or {}
    if usage:
        lines.append(f"\nUsage: {usage.get('totalTokens', 0)} tokens ({usage.get('promptTokens', 0)} prompt, "
                     f"{usage.get('completionTokens', 0)} completion), {usage.get('successfulRequests', 0)} requests")
        for model, u in sorted((usage.get("byModel") or {}).items()):
            lines.append(f"  {model}: {u.get('totalTokens', 0)} tokens, {u.get('successfulRequests', 0)} requests")
    for h in (st.get("feedback") or {}).get("history") or []:
        who = f" by {h['respondedBy']}" if h.get("respondedBy") else ""
        what = "timed out" if h.get("timedOut") else repr(h.get("response"))
        lines.append(f"  answered {h['requestId']} ({h['method']}){who}: {what}")
    lines += _notification_lines(st.get("notifications") or [])
    return "\n".join(lines)


def _notification_lines(records: list[dict[str, Any]]) -> list[str]:
    """Each sink's last delivery (status.notifications)."""
    if not records:
        return []
    lines = ["\nNotifications (last delivery per sink):"]
    for r in records:
        code = f" HTTP {r['code']}" if r.get("code") else ""
        lines.append(f"  {r['name']:<20} {r.get('event', ''):<18} {r.get('outcome', ''):<9} "
                     f"{r.get('reason', '')}{code}, {r.get('attempts', 0)} attempt(s) at {r.get('time', '?')}")
        if r.get("outcome") == "Failed" and r.get("message"):
            lines.append(f"  {'':<20} {_short(r['message'])}")
    return lines


def _when(ts: str | None) -> datetime:
    try:
        t = datetime.fromisoformat(ts) if ts else datetime.min
    except ValueError:
        t = datetime.min
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _age(ts: str | None, now: datetime) -> str:
    if not ts:
        return "<unknown>"
    s = max(0, int((now - _when(ts)).total_seconds()))
    for unit, size, below in (("s", 1, 120), ("m", 60, 7200), ("h", 3600, 172800)):
        if s < below:
            return f"{s // size}{unit}"
    return f"{s // 86400}d"


def flow_table(flows: list[dict[str, Any]], all_namespaces: bool, now: datetime) -> str:
    rows = [["NAMESPACE"] * all_namespaces + ["NAME", "PHASE", "DEFINITION", "TOKENS", "AGE"]]
    for f in flows:
        st, meta = f.get("status") or {}, f["metadata"]
        rows.append([meta.get("namespace", "")] * all_namespaces
                    + [meta["name"], st.get("phase") or Phase.PENDING, st.get("definition") or "",
                       str((st.get("usage") or {}).get("totalTokens", "")), _age(meta.get("creationTimestamp"), now)])
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("   ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows)


@dataclass
class Turn:
    outcome: str  # reply | feedback | failed | refused | timeout
    detail: str = ""  # the reply, the feedback request, or why not
    ended: bool = False


def _conversation(flow: dict[str, Any]) -> dict[str, Any]:
    conv: dict[str, Any] = (flow.get("status") or {}).get("conversation") or {}
    return conv


def _outcome(flow: dict[str, Any], turns_before: int, phase_before: str | None) -> Turn | None:
    """What the Flow says about the message sent after `turns_before` turns; None while it is undecided."""
    st, conv = flow.get("status") or {}, _conversation(flow)
    phase, turns, taken = st.get("phase"), conv.get("turns") or 0, not conv.get("inbox")
    if turns > turns_before and taken and not conv.get("pending"):
        return Turn("reply", conv.get("lastReply") or "", bool(conv.get("ended")))
    req = (st.get("feedback") or {}).get("request")
    if phase == Phase.AWAITING_FEEDBACK and req and taken and (conv.get("pending") or phase_before != phase):
        name = flow["metadata"]["name"]
        return Turn("feedback", "\n".join(_feedback_lines(name, req)))
    if phase == Phase.FAILED:
        return Turn("failed", f"Flow failed: {st.get('message') or 'no message'}")
    if taken and not conv.get("pending") and turns == turns_before and phase not in (Phase.RUNNING, Phase.PENDING):
        return Turn("refused")
    return None


def _refusal(name: str, kube: list[str]) -> str:
    try:
        selector = f"involvedObject.name={name},reason={Reason.MESSAGE_REFUSED}"
        events = _json(["get", "events", "--field-selector", selector], kube).get("items") or []
    except KubectlError:
        events = []
    if not events:
        return f"message refused: the operator did not take it (see kubectl flow get {name})"
    newest = max(events, key=lambda e: _when(e.get("lastTimestamp") or e.get("eventTime")
                                             or e["metadata"].get("creationTimestamp")))
    return f"message refused: {newest.get('message', '')}"


def send(name: str, text: str, kube: list[str], timeout: float) -> Turn:
    """Send one message and wait for what becomes of it: a reply, a feedback request, a failure or a refusal."""
    before = _json(["get", SINGULAR, name], kube)
    turns_before = _conversation(before).get("turns") or 0
    out = _patch(name, message_patch(text), kube)
    if out.returncode != 0:
        return Turn("refused", out.stderr.strip() or f"kubectl patch exited with {out.returncode}")
    deadline = time.monotonic() + timeout
    while True:
        turn = _outcome(_json(["get", SINGULAR, name], kube), turns_before, (before.get("status") or {}).get("phase"))
        if turn:
            return Turn("refused", _refusal(name, kube)) if turn.outcome == "refused" else turn
        left = deadline - time.monotonic()
        if left <= 0:
            return Turn("timeout", f"no reply within {timeout:g}s; the message may still be answered: "
                                   f"kubectl flow get {name}")
        time.sleep(min(POLL_INTERVAL, left))


def _report(turn: Turn, reply_prefix: str = "") -> int:
    if turn.outcome in ("reply", "feedback"):
        print(reply_prefix + turn.detail if turn.outcome == "reply" else turn.detail, flush=True)
        if turn.ended:
            print("The conversation has ended.", file=sys.stderr)
        return 0
    print(turn.detail, file=sys.stderr)
    return 1


def chat(name: str, kube: list[str], timeout: float) -> int:
    conv = _conversation(_json(["get", SINGULAR, name], kube))
    for m in (conv.get("messages") or [])[-HISTORY:]:
        who = "flow" if m.get("role") == "assistant" else m.get("sender") or "you"
        print(f"{who}> {m.get('content', '')}")
    if conv.get("ended"):
        print("The conversation has ended.", file=sys.stderr)
        return 0
    tty = sys.stdin.isatty()
    while True:
        if tty:
            print("you> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            print(f"\nThe session stays open: continue with `kubectl flow chat {name}` "
                  f'or `kubectl flow say {name} "<text>"`.', file=sys.stderr)
            return 0
        if not line.strip():
            continue
        turn = send(name, line.strip(), kube, timeout)
        rc = _report(turn, "flow> ")
        if turn.outcome == "feedback":
            print(f"Answer it, then continue with `kubectl flow chat {name}`.", file=sys.stderr)
        if not (turn.outcome == "refused" or (turn.outcome == "reply" and not turn.ended)):
            return rc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _console_command() -> list[str]:
    """flowkube-console beside this plugin (the same installation), or on PATH."""
    here = Path(sys.argv[0]).resolve().parent / "flowkube-console"
    found = str(here) if here.exists() else shutil.which("flowkube-console")
    if not found:
        raise UsageError("the console is not installed here: pip install 'flowkube[console]' "
                         "(it provides flowkube-console)")
    return [found]


def console(a: Args) -> int:
    """`kubectl proxy` with your kubeconfig's credentials on a unix socket only you can open, the
    console in local mode behind it on a loopback port, and the browser opened on a one-time link."""
    command = _console_command()
    port, key = int(a.opts.get("--port") or _free_port()), secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="flowkube-console-") as private:  # mode 0700
        sock = str(Path(private) / "kube.sock")
        proxy = subprocess.Popen([os.environ.get("KUBECTL", "kubectl"), "proxy", f"--unix-socket={sock}", *a.kube],
                                 stdout=subprocess.PIPE, text=True)
        procs: list[subprocess.Popen[Any]] = [proxy]
        try:
            assert proxy.stdout is not None
            first = proxy.stdout.readline()  # "Starting to serve on /path/kube.sock"
            if sock not in first:
                return proxy.wait(timeout=30) or 1  # kubectl said why on stderr
            procs.append(subprocess.Popen([*command, "--mode", "local", "--api-socket", sock, "--host", "127.0.0.1",
                                           "--port", str(port)],
                                          env={**os.environ, "FLOWKUBE_CONSOLE_LAUNCH_KEY": key}))
            url = f"http://127.0.0.1:{port}/auth/local?key={key}"
            print(f"flowkube console: {url}\n(the link signs in one browser, once; Ctrl-C stops it)", flush=True)
            if a.opts.get("--no-browser", "false").lower() in ("false", "0"):
                webbrowser.open(url)
            return procs[1].wait()
        except KeyboardInterrupt:
            return 0
        finally:
            for p in reversed(procs):
                _stop(p)


def _stop(proc: subprocess.Popen[Any]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")  # Python's json module would take NaN and Infinity


def param_value(text: str) -> Any:
    """A -p VALUE: the JSON value when it parses as JSON, else the text itself."""
    try:
        return json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError):
        return text


def read_params(params: list[str]) -> dict[str, str]:
    """KEY: VALUE text of each -p KEY=VALUE (VALUE read from FILE for KEY=@FILE), before any parsing."""
    out: dict[str, str] = {}
    for p in params:
        key, eq, text = p.partition("=")
        if not eq or not key:
            raise UsageError(f"-p {p!r} needs KEY=VALUE")
        if key in out:
            raise UsageError(f"-p {key} given twice")
        if text.startswith("@"):
            try:
                text = Path(text[1:]).expanduser().read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise UsageError(f"-p {key}={text}: cannot read {text[1:]!r}: {e}") from None
        out[key] = text
    return out


def template_inputs(texts: dict[str, str], template_spec: dict[str, Any]) -> dict[str, Any]:
    """spec.inputs from the -p texts: JSON values, except that a parameter of type string gets the
    text itself unless it is a JSON string (`-p version=1.10` is "1.10", not 1.1)."""
    types = {p.get("name"): p.get("type") for p in template_spec.get("parameters") or [] if isinstance(p, dict)}
    out: dict[str, Any] = {}
    for key, text in texts.items():
        value = param_value(text)
        out[key] = text if types.get(key) == "string" and not isinstance(value, str) else value
    return out


def template_flow(template: str, kind: str, inputs: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """The Flow run-template creates: NAME, or TEMPLATE-<suffix> from the API server."""
    spec: dict[str, Any] = {"templateRef": {"name": template, "kind": kind}}
    if inputs:
        spec["inputs"] = inputs
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": name} if name else {"generateName": f"{template}-"}, "spec": spec}


def _parameter_lines(what: str, template_spec: dict[str, Any]) -> list[str]:
    params = [p for p in template_spec.get("parameters") or [] if isinstance(p, dict)]
    lines = [f"{what} takes:" if params else f"{what} declares no parameters."]
    for p in params:
        facts = [str(p.get("type") or "any JSON")]
        if "default" in p:
            facts.append(f"default {json.dumps(p['default'])}")
        elif p.get("required"):
            facts.append("required")
        lines.append(f"  -p {p.get('name')}=...  ({', '.join(facts)})"
                     + (f" {_short(p['description'])}" if p.get("description") else ""))
    return lines


def run_template(a: Args) -> int:
    """Read the template, check the -p values against its parameters, then create the Flow (or print it)."""
    texts = read_params(a.params)
    cluster = _on(a, "--cluster-template")
    kind, plural = (CLUSTER_TEMPLATE_KIND, CLUSTER_TEMPLATE_PLURAL) if cluster else (TEMPLATE_KIND, TEMPLATE_PLURAL)
    ref = {"name": a.pos[0], "kind": kind}
    namespace = _namespace(a)
    try:
        template = _json(["get", plural, a.pos[0]], a.kube)
    except KubectlError as e:
        if "(Forbidden)" in str(e):  # may run a ClusterFlowTemplate, not read it: the webhook checks
            print(f"kubectl flow: cannot read {describe_ref(namespace, ref)}; the parameters are checked when "
                  "the Flow is created", file=sys.stderr)
            template = {}
        elif "(NotFound)" not in str(e):
            raise
        else:
            where = "" if cluster or namespace else " in the current namespace"
            hint = f"kubectl get {plural}" + ("" if cluster else "; a ClusterFlowTemplate: add --cluster-template")
            print(f"kubectl flow: error: {describe_ref(namespace, ref)} not found{where} ({hint})", file=sys.stderr)
            return 1
    what = describe_ref(template.get("metadata", {}).get("namespace") or namespace, ref)
    tspec = template.get("spec") or {}
    inputs = template_inputs(texts, tspec)
    problems = parameter_problems(tspec, inputs, what)
    if problems:
        for problem in problems:
            print(f"kubectl flow: error: {problem}", file=sys.stderr)
        print("\n".join(_parameter_lines(what, tspec)), file=sys.stderr)
        return 1
    return _create_flow(a, template_flow(a.pos[0], kind, inputs, a.opts.get("--name")))


def _create_flow(a: Args, body: dict[str, Any]) -> int:
    """Create the Flow and print its name (with --dry-run: print the Flow instead)."""
    if _on(a, "--dry-run"):
        print(json.dumps(body, indent=2))
        return 0
    name = _json(["create", "-f", "-"], a.kube, json.dumps(body))["metadata"]["name"]
    print(name)
    print(f"Follow it: kubectl flow get {name}", file=sys.stderr)
    return 0


def trigger_flow(cronflow: dict[str, Any], now: datetime, name: str | None = None) -> dict[str, Any]:
    """The Flow `trigger` creates: the operator's scheduled Flow for ``now`` (one function serves
    both: `flowkube_api.cron.cronflow_flow`), named NAME or CRONFLOW-manual-<suffix> by the API server,
    annotated as started by kubectl flow, owned without blockOwnerDeletion."""
    return cronflow_flow(cronflow, now, name=name, triggered_by=TRIGGERED_BY)


def trigger(a: Args) -> int:
    """Read the CronFlow, then create its Flow for now (or print it)."""
    try:
        cronflow = _json(["get", CRONFLOW_PLURAL, a.pos[0]], a.kube)
    except KubectlError as e:
        if "(NotFound)" not in str(e):
            raise
        namespace = _namespace(a)
        where = f' in namespace "{namespace}"' if namespace else " in the current namespace"
        print(f'kubectl flow: error: {CRONFLOW_KIND} "{a.pos[0]}" not found{where} (kubectl get {CRONFLOW_PLURAL})',
              file=sys.stderr)
        return 1
    return _create_flow(a, trigger_flow(cronflow, datetime.now(UTC), a.opts.get("--name")))


def _run(a: Args) -> int:
    if a.cmd == "console":
        return console(a)
    if a.cmd == "run-template":
        return run_template(a)
    if a.cmd == "trigger":
        return trigger(a)
    timeout = float(a.opts.get("--timeout", 300))
    if a.cmd == "feedback":
        out = _patch(a.pos[0], feedback_patch(a.pos[1], a.opts.get("--request-id")), a.kube)
        sys.stdout.write(out.stdout)
        sys.stderr.write(out.stderr)
        return out.returncode
    if a.cmd == "say":
        return _report(send(a.pos[0], a.pos[1], a.kube, timeout))
    if a.cmd == "chat":
        return chat(a.pos[0], a.kube, timeout)
    if a.pos:
        print(describe(_json(["get", SINGULAR, a.pos[0]], a.kube)))
        return 0
    items = _json(["get", PLURAL, *["--all-namespaces"] * a.all_namespaces], a.kube).get("items") or []
    if not items:
        print("No flows found.", file=sys.stderr)
        return 0
    print(flow_table(items, a.all_namespaces, datetime.now(UTC)))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        if args.help:
            print(__doc__)
            return 0
        return _run(args)
    except UsageError as e:
        print(f"kubectl flow: error: {e}\nSee 'kubectl flow --help' for usage.", file=sys.stderr)
        return 2
    except KubectlError as e:
        sys.stderr.write(str(e))
        return e.returncode
