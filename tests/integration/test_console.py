"""The web console on the local stack, in a real browser (Debian's chromium, headless).

The chart installs the console beside the operator; the browser reaches it through its Service.
Reviewers sign in with ServiceAccount tokens, as a person pastes an OIDC or ServiceAccount token;
RBAC decides what each sees and may answer. Flows run the REAL runner against the stub model,
whose ledger is what the usage must equal.
"""

from __future__ import annotations

import html
import http.cookiejar
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.jaeger import Jaeger
from tests.integration.browser import Browser, browser, chromium_available
from tests.integration.conftest import Flows
from tests.integration.realrunner import RealRunnerStack, real_runner_stack
from tests.integration.test_conversation import RULES as CHAT_RULES
from tests.integration.test_conversation import SUPPORT
from tests.integration.test_e2e_runner import PUBLISHED, RULES, RUN_TIMEOUT, review_definition, usage_of
from tests.integration.test_notifications import Receiver
from tests.integration.test_notifications import handler as receiver_handler

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not chromium_available(), reason="needs Debian's chromium and chromedriver")]

HOSTILE = '<script>alert("flow")</script><img src=x onerror=alert(1)> [docs](javascript:alert(2))'


@pytest.fixture(scope="module")
def chat(cluster: LocalCluster) -> Iterator[tuple[Receiver, str, str]]:
    """A chat's incoming webhook (a receiver on this host, behind a Service): (it, its URL, its IP)."""
    receiver = Receiver()
    server = ThreadingHTTPServer((cluster.host_ip, 0), receiver_handler(receiver))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = cluster.host_service("console-chat", "flowkube-dev", server.server_address[1])
    ip = cluster.kubectl("get", "service", "console-chat", "-n", "flowkube-dev",
                         "-o", "jsonpath={.spec.clusterIP}").stdout.strip()
    try:
        yield receiver, url, ip
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def stack(cluster: LocalCluster, chat: tuple[Receiver, str, str], jaeger: Jaeger) -> Iterator[RealRunnerStack]:
    rules = {"default": RULES["default"], "rules": [*RULES["rules"], *CHAT_RULES["rules"]]}
    with real_runner_stack(cluster, rules, "console", [f"notifications.allowedCIDRs={{{chat[2]}/32}}"],
                           jaeger=jaeger) as s:
        url = s.operator.console_url()
        # Notifications link to the console where people reach it (here its Service's address); each
        # Flow's page links to its trace.
        s.operator.upgrade(f"console.externalURL={url}", f"console.traceUrl={TRACE_URL}")
        wait_for(lambda: answers(url + "/healthz"), 60, "the console's Service to answer")
        yield s


TRACE_URL = "https://jaeger.example.com/trace/{traceId}"


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def person(cluster: LocalCluster, ns: str, name: str, verbs: list[str], answer: bool) -> str:
    """A ServiceAccount with a Role on Flows in ``ns`` (and on flows/status when it may ``answer``):
    its token, as a person would paste one."""
    cluster.kubectl("create", "serviceaccount", name, "-n", ns)
    token = cluster.kubectl("create", "token", name, "-n", ns, "--duration=1h").stdout.strip()
    if not verbs:
        return token
    rules = [{"apiGroups": ["flowkube.io"], "resources": ["flows"], "verbs": verbs}]
    if answer:
        rules.append({"apiGroups": ["flowkube.io"], "resources": ["flows/status"], "verbs": ["patch"]})
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": name, "namespace": ns},
            "rules": rules}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": name, "namespace": ns},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]}
    both = {"apiVersion": "v1", "kind": "List", "items": [role, binding]}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(both))
    return token


def sign_in(b: Browser, url: str, token: str) -> str:
    b.open(url + "/login")
    b.type("#token", token)
    b.click("#sign-in")
    return b.wait(lambda: b.text("#user") if b.has("#user") else "", 30, "the signed-in page")


@contextmanager
def page_elsewhere(cluster: LocalCluster, target: str) -> Iterator[str]:
    """A page of another site (this host's address, another origin than the console's Service) with
    one link to ``target``, as a chat shows a notification: its URL."""
    page = f'<!doctype html><title>chat</title><a id="link" href="{html.escape(target)}">open</a>'.encode()

    class Page(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

    server = ThreadingHTTPServer((cluster.host_ip, 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://{cluster.host_ip}:{server.server_address[1]}/"
    finally:
        server.shutdown()


def as_user(url: str, token: str) -> tuple[int, str]:
    """A page read with a bearer token in the Authorization header, as an auth proxy passes it."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_reviewer_sees_the_request_live_answers_it_and_a_second_answer_is_refused(
        stack: RealRunnerStack, flows: Flows, tmp_path: Path, chat: tuple[Receiver, str, str]) -> None:
    cluster, ns, url = stack.cluster, flows.ns, stack.operator.console_url()
    # The team's chat is told of every request of the namespace (a namespace-default sink, Slack format).
    hook = {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "team-chat", "labels": {"flowkube.io/notifications": "defaults"}},
            "stringData": {"url": f"{chat[1]}/{ns}", "format": "slack"}}
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(hook))
    alice = person(cluster, ns, "alice", ["get", "list", "watch", "create"], answer=True)
    bob = person(cluster, ns, "bob", ["get", "list", "watch"], answer=True)
    carol = person(cluster, ns, "carol", ["get", "list", "watch"], answer=False)
    dave = person(cluster, ns, "dave", [], answer=False)
    mark = len(stack.stub.ledger())
    # Bob's browser runs no scripts: his page is the one he loaded, its form still there when Alice
    # has answered (as a slow or script-blocking browser shows it). Carl's page follows the flow live.
    with browser(tmp_path, "alice") as a, browser(tmp_path, "bob", javascript=False) as b, \
            browser(tmp_path, "carl") as c:
        assert sign_in(a, url, alice) == f"system:serviceaccount:{ns}:alice"
        a.wait(lambda: a.has("#inbox-empty"), 30, "an empty inbox")

        flows.apply("review", {"definition": review_definition(), "feedback": {"timeoutSeconds": 3600}})
        row = f'li[data-flow="{ns}/review"]'
        a.wait(lambda: a.has(row), RUN_TIMEOUT, "the paused flow in the open inbox, without a reload")
        paused = flows.status("review")
        assert paused["phase"] == "AwaitingFeedback"
        assert "Publish this draft?" in a.text(row) and "approved, rejected" in a.text(row)
        trace_link = TRACE_URL.replace("{traceId}", paused["trace"]["traceId"])
        chat[0].wait(lambda hits: any(h.path == f"/{ns}" for h in hits), "the chat told of it")
        (told,) = chat[0].on(f"/{ns}")
        slack = json.loads(told.body)
        assert slack["text"] == f"Flow {ns}/review needs feedback"
        assert "Publish this draft?" in [b["text"]["text"] for b in slack["blocks"] if b["type"] == "section"]
        (button,) = [e for b in slack["blocks"] if b["type"] == "actions" for e in b["elements"]]
        link = button["url"]
        assert link == f"{url}/flows/{ns}/review"

        # Bob and Carl open the same request before Alice answers.
        for other in (b, c):
            sign_in(other, url, bob)
            other.open(f"{url}/flows/{ns}/review")
            assert other.has('button[data-outcome="rejected"]'), "the answer form"

        a.click(f"{row} a.title")
        a.wait(lambda: a.has('button[data-outcome="approved"]'), 30, "the answer form")
        assert a.attribute('h1 a.side[href*="/trace/"]', "href") == trace_link, "the Flow's trace, linked"
        assert a.text("#review") == paused["feedback"]["request"]["output"]
        a.click('button[data-outcome="approved"]')
        a.wait(lambda: a.has("#sent"), 30, "the answer taken")

        c.wait(lambda: not c.has("#answer"), 60, "the answered request to leave carl's open page")
        b.click('button[data-outcome="rejected"]')
        refusal = b.wait(lambda: b.text("#error") if b.has("#error") else "", 30, "bob's refusal")
        assert "refused" in refusal and ("answered already" in refusal or "no feedback request is pending" in refusal)

        # Alice's page follows the flow to its end by itself.
        a.wait(lambda: a.text("#phase") == "Succeeded", RUN_TIMEOUT, "the page to show Succeeded live")
        a.screenshot("answered")
        assert a.text("#result") == PUBLISHED
        assert f"system:serviceaccount:{ns}:alice" in a.text("tr.history .by")
        a.open(url + "/")
        a.wait(lambda: a.has("#inbox-empty"), 30, "the inbox empty again")
        # The Flows table as a reviewer sees it in a 1400-pixel window: its titles and phase badges on
        # one line each ("Token s", "AwaitingFeedbac k" were broken before).
        a.resize(1400, 900)
        a.open(url + "/flows")
        a.wait(lambda: a.has("td .phase"), 30, "the Flows table")
        a.screenshot("flows-table")
        assert a.wrapped("th, .phase, td.num, td.age") == [], "titles, badges or figures broken over two lines"
        assert not a.alert_shown()

        # The chat's link, clicked on another site's page: the browser holds the SameSite=Strict session
        # cookie back, and Alice still lands on the Flow, signed in.
        with page_elsewhere(cluster, link) as elsewhere:
            a.open(elsewhere)
            a.click("#link")
            a.wait(lambda: a.has("#phase"), 30, "the Flow's page, signed in, from another site's link")
            assert a.text("#phase") == "Succeeded"

        # The review's checkpoints, as a timeline: "Fork from here" after the draft, with the draft
        # edited, makes a new Flow (with Alice's token) that asks about the edited draft, no model call
        # made, its origin's result beside it.
        calls = len(stack.stub.ledger())
        a.open(f"{url}/flows/{ns}/review")
        a.wait(lambda: a.has('li[data-checkpoint="1"] summary'), 30, "the checkpoint timeline")
        assert [a.text(f'li[data-checkpoint="{n}"] .cp-kind').lower() for n in (1, 2, 3, 4)] == [
            "completed", "paused", "completed", "completed"]
        a.click('li[data-checkpoint="1"] summary')
        a.type("#fork-output-1", "EDITED in the browser.")
        a.screenshot("fork-form")
        a.click("#fork-1")
        a.wait(lambda: a.has("#sent"), 30, "the fork made, and its page")
        flows.wait_phase("review-fork-1", "AwaitingFeedback", timeout=RUN_TIMEOUT)
        a.open(f"{url}/flows/{ns}/review-fork-1")
        a.wait(lambda: a.has("#review"), 30, "the fork's review")
        assert a.text("#review") == "EDITED in the browser."
        assert a.text("#origin-result") == PUBLISHED and "checkpoint 1" in a.text("#forked-from")
        a.screenshot("fork")
        assert len(stack.stub.ledger()) == calls and not a.alert_shown()

    st = flows.status("review")
    (answer,) = st["feedback"]["history"]
    assert answer["respondedBy"] == f"system:serviceaccount:{ns}:alice" and answer["outcome"] == "approved"
    assert usage_of(st) == stack.usage_since(mark), "the console's answer resumes once: usage is the ledger's"

    # Carol may read but not answer; Dave may not read. The console asks the API server, not itself.
    flows.apply("review-2", {"definition": review_definition()})
    flows.wait_phase("review-2", "AwaitingFeedback", timeout=RUN_TIMEOUT)
    code, page = as_user(f"{url}/flows/{ns}/review-2", carol)
    assert code == 200 and 'id="read-only"' in page and 'id="answer"' not in page and "Publish this draft?" in page
    code, page = as_user(f"{url}/flows/{ns}/review", carol)
    assert code == 200 and 'id="checkpoints"' in page and 'class="fork-form"' not in page, "no create: no fork form"
    code, page = as_user(f"{url}/flows/{ns}/review-2", dave)
    assert code == 403 and "forbidden" in page
    code, page = as_user(f"{url}/?namespace={ns}", dave)
    assert code == 200 and "review-2" not in page and "forbidden" in page


def test_a_chat_of_three_messages_and_hostile_output_renders_as_text(
        stack: RealRunnerStack, flows: Flows, tmp_path: Path) -> None:
    cluster, ns, url = stack.cluster, flows.ns, stack.operator.console_url()
    ana = person(cluster, ns, "ana", ["get", "list", "watch"], answer=True)
    mark = len(stack.stub.ledger())
    flows.apply("support", {"definition": SUPPORT, "conversation": {"keepWarmSeconds": 600}})
    flows.wait_phase("support", "AwaitingMessage", timeout=RUN_TIMEOUT)
    hostile = {"schema": "crewai.flow/v1", "name": "Hostile",
               "methods": {"say": {"start": True, "do": {"call": "expression", "expr": json.dumps(HOSTILE)}}}}
    flows.apply("hostile", {"definition": hostile})
    with browser(tmp_path, "ana") as b:
        sign_in(b, url, ana)
        b.open(f"{url}/flows/{ns}/support")
        for turn, text in enumerate(["Hello, my name is Ana", "What is my name?", "Thanks, bye"], start=1):
            b.wait(lambda: b.has("#send-message") and b.driver.find_element(
                "css selector", "#send-message").is_enabled(), RUN_TIMEOUT, f"the send box before message {turn}")
            b.type("#message-text", text)
            b.click("#send-message")
            def replied(meta: str = f"· {turn} turns") -> bool:
                return meta in b.text("#chat .meta")

            b.wait(replied, RUN_TIMEOUT, f"the reply to message {turn}, live")
        transcript = b.text("#transcript")
        assert "Nice to meet you." in transcript and "Your name is Ana." in transcript
        b.screenshot("chat")
        b.click("#end-conversation")
        b.wait(lambda: "ended" in b.text("#chat .meta") and b.text("#phase") == "Succeeded", RUN_TIMEOUT,
               "the conversation ended by its button (exit)")
        assert not b.has("#send-message")

        flows.wait_phase("hostile", "Succeeded", timeout=RUN_TIMEOUT)
        b.open(f"{url}/flows/{ns}/hostile")
        assert b.text("#result") == HOSTILE, "the flow's output is shown as the text it is"
        assert not b.alert_shown() and not b.has("#result script") and not b.has("#result img")
        links = b.driver.find_elements("css selector", "a[href^='javascript']")
        assert not links
    st = flows.status("support")
    assert st["conversation"]["ended"] and st["conversation"]["turns"] >= 3
    senders = {m.get("sender") for m in st["conversation"]["messages"] if m["role"] == "user"}
    assert senders == {f"system:serviceaccount:{ns}:ana"}
    assert usage_of(st) == stack.usage_since(mark), "three turns, each call once (the hostile flow calls no model)"


def test_kubectl_flow_console_serves_the_kubeconfigs_user_on_loopback(
        stack: RealRunnerStack, flows: Flows, tmp_path: Path) -> None:
    """`kubectl flow console`: kubectl proxy with the kubeconfig's credentials (a client certificate
    here, which no browser could paste) on a private unix socket, the console in local mode behind
    it, a one-time link."""
    cluster = stack.cluster
    flows.apply("local-review", {"definition": review_definition()})
    plugin = Path(sys.executable).parent / "kubectl-flow"
    proc = subprocess.Popen([str(plugin), "console", "--no-browser", "--kubeconfig", str(cluster.kubeconfig)],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "KUBECTL": str(cluster.bins["kubectl"])})
    try:
        assert proc.stdout is not None
        link = proc.stdout.readline().split("flowkube console: ", 1)[1].strip()
        base = link.split("/auth/local", 1)[0]
        wait_for(lambda: answers(base + "/healthz"), 30, "the local console")
        jar = http.cookiejar.CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        with urllib.request.urlopen(base + "/", timeout=10) as r:  # no link followed: on to sign-in
            assert 'content="0;url=/login?next=%2F"' in r.read().decode()
        with urllib.request.urlopen(base + "/login?next=%2F", timeout=10) as r:
            assert "Open the link it printed" in r.read().decode()
        with opener.open(link, timeout=30) as r:
            page = r.read().decode()
        assert 'id="user"' in page and "system:serviceaccount" not in page
        with opener.open(f"{base}/flows?namespace={flows.ns}", timeout=30) as r:
            assert f'data-flow="{flows.ns}/local-review"' in r.read().decode()
        # The link signs in one browser, once; a guessed key never.
        for url in (link, base + "/auth/local?key=guess"):
            try:
                urllib.request.urlopen(url, timeout=10)
                raise AssertionError(f"{url} signed in a second browser")
            except urllib.error.HTTPError as e:
                assert e.code == 403
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)


def test_a_teams_quotas_page_shows_each_limits_use_and_why_runs_wait(
        stack: RealRunnerStack, flows: Flows, tmp_path: Path) -> None:
    """The Quotas page, as a namespace's member sees it: each FlowQuota's limits as bars of what is used
    and what calls in flight hold, the window and the reset, and the quota's exhaustion in words. The
    status is the one an operator with quotas on writes (this stack's operator has them off, so the
    test writes it); a limit's model name from the spec is text, never markup."""
    cluster, ns, url = stack.cluster, flows.ns, stack.operator.console_url()
    hostile = '<img src=x onerror="alert(1)">'
    quota = {"apiVersion": "flowkube.io/v1alpha1", "kind": "FlowQuota", "metadata": {"name": "team"},
             "spec": {"limits": [
                 {"name": "daily", "maxTotalTokens": 1000, "window": {"kind": "Day", "timeZone": "Europe/Berlin"}},
                 {"name": "monthly", "maxCost": "5", "model": hostile, "window": {"kind": "Month"}}]}}
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(quota))
    status = {"status": {
        "summary": "daily 100%, monthly 24%",
        "limits": [{"name": "daily", "used": {"totalTokens": 1000}, "reserved": {"totalTokens": 0},
                    "windowStart": "2026-11-27T23:00:00Z", "resetsAt": "2026-11-28T23:00:00Z"},
                   {"name": "monthly", "used": {"cost": "1.2"}, "reserved": {"cost": "0.3"},
                    "windowStart": "2026-11-01T00:00:00Z", "resetsAt": "2026-12-01T00:00:00Z"}],
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "Enforced", "lastTransitionTime": "2026-11-28T08:00:00Z"},
            {"type": "Exhausted", "status": "True", "reason": "LimitReached", "message": "daily at 100%",
             "lastTransitionTime": "2026-11-28T09:00:00Z"}]}}
    cluster.kubectl("patch", "flowquota", "team", "-n", ns, "--subresource=status", "--type=merge",
                    "-p", json.dumps(status))
    erin = person(cluster, ns, "erin", ["get", "list", "watch"], answer=False)
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "quota-reader"},
            "rules": [{"apiGroups": ["flowkube.io"], "resources": ["flowquotas"], "verbs": ["get", "list"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "erin-q"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "quota-reader"},
               "subjects": [{"kind": "ServiceAccount", "name": "erin", "namespace": ns}]}
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                      "items": [role, binding]}))
    with browser(tmp_path, "erin") as e:
        sign_in(e, url, erin)
        e.resize(1400, 900)
        e.open(f"{url}/quotas?namespace={ns}")
        e.wait(lambda: e.has(f"#quota-{ns}-team tr.limit"), 30, "the quota's limits")
        e.screenshot("quotas")
        assert "Exhausted" in e.text(f"#quota-{ns}-team h2")
        assert "daily at 100%: new runs wait and new Flows are refused" in e.text(f"#quota-{ns}-team .error")
        daily = e.text('tr.limit[data-limit="daily"]')
        assert "1000 of 1000 tokens" in daily and "100%" in daily and "day (Europe/Berlin)" in daily
        monthly = e.text('tr.limit[data-limit="monthly"]')
        assert "USD 1.2 of 5" in monthly and "24%" in monthly and "USD 0.3" in monthly
        assert hostile in monthly, "the model name is shown as text"
        # The bars are drawn: used 100 % fills the daily track; 24 % used and 6 % held of the monthly one.
        track = e.width('tr.limit[data-limit="daily"] .track')
        assert track > 50 and e.width('tr.limit[data-limit="daily"] .used') == pytest.approx(track - 2, abs=2)
        assert e.width('tr.limit[data-limit="monthly"] .used') == pytest.approx((track - 2) * 0.24, abs=2)
        assert e.width('tr.limit[data-limit="monthly"] .reserved') == pytest.approx((track - 2) * 0.06, abs=2)
        assert not e.alert_shown() and not e.has("img")
        assert e.wrapped("td.num, th") == [], "figures and titles on one line each"
    # Without a grant on FlowQuotas the page says so; it shows nothing of the quota.
    carol = person(cluster, ns, "carol-q", ["get", "list", "watch"], answer=False)
    code, page = as_user(f"{url}/quotas?namespace={ns}", carol)
    assert code == 200 and f"You may not list FlowQuotas in namespace {ns}" in page and "daily" not in page
