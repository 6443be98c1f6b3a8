"""Spend quotas at the model call (issue 41), with crewAI as the engine and the stub model at the far
end: a desk backed by the operator's quota book (the state API's HTTP hop is the only thing left
out) reserves each call's worst case before it is sent and settles it after. A call that does not fit
is not sent, and the run ends QuotaExhausted naming the quota; what was used equals the stub's ledger."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from flowkube_api.report import Charge
from flowkube_api.windows import WindowSpec
from flowkube_devstack.stubmodel import Rules, StubModel, ledger_usage
from flowkube_operator.quotas.book import Limit, QuotaBook, Refusal, Spend
from tests.definitions import crew_definition, crewai_in_process, part_rules, parts_of

Q = "FlowQuota team-a/tokens"
WRITER = {"role": "Writer", "goal": "Write well", "backstory": "A careful writer.", "settings": {"llm": "gpt-4o-mini"}}


class BookDesk:
    """The runner's quota desk, answered by the operator's book in this process. Like the state API
    store, it asks over HTTP (a POST made inside the model call, which the gate must let through
    ungated: gating it recursed until the real runner's first call was refused)."""

    def __init__(self, book: QuotaBook, pod: str, url: str = "") -> None:
        self.book, self.pod, self.url = book, pod, url
        self.worst: list[int] = []
        self.holds: list[list[int]] = []  # the reservation ids of each reminder

    def _ask(self) -> None:
        if self.url:
            with httpx.Client() as client:
                assert client.post(self.url + "/desk", json={}).status_code == 404  # the stub's answer

    def reserve(self, model: str, tokens: int, cost: Decimal | None, *, charges: list[Charge] | None = None,
                held: list[Any] | None = None) -> int:
        from flowkube_runner.store import QuotaRefused

        self._ask()
        self.worst.append(tokens)
        r = self.book.reserve([Q], self.pod, model, Spend(tokens, cost or Decimal(0)), dt.datetime.now(dt.UTC),
                              priced=cost is not None)
        if isinstance(r, Refusal):
            raise QuotaRefused(r.message())
        return r.id

    def settle(self, reservation: int, charges: list[Charge] | None, *, held: list[Any] | None = None) -> None:
        self._ask()
        self.book.settle(reservation, self.pod, [(ch.at, ch.model, Spend(ch.total_tokens, ch.cost))
                                                      for ch in charges or []])

    def hold(self, charges: list[Charge] | None, held: list[Any]) -> None:
        self._ask()
        self.holds.append([h[0] for h in held])


@pytest.fixture(scope="module")
def stub() -> Iterator[StubModel]:
    with StubModel(Rules.from_json({"default": "A plain reply.", "rules": part_rules(4)})) as model, \
            crewai_in_process(model.base_url):
        yield model


def run(stub: StubModel, root: Path, limit: int) -> tuple[BookDesk, QuotaBook, str | None, list[str]]:
    """A four-task crew under a lifetime limit of ``limit`` tokens: (desk, book, the refusal, parts called)."""
    from flowkube_runner.engine.session import FlowSession
    from flowkube_runner.engine.usage import UsageRecorder
    from flowkube_runner.store import FileStore

    book = QuotaBook()
    book.set_limits(Q, [Limit(Q, "all", WindowSpec("Lifetime"), max_tokens=limit)])
    desk = BookDesk(book, "demo-0")
    mark = len(stub.ledger())
    recorder = UsageRecorder(quota=desk)
    session = FlowSession(FileStore(root), "demo-0", None)
    session.load(definition=crew_definition(WRITER, 4))
    # The refused call ends the flow with crewAI's exception; the gate says why (quota.refused).
    with recorder.recording(), contextlib.suppress(Exception):
        session.kickoff({"topic": "quotas"})
    assert recorder.quota is not None
    return desk, book, recorder.quota.refused, parts_of(stub.ledger()[mark:])


def test_a_call_whose_worst_case_does_not_fit_is_not_sent_and_the_book_holds_what_was_used(
        stub: StubModel, tmp_path: Path) -> None:
    # First with room for all: each call's worst case, and what each used.
    desk, book, refused, parts = run(stub, tmp_path / "free", 10**9)
    assert refused is None and parts == ["PART1", "PART2", "PART3", "PART4"]
    ledger = stub.ledger()[-4:]
    used = [e["usage"]["total_tokens"] for e in ledger]
    assert book.used((Q, "all"), dt.datetime.now(dt.UTC)).tokens == sum(used) == ledger_usage(ledger).total_tokens
    assert book.reserved((Q, "all")) == Spend()
    assert all(w > u for w, u in zip(desk.worst, used, strict=True)), "a worst case bounds what the call used"
    # Then with a limit one token short of what the third call may need after the first two.
    limit = used[0] + used[1] + desk.worst[2] - 1
    mark = len(stub.ledger())
    desk, book, refused, parts = run(stub, tmp_path / "tight", limit)
    assert parts == ["PART1", "PART2"], "the third call is not sent"
    assert refused is not None and refused.startswith(f"{Q}: limit all (maxTotalTokens={limit}, lifetime)")
    assert book.used((Q, "all"), dt.datetime.now(dt.UTC)).tokens == ledger_usage(stub.ledger()[mark:]).total_tokens
    assert book.used((Q, "all"), dt.datetime.now(dt.UTC)).tokens <= limit and book.reserved((Q, "all")) == Spend()


def test_a_desk_that_cannot_be_reached_stops_the_call_instead_of_letting_it_go_unreserved(
        stub: StubModel, tmp_path: Path) -> None:
    from flowkube_runner.engine.session import FlowSession
    from flowkube_runner.engine.usage import UsageRecorder
    from flowkube_runner.store import FileStore, StoreError

    class Down:
        def reserve(self, model: str, tokens: int, cost: Decimal | None, **_: Any) -> int:
            raise StoreError("POST quota reserve: state API unreachable")

        def settle(self, reservation: int, charges: list[Charge] | None, **_: Any) -> None:
            raise AssertionError("nothing was reserved")

        def hold(self, charges: list[Charge] | None, held: list[Any]) -> None:
            raise AssertionError("nothing was reserved")

    mark = len(stub.ledger())
    recorder = UsageRecorder(quota=Down())
    session = FlowSession(FileStore(tmp_path), "demo-0", None)
    session.load(definition=crew_definition(WRITER, 4))
    with recorder.recording(), contextlib.suppress(Exception):
        session.kickoff({"topic": "quotas"})
    assert parts_of(stub.ledger()[mark:]) == [], "crewAI sends a call whose hook raised anything else"
    assert recorder.quota is not None and "could not reserve the call" in (recorder.quota.refused or "")


def test_direct_and_async_calls_are_reserved_and_settled_and_a_refusal_is_not_retried(stub: StubModel) -> None:
    """crewAI's post-call hooks do not run for every call (not for async ones): the reservation is made
    and settled at the HTTP request, so a direct call and an async one leave nothing reserved and
    their usage in the book; a refused request is answered at once (402, not retried by the SDK) and
    every later call of the run is refused before it starts."""
    import asyncio

    from crewai import LLM

    from flowkube_runner.engine.usage import UsageRecorder

    book = QuotaBook()
    book.set_limits(Q, [Limit(Q, "all", WindowSpec("Lifetime"), max_tokens=10**9)])
    desk = BookDesk(book, "direct-0", stub.base_url)
    recorder = UsageRecorder(quota=desk)
    mark = len(stub.ledger())
    llm = LLM(model="gpt-4o-mini", max_tokens=64)
    with recorder.recording():
        assert llm.call("PART1 of a direct call")
        assert asyncio.run(llm.acall("PART2 of an async call"))
    ledger = stub.ledger()[mark:]
    assert parts_of(ledger) == ["PART1", "PART2"] and len(desk.worst) == 2
    assert all(w <= 4096 for w in desk.worst), "max_tokens (64) bounds the answer, not the default"
    now = dt.datetime.now(dt.UTC)
    assert book.used((Q, "all"), now).tokens == ledger_usage(ledger).total_tokens
    assert book.reserved((Q, "all")) == Spend()

    # Now a limit the next call cannot fit: refused once, no retry, and the call after it never starts.
    used = book.used((Q, "all"), now).tokens
    book.set_limits(Q, [Limit(Q, "all", WindowSpec("Lifetime"), max_tokens=used + 10)])
    mark, asked = len(stub.ledger()), len(desk.worst)
    with recorder.recording():
        with pytest.raises(Exception, match="FlowQuota team-a/tokens: limit all"):
            llm.call("PART3 of a refused call")
        with pytest.raises(Exception, match="FlowQuota team-a/tokens"):
            llm.call("PART4 of a call after the refusal")
    assert stub.ledger()[mark:] == [] and len(desk.worst) == asked + 1, "one reservation asked, none retried"
    assert book.reserved((Q, "all")) == Spend()


def test_a_provider_whose_requests_the_gate_cannot_see_is_refused_not_let_through() -> None:
    """crewAI's Bedrock (boto3) and Azure AI Inference (azure-core) providers do not send through httpx:
    under a quota their calls would go unreserved, so the gate refuses them before they start."""
    from types import SimpleNamespace

    from crewai.hooks.dispatch import HookAborted

    from flowkube_runner.engine.pricing import Pricer
    from flowkube_runner.engine.quotagate import QuotaGate

    class Bedrock:
        model = "anthropic.claude-3-haiku"

    Bedrock.__module__ = "crewai.llms.providers.bedrock.completion"
    book = QuotaBook()
    gate = QuotaGate(BookDesk(book, "p-0"), Pricer(), lambda: None)
    with pytest.raises(HookAborted, match="cannot see the requests of Bedrock"):
        gate.before(SimpleNamespace(llm=Bedrock()))
    assert gate.refused is not None and "use a provider that does" in gate.refused


def test_media_a_request_points_at_are_in_its_worst_case_and_a_file_by_reference_is_not_sent() -> None:
    """An image by URL is not in the body's bytes: each adds REMOTE_IMAGE_TOKENS (an inline data: URL's
    bytes are counted already). A file or document by URL or id has no bound the request shows: under a
    quota the request is refused before it is sent, with a message saying why and what to do."""
    import json

    from flowkube_runner.engine.pricing import Pricer
    from flowkube_runner.engine.quotagate import REMOTE_IMAGE_TOKENS, UnboundedRequest, worst_case

    def tokens(body: dict[str, Any]) -> int:
        raw = json.dumps(body).encode()
        return worst_case(raw, "gpt-4o-mini", Pricer())[1] - len(raw) - 64

    def chat(*parts: dict[str, Any]) -> dict[str, Any]:
        return {"model": "gpt-4o-mini", "max_tokens": 64, "messages": [{"role": "user", "content": list(parts)}]}

    text = {"type": "text", "text": "what is in it?"}
    assert tokens(chat(text)) == 0
    assert tokens(chat(text, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})) == 0
    two = [{"type": "image_url", "image_url": {"url": f"https://x.example/{i}.png"}} for i in range(2)]
    assert tokens(chat(text, *two)) == 2 * REMOTE_IMAGE_TOKENS
    responses = {"model": "gpt-4o-mini", "max_output_tokens": 64, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://x.example/a.png"}, {"type": "input_image", "file_id": "f-1"}]}]}
    assert tokens(responses) == 2 * REMOTE_IMAGE_TOKENS
    anthropic = {"model": "claude", "max_tokens": 64, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://x.example/a.png"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}
    assert tokens(anthropic) == REMOTE_IMAGE_TOKENS
    for unbounded in (
            chat({"type": "input_file", "file_url": "https://x.example/report.pdf"}),
            chat({"type": "input_file", "file_id": "file-1"}),
            chat({"type": "document", "source": {"type": "url", "url": "https://x.example/report.pdf"}}),
            {"contents": [{"role": "user", "parts": [{"fileData": {"fileUri": "gs://b/report.pdf"}}]}]}):
        with pytest.raises(UnboundedRequest, match="points at a file by URL or by id"):
            worst_case(json.dumps(unbounded).encode(), "gpt-4o-mini", Pricer())
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(UnboundedRequest, match="nested too deeply"):
        worst_case(deep, "gpt-4o-mini", Pricer())
    wide = json.dumps(chat(*[{"type": "image_url", "image_url": {"url": f"https://x.example/{i}"}}
                             for i in range(3)], *[text] * 200_000)).encode()
    assert worst_case(wide, "gpt-4o-mini", Pricer())[1] == len(wide) + 3 * REMOTE_IMAGE_TOKENS + 64  # none hidden


def test_while_a_call_is_in_flight_the_pod_reminds_the_desk_of_what_it_holds_and_stops_after(
        stub: StubModel) -> None:
    """A call longer than a new leader's recovery must still be reserved there: while it is in flight
    the gate tells the desk every heartbeat which reservations it holds (through the desk's own
    ungated POST), and stops once nothing is held."""
    import threading

    from crewai import LLM

    from flowkube_devstack.cluster import wait_for
    from flowkube_runner.engine.usage import UsageRecorder

    book = QuotaBook()
    book.set_limits(Q, [Limit(Q, "all", WindowSpec("Lifetime"), max_tokens=10**9)])
    desk = BookDesk(book, "long-0", stub.base_url)
    recorder = UsageRecorder(quota=desk, quota_heartbeat=0.05)
    rules = Rules.from_json({"default": "A plain reply.", "rules": [{"contains": "LONG", "hold": True}]})
    before = stub.rules
    stub.set_rules(rules)
    stub.arm_holds()
    answers: list[str] = []
    try:
        with recorder.recording():
            call = threading.Thread(target=lambda: answers.append(
                LLM(model="gpt-4o-mini", max_tokens=64).call("LONG call held at the model")))
            call.start()
            assert stub.wait_held(1, timeout=30), "the call should reach the model"
            assert recorder.quota is not None
            (held,) = recorder.quota._in_flight()
            wait_for(lambda: len(desk.holds) >= 3, 30, "three reminders while the call is in flight")
            assert all(ids == [held[0]] for ids in desk.holds), desk.holds
            stub.release_held()
            call.join(timeout=30)
        assert answers, "the call was answered"
        gate = recorder.quota
        wait_for(lambda: gate._beating is None, 30, "the reminders to stop once nothing is held")
        reminded = len(desk.holds)
        assert book.reserved((Q, "all")) == Spend()
        assert not gate._in_flight() and len(desk.holds) == reminded
    finally:
        stub.release_held()
        stub.set_rules(before)
