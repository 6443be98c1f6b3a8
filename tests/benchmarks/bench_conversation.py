"""Benchmark: a conversation's turns on the real node, cold (every turn a new runner pod) and warm (one
pod answers every message). Prints figures.

    .venv/bin/python -m tests.benchmarks.bench_conversation [--messages 8] [--floors 3] [--warm-messages 50]

The warm part, after the cold one: a second conversation with ``keepWarmSeconds: 600``, its messages
sent one after another; each latency runs from the PATCH returning to the Flow version with the
reply, as below; the runner process's resident memory is read from /proc along the way.

The operator from its chart (webhooks, status policy), runner pods from the runner image on the
local stack's real node (kubelet, containerd), the stub model answering crewAI's router and chat
calls. One conversational Flow (the SUPPORT definition of the integration tests) opens its session,
then ``--messages`` messages are sent one after another as the documented status patch of
``status.conversation.inbox``. Each latency runs from the PATCH returning to the first version of
the Flow, seen by a watch on it (no polling: events are timestamped as they arrive), whose
``status.conversation`` holds that message's reply (``turns`` counted it, nothing pending, phase
``AwaitingMessage``). A watch on the namespace's pods and the stub model's ledger split each turn:
runner pod created, container running (as the kubelet reports it), first model call received, last
model call answered, container terminated (as reported), reply in status. All times are this host's
wall clock, which the pods share.

Next to it, in the same run: ``--floors`` pods shaped like runner pods (same image, security
context, environment; no state token) that time, in the container, Python's start, ``import
crewai.flow.flow`` (the import floor, as ``bench_node`` measures it: pod created -> import done),
the rest of the runner's engine imports, and opening the same conversation on a file store (Flow
construction, as a kickoff run does). They run between turns (before the first message, halfway
and after the last), never during one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import ssl
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from flowkube_api import constants as c
from flowkube_api.report import Usage
from flowkube_devstack.cluster import LocalCluster
from flowkube_devstack.operator import ChartOperator
from flowkube_devstack.stubmodel import Rules, StubModel, ledger_usage
from flowkube_operator.flows.resources import CONTAINER_SECURITY
from tests.benchmarks.realstack import RUNNER_ENV, real_stack
from tests.integration.realrunner import MODEL

NS = "bench-conversation"
NAME = "chat"
FLOWS = f"/apis/flowkube.io/v1alpha1/namespaces/{NS}/flows"
SUPPORT = {
    "schema": "crewai.flow/v1",
    "name": "Support",
    "conversational": {"llm": MODEL, "system_prompt": "You are a support agent."},
    "methods": {"handle_refund": {"listen": "refund", "do": {"call": "expression", "expr": "'Refund started'"}}},
}
TURN_TIMEOUT = 180.0  # one cold runner pod (crewAI import) on a busy machine

Obj = dict[str, Any]


def message(i: int) -> str:
    return f"Question [m{i}]: how do I reset my password?"


def reply(i: int) -> str:
    return f"Answer {i}: use the reset link."


def rules(n: int) -> Rules:
    """Every router call finds no route (the stub answers ``converse``); every chat call gets its
    message's own reply, so a turn's reply cannot be mistaken for an earlier one."""
    return Rules.from_json({"default": "A plain reply.", "rules": [
        {"contains": f"[m{i}]", "structured": False, "reply": reply(i)} for i in range(1, n + 1)]})


def http_client(cluster: LocalCluster) -> httpx.Client:
    cfg = yaml.safe_load(cluster.kubeconfig.read_text())
    user = cfg["users"][0]["user"]
    ctx = ssl.create_default_context(cafile=cfg["clusters"][0]["cluster"]["certificate-authority"])
    ctx.load_cert_chain(user["client-certificate"], user["client-key"])
    return httpx.Client(base_url=cluster.server, verify=ctx, timeout=30)


class Watch:
    """Every event of one collection, stamped with the wall-clock time it arrived (a thread reads
    the stream; a closed stream is resumed from the last resourceVersion)."""

    def __init__(self, cluster: LocalCluster, path: str) -> None:
        self.events: list[tuple[float, str, Obj]] = []
        self._http = http_client(cluster)
        self._path = path
        self._changed = threading.Condition()
        self._stopping = False
        self._opened = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        if not self._opened.wait(30):
            raise TimeoutError(f"watch of {path} did not open")

    def _read(self) -> None:
        version = ""
        while not self._stopping:
            params = {"watch": "1", **({"resourceVersion": version} if version else {})}
            try:
                with self._http.stream("GET", self._path, params=params,
                                       timeout=httpx.Timeout(30, read=None)) as r:
                    self._opened.set()
                    for line in r.iter_lines():
                        if not line:
                            continue
                        arrived = time.time()
                        ev = json.loads(line)
                        if ev["type"] == "ERROR":  # 410 Gone: start again from now
                            version = ""
                            break
                        version = ev["object"]["metadata"].get("resourceVersion", version)
                        with self._changed:
                            self.events.append((arrived, ev["type"], ev["object"]))
                            self._changed.notify_all()
            except Exception:  # the connection dropped, or stop() closed the client under us
                if self._stopping:
                    return
                time.sleep(0.05)

    def mark(self) -> int:
        with self._changed:
            return len(self.events)

    def first(self, pred: Callable[[Obj], bool], since: int = 0) -> tuple[float, Obj] | None:
        with self._changed:
            return next(((t, o) for t, _, o in self.events[since:] if pred(o)), None)

    def wait(self, pred: Callable[[Obj], bool], timeout: float, what: str, since: int = 0) -> tuple[float, Obj]:
        """The first event from index ``since`` on whose object satisfies ``pred``."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = next(((t, o) for t, _, o in self.events[since:] if pred(o)), None)
                if found is not None:
                    return found
                since = len(self.events)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
                self._changed.wait(left)

    def stop(self) -> None:
        self._stopping = True
        self._http.close()


def named(name: str) -> Callable[[Obj], bool]:
    return lambda o: bool(o["metadata"]["name"] == name)


def container_state(pod: Obj) -> Obj:
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    state: Obj = statuses[0].get("state") or {}
    return state


def conversation(flow: Obj) -> Obj:
    status = flow.get("status") or {}
    if status.get("phase") in ("Failed", "Succeeded"):
        raise RuntimeError(f"{flow['metadata']['name']} ended {status['phase']}: {status.get('message')}")
    conv: Obj = status.get("conversation") or {}
    return conv


def answered(name: str, i: int) -> Callable[[Obj], bool]:
    def done(flow: Obj) -> bool:
        if flow["metadata"]["name"] != name:
            return False
        conv = conversation(flow)
        return conv.get("turns", 0) >= i and "pending" not in conv and flow["status"].get("phase") == "AwaitingMessage"

    return done


# --- the floor: a pod shaped like a runner pod, timing itself ---

FLOOR_SCRIPT = """\
import json, pathlib, sys, time
t = [time.time()]
import crewai.flow.flow
t.append(time.time())
from flowkube_runner.engine import session, usage
from flowkube_runner.store import FileStore
t.append(time.time())
s = session.FlowSession(FileStore(pathlib.Path('/tmp/state')), 'floor', None)
s.load(definition=json.loads(sys.argv[1]))
s.open_conversation(None)
t.append(time.time())
open('/dev/termination-log', 'w').write(json.dumps(t))
"""
FLOOR_STEPS = ("pod created -> Python running (the pod start floor)",
               "Python running -> `import crewai.flow.flow` done",
               "-> the rest of the runner's engine imported",
               "-> Flow constructed, session opened (a kickoff run's work)")


def floor_pod(cluster: LocalCluster, name: str) -> Obj:
    assert cluster.images is not None
    env = {"HOME": "/tmp", "CREWAI_DISABLE_TELEMETRY": "true", "OTEL_SDK_DISABLED": "true", **RUNNER_ENV}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"bench": "floor"}},
            "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False, "enableServiceLinks": False,
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                         "fsGroup": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [{
                         "name": "c", "image": cluster.images.runner, "imagePullPolicy": "Never",
                         "command": ["python", "-c", FLOOR_SCRIPT, json.dumps(SUPPORT)],
                         "env": [{"name": k, "value": v} for k, v in env.items()],
                         "securityContext": CONTAINER_SECURITY,
                         "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}],
                     "volumes": [{"name": "tmp", "emptyDir": {}}]}}


def floor(cluster: LocalCluster, http: httpx.Client, pods: Watch, k: int) -> list[float]:
    """Seconds of each step of FLOOR_STEPS, for one pod."""
    name = f"floor-{k}"
    mark = pods.mark()
    r = http.post(f"/api/v1/namespaces/{NS}/pods", json=floor_pod(cluster, name))
    r.raise_for_status()
    created, _ = pods.wait(named(name), 30, f"{name} created", since=mark)
    _, pod = pods.wait(lambda o: named(name)(o) and "terminated" in container_state(o), TURN_TIMEOUT,
                       f"{name} to finish", since=mark)
    ended = container_state(pod)["terminated"]
    if ended.get("exitCode") != 0:
        raise RuntimeError(f"{name} failed: {ended.get('message') or ended}")
    stamps: list[float] = [created, *json.loads(ended["message"])]
    return [b - a for a, b in itertools.pairwise(stamps)]


# --- the conversation ---


@dataclass
class Turn:
    """Seconds since the patch returned: each milestone of one turn (a warm turn has no pod of its own)."""

    total: float
    accepted: float | None
    created: float | None
    running: float | None
    first_call: float
    last_answer: float
    terminated: float | None
    calls: int


def send(http: httpx.Client, name: str, text: str) -> float:
    body = {"status": {"conversation": {"inbox": {"text": text}}}}
    r = http.patch(f"{FLOWS}/{name}/status", json=body, headers={"Content-Type": "application/merge-patch+json"})
    if r.status_code >= 300:
        raise RuntimeError(f"message refused: {r.status_code} {r.text}")
    return time.time()


def exchange(http: httpx.Client, flows: Watch, name: str, i: int) -> tuple[float, float, float | None]:
    """Send message ``i`` and wait for its reply in status: (patch returned, reply seen, accepted seen)."""
    fmark = flows.mark()
    sent = send(http, name, message(i))
    done, flow = flows.wait(answered(name, i), TURN_TIMEOUT, f"the reply to message {i}", since=fmark)
    got = flow["status"]["conversation"].get("lastReply")
    if got != reply(i):
        raise RuntimeError(f"message {i} answered {got!r}, expected {reply(i)!r}")
    accepted = flows.first(lambda o: named(name)(o) and "pending" in conversation(o), since=fmark)
    return sent, done, accepted[0] if accepted else None


def warm_turn(http: httpx.Client, flows: Watch, stub: StubModel, name: str, i: int) -> Turn:
    """A message answered by the pod that waits warm: patch -> accepted -> the pod's model calls -> reply."""
    lmark = len(stub.ledger())
    sent, done, accepted = exchange(http, flows, name, i)
    calls = stub.ledger()[lmark:]
    if not calls:
        raise RuntimeError(f"message {i} was answered without a model call")
    return Turn(total=done - sent, accepted=accepted - sent if accepted is not None else None, created=None,
                running=None, first_call=calls[0]["received"] - sent, last_answer=calls[-1]["time"] - sent,
                terminated=None, calls=len(calls))


def turn(http: httpx.Client, flows: Watch, pods: Watch, stub: StubModel, i: int) -> Turn:
    pmark, lmark = pods.mark(), len(stub.ledger())
    sent, done, accepted = exchange(http, flows, NAME, i)
    pod_name = c.run_pod_name(NAME, i)
    created, _ = pods.wait(named(pod_name), 30, f"{pod_name} created", since=pmark)
    # The kubelet may report the container's end after the operator has read the run's report.
    ended, _ = pods.wait(lambda o: named(pod_name)(o) and "terminated" in container_state(o), 60,
                         f"{pod_name} to end", since=pmark)
    running = pods.first(lambda o: named(pod_name)(o) and bool({"running", "terminated"} & set(container_state(o))),
                         since=pmark)
    calls = stub.ledger()[lmark:]
    if not calls:
        raise RuntimeError(f"message {i} was answered without a model call")
    return Turn(total=done - sent, accepted=accepted - sent if accepted is not None else None, created=created - sent,
                running=running[0] - sent if running else None, first_call=calls[0]["received"] - sent,
                last_answer=calls[-1]["time"] - sent, terminated=ended - sent, calls=len(calls))


@dataclass
class Result:
    opened: float
    turns: list[Turn]
    floors: list[list[float]]
    pods: list[str]
    triggers: list[str]
    usage_matches: bool
    calls: int
    tokens: int
    floor_calls: int
    operator_turns: tuple[float, float]


def conversation_run(cluster: LocalCluster, stub: StubModel, op: ChartOperator, n: int, n_floors: int) -> Result:
    ledger_mark = len(stub.ledger())
    http = http_client(cluster)
    flows = Watch(cluster, FLOWS)
    pods = Watch(cluster, f"/api/v1/namespaces/{NS}/pods")
    try:
        # Floors before the first message, halfway and after the last (never during a turn).
        at = {round(k * n / max(n_floors - 1, 1)) for k in range(n_floors)}
        floors: list[list[float]] = []
        floor_calls = 0

        def floors_after(i: int) -> None:
            nonlocal floor_calls
            if i in at:
                mark = len(stub.ledger())
                floors.append(floor(cluster, http, pods, len(floors)))
                floor_calls += len(stub.ledger()) - mark

        r = http.post(FLOWS, json={"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": NAME},
                                   "spec": {"definition": SUPPORT, "conversation": {"keepWarmSeconds": 0}}})
        r.raise_for_status()
        applied = time.time()
        opened, _ = flows.wait(lambda o: conversation(o).get("sessionId") is not None
                                  and o["status"].get("phase") == "AwaitingMessage", TURN_TIMEOUT, "the session")
        floors_after(0)
        turns: list[Turn] = []
        for i in range(1, n + 1):
            turns.append(turn(http, flows, pods, stub, i))
            print(f"  message {i}: reply in status {turns[-1].total:.2f} s after the patch", flush=True)
            floors_after(i)
        status = http.get(f"{FLOWS}/{NAME}").raise_for_status().json()["status"]
        ledger = stub.ledger()[ledger_mark:]  # the stub serves this Flow only now (the floor pods call no model)
        usage = ledger_usage(ledger)
        added = sorted({o["metadata"]["name"] for _, kind, o in pods.events
                        if kind == "ADDED" and o["metadata"].get("labels", {}).get(c.LABEL_FLOW) == NAME})
        sums = {m.split()[0]: float(m.split()[1]) for m in op.metrics().splitlines()
                if m.startswith(("flowkube_conversation_turn_seconds_sum", "flowkube_conversation_turn_seconds_count"))
                and f'namespace="{NS}"' in m}  # the leader's /metrics (one replica here), both Flows
        return Result(
            opened=opened - applied, turns=turns, floors=floors, pods=added,
            triggers=[run["trigger"] for run in status.get("runs", [])],
            usage_matches=Usage.model_validate(status["usage"]) == usage,
            calls=len(ledger), tokens=usage.total_tokens, floor_calls=floor_calls,
            operator_turns=(sum(v for k, v in sums.items() if "_count" in k),
                            sum(v for k, v in sums.items() if "_sum" in k)))
    finally:
        flows.stop()
        pods.stop()
        http.close()


# --- warm: one pod answers every message ---

WARM = "chat-warm"


def rss_of_pod(pod: str) -> int | None:
    """Resident memory (bytes) of the runner process of ``pod``: the real node's containers are this
    host's processes, found by the pod name in their environment."""
    needle = f"{c.ENV_POD_NAME}={pod}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if needle not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            for line in (proc / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            continue
    return None


@dataclass
class WarmResult:
    opened: float
    turns: list[Turn]
    pods: list[str]
    usage_matches: bool
    calls: int
    rss: list[tuple[int, int | None]]  # (messages answered, resident bytes of the pod's process)


def warm_run(cluster: LocalCluster, stub: StubModel, n: int) -> WarmResult:
    ledger_mark = len(stub.ledger())
    http = http_client(cluster)
    flows = Watch(cluster, FLOWS)
    pods = Watch(cluster, f"/api/v1/namespaces/{NS}/pods")
    try:
        r = http.post(FLOWS, json={"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": WARM},
                                   "spec": {"definition": SUPPORT, "conversation": {"keepWarmSeconds": 600}}})
        r.raise_for_status()
        applied = time.time()
        opened, _ = flows.wait(lambda o: named(WARM)(o) and conversation(o).get("sessionId") is not None
                               and o["status"].get("phase") == "AwaitingMessage", TURN_TIMEOUT, "the session")
        pod = c.run_pod_name(WARM, 0)
        rss = [(0, rss_of_pod(pod))]
        turns: list[Turn] = []
        for i in range(1, n + 1):
            turns.append(warm_turn(http, flows, stub, WARM, i))
            if i == 1 or i % 10 == 0 or i == n:
                rss.append((i, rss_of_pod(pod)))
                print(f"  warm message {i}: reply in status {turns[-1].total * 1000:.0f} ms after the patch",
                      flush=True)
        status = http.get(f"{FLOWS}/{WARM}").raise_for_status().json()["status"]
        ledger = stub.ledger()[ledger_mark:]
        added = sorted({o["metadata"]["name"] for _, kind, o in pods.events
                        if kind == "ADDED" and o["metadata"].get("labels", {}).get(c.LABEL_FLOW) == WARM})
        return WarmResult(opened=opened - applied, turns=turns, pods=added, calls=len(ledger),
                          usage_matches=Usage.model_validate(status["usage"]) == ledger_usage(ledger), rss=rss)
    finally:
        flows.stop()
        pods.stop()
        http.close()


def warm_report(res: WarmResult, cold: Result | None) -> None:
    lat = [t.total for t in res.turns]
    n = len(lat)
    print(f"\nwarm conversation: {n} messages answered by the pod that opened the session (keepWarmSeconds=600)")
    print(f"patch returned -> reply in status: p50 {statistics.median(lat) * 1000:.0f} ms, "
          f"p99 {rank(lat, 99) * 1000:.0f} ms (nearest rank of {n}), min {min(lat) * 1000:.0f} ms, "
          f"max {max(lat) * 1000:.0f} ms")
    if cold is not None and cold.turns:
        cold_p50 = statistics.median([t.total for t in cold.turns])
        print(f"cold turn p50 in the same run {cold_p50:.2f} s: "
              f"warm is {cold_p50 / statistics.median(lat):.0f}x faster")
    t = res.turns
    print("where a warm turn's time goes (median):")
    parts: list[tuple[str, list[float | None]]] = [
        ("patch -> message accepted (status.conversation.pending)", [x.accepted for x in t]),
        ("patch -> first model call received (long poll answered, handle_turn started)", [x.first_call for x in t]),
        ("first call received -> last call answered (router, chat)", [x.last_answer - x.first_call for x in t]),
        ("last call answered -> reply in status (state saved, warm report, fold, status write)",
         [x.total - x.last_answer for x in t]),
    ]
    for what, seconds in parts:
        print(f"  {what}: {median(seconds) * 1000:.0f} ms")
    print("resident memory of the warm pod's process: " + ", ".join(
        f"{k} msgs {v / 2**20:.0f} MiB" if v is not None else f"{k} msgs ?" for k, v in res.rss))
    one = "OK" if len(res.pods) == 1 else "MISMATCH"
    print(f"runner pods created for the Flow: {len(res.pods)} (expected 1): {one}")
    print(f"status.usage equals the stub ledger ({res.calls} calls): {'yes' if res.usage_matches else 'NO'}")


# --- figures ---


def rank(values: list[float], p: float) -> float:
    """Nearest-rank percentile: the smallest value with at least p% of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def median(values: list[float | None]) -> float:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else math.nan


def report(res: Result, n: int) -> None:
    lat = [t.total for t in res.turns]
    p90_note = f"nearest rank: with N={n} that is the {math.ceil(0.9 * n)}th of {n}" + (
        ", the max" if math.ceil(0.9 * n) == n else "")
    print(f"\nconversation on the real node, {n} messages one after another, each reply awaited with a watch "
          "on the Flow (events stamped on arrival, no polling)")
    print(f"session opened (Flow created -> AwaitingMessage, 1 cold runner pod): {res.opened:.2f} s")
    print(f"patch returned -> reply in status, {n} turns: p50 {statistics.median(lat):.2f} s, "
          f"p90 {rank(lat, 90):.2f} s ({p90_note}; p99 would be the max too), "
          f"min {min(lat):.2f} s, max {max(lat):.2f} s, mean {statistics.mean(lat):.2f} s")
    floors = list(zip(*res.floors, strict=True)) if res.floors else []
    if floors:
        cum = [sum(map(statistics.median, floors[: k + 1])) for k in range(len(floors))]
        print(f"floors, {len(res.floors)} pods shaped like runner pods in the same run (median of each step; "
              "cumulative from pod created):")
        for step, values, total in zip(FLOOR_STEPS, floors, cum, strict=True):
            print(f"  {step}: {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f}); "
                  f"{total:.2f} s")
        import_floor = cum[1]
        print(f"turn p50 / crewAI import floor (pod created -> import done, {import_floor:.2f} s): "
              f"{statistics.median(lat) / import_floor:.2f}x; turn p50 / pod start floor ({cum[0]:.2f} s): "
              f"{statistics.median(lat) / cum[0]:.2f}x; turn p50 / session-opened floor ({cum[3]:.2f} s): "
              f"{statistics.median(lat) / cum[3]:.2f}x")
    t = res.turns
    segments: list[tuple[str, list[float | None]]] = [
        ("patch -> message accepted (status.conversation.pending)", [x.accepted for x in t]),
        ("patch -> runner pod created", [x.created for x in t]),
        ("pod created -> container running, as the kubelet reports it",
         [x.running - x.created if x.running is not None and x.created is not None else None for x in t]),
        ("pod created -> first model call received (start, imports, Flow, state read)",
         [x.first_call - x.created if x.created is not None else None for x in t]),
        (f"first call received -> last call answered ({median([float(x.calls) for x in t]):.0f} calls a turn: "
         "router, chat; crewAI between them)", [x.last_answer - x.first_call for x in t]),
        ("last call answered -> container terminated, as reported (state save, report, exit)",
         [x.terminated - x.last_answer if x.terminated is not None else None for x in t]),
        ("last call answered -> reply in status", [x.total - x.last_answer for x in t]),
    ]
    print("where a turn's time goes (median over the turns):")
    for what, seconds in segments:
        print(f"  {what}: {median(seconds):.3f} s")
    print("per turn, seconds after the patch returned: accepted / pod created / running / 1st call / "
          "last answer / terminated / reply in status")
    for i, x in enumerate(t, 1):
        cols = [x.accepted, x.created, x.running, x.first_call, x.last_answer, x.terminated, x.total]
        print(f"  {i}: " + " / ".join("-" if v is None else f"{v:.2f}" for v in cols))
    count, total = res.operator_turns
    if count:
        print(f"operator's flowkube_conversation_turn_seconds (accepted -> answered, sentAt to the second): "
              f"{count:.0f} turns, mean {total / count:.2f} s")
    print(f"runner pods created for the Flow: {len(res.pods)} (expected N + 1 = {n + 1}): "
          f"{'OK' if len(res.pods) == n + 1 else 'MISMATCH'}; runs: {res.triggers.count('kickoff')} kickoff, "
          f"{res.triggers.count('turn')} turn")
    print(f"status.usage equals the stub ledger ({res.calls} calls, {res.tokens} tokens; floor pods made "
          f"{res.floor_calls}): {'yes' if res.usage_matches else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=8, help="messages sent, one after another (default 8)")
    parser.add_argument("--floors", type=int, default=3, help="floor pods, spread between turns (default 3)")
    parser.add_argument("--warm-messages", type=int, default=50,
                        help="messages to a second, warm conversation after the cold one (default 50; 0: none)")
    args = parser.parse_args()
    with real_stack("conv", rules(max(args.messages, args.warm_messages)), NS) as (cluster, stub, op):
        res = conversation_run(cluster, stub, op, args.messages, args.floors)
        warm = warm_run(cluster, stub, args.warm_messages) if args.warm_messages else None
    report(res, args.messages)
    if warm is not None:
        warm_report(warm, res)
    if len(res.pods) != args.messages + 1 or not res.usage_matches or (
            warm is not None and (len(warm.pods) != 1 or not warm.usage_matches)):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
