"""Pricing each model call in the runner (issue 14): the genai-prices table, overrides, unpriced
models, the money budget, and the overrides' way from the operator's setting to the runner."""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from genai_prices import Usage as CallUsage
from genai_prices import calc_price
from pydantic import ValidationError

from flowkube_api import constants as c
from flowkube_api.base import money_text
from flowkube_api.models import Budget
from flowkube_api.prices import ModelPrice, parse_prices, prices_from_json
from flowkube_devstack.stubmodel import StubModel, ledger_cost, ledger_usage
from flowkube_runner.config import ConfigError, RunnerConfig
from flowkube_runner.engine.pricing import CallTokens, Pricer
from tests.unit.runner.test_runner_flows import ARTICLE_FLOW, Harness, failed, succeeded

AT = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)
LLAMA = {"prompt": "0.20", "completion": "0.60", "cachedPrompt": "0.05", "cacheCreation": "0.25"}
M = Decimal(1_000_000)


def table(model: str, tokens: CallTokens) -> Decimal:
    """genai-prices itself, for the same tokens (genai's input_tokens include cached reads/writes)."""
    usage = CallUsage(input_tokens=tokens.prompt, output_tokens=tokens.completion,
                      cache_read_tokens=tokens.cached_prompt, cache_write_tokens=tokens.cache_creation)
    return calc_price(usage, model, genai_request_timestamp=AT).total_price


# ------------------------------------------------------------------------------------- the Pricer


def test_a_known_model_is_priced_from_the_table() -> None:
    tokens = CallTokens(prompt=1200, completion=345)
    price = Pricer().price("gpt-4o-mini", tokens, AT)
    assert price is not None and price.source == "genai-prices openai/gpt-4o-mini"
    assert price.cost == table("gpt-4o-mini", tokens) > 0
    # A provider-qualified name (litellm's, or the one a crewAI LLM was given) is the same model.
    assert Pricer().price("openai/gpt-4o-mini", tokens, AT) == price


def rates(model: str) -> dict[str, Decimal]:
    """The table's flat per-million prices of a model (input, output, cache_read, cache_write)."""
    prices = calc_price(CallUsage(input_tokens=1), model, genai_request_timestamp=AT).model_price
    found = {}
    for kind in ("input", "output", "cache_read", "cache_write"):
        value = getattr(prices, f"{kind}_mtok")
        if value is not None:
            assert isinstance(value, Decimal), f"{model} {kind}: {value!r} (tiered)"
            found[kind] = value
    return found


def cost_of(model: str, tokens: CallTokens) -> Decimal:
    price = Pricer().price(model, tokens, AT)
    assert price is not None
    return price.cost


def test_cached_prompt_and_cache_creation_tokens_are_priced_at_their_own_rates() -> None:
    # gpt-4o-mini: cache reads have a price of their own (half the prompt price).
    r = rates("gpt-4o-mini")
    assert r["cache_read"] < r["input"]
    cached = CallTokens(prompt=1000, completion=100, cached_prompt=400)
    assert cost_of("gpt-4o-mini", cached) == (600 * r["input"] + 400 * r["cache_read"] + 100 * r["output"]) / M
    assert cost_of("gpt-4o-mini", cached) < cost_of("gpt-4o-mini", CallTokens(prompt=1000, completion=100))
    assert cost_of("gpt-4o-mini", cached) == table("gpt-4o-mini", cached)

    # Anthropic prices cache writes above the prompt price and cache reads below it.
    model = "claude-3-5-haiku-latest"
    tokens = CallTokens(prompt=2000, completion=50, cached_prompt=1000, cache_creation=500)
    r = rates(model)
    assert r["cache_read"] < r["input"] < r["cache_write"]
    assert cost_of(model, tokens) == (500 * r["input"] + 1000 * r["cache_read"] + 500 * r["cache_write"]
                                      + 50 * r["output"]) / M == table(model, tokens)


def test_an_override_wins_over_the_table_and_prices_a_model_the_table_lacks() -> None:
    pricer = Pricer(parse_prices({"my-llama": LLAMA, "gpt-4o-mini": {"prompt": "1", "completion": "2"}}))
    tokens = CallTokens(prompt=1000, completion=500, cached_prompt=200, cache_creation=100)
    llama = pricer.price("my-llama", tokens, AT)
    assert llama is not None and llama.source == "override"
    # 700 plain prompt tokens at 0.20, 200 cached at 0.05, 100 cache writes at 0.25, 500 completion at 0.60
    assert llama.cost == Decimal("0.000475")
    mini = pricer.price("gpt-4o-mini", tokens, AT)
    assert mini is not None and mini.source == "override"
    assert mini.cost == (1000 * 1 + 500 * 2) / M  # cached and cache creation fall back to the prompt price
    assert mini.cost != table("gpt-4o-mini", tokens)


def test_an_unknown_model_is_unpriced_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    pricer = Pricer()
    with caplog.at_level(logging.WARNING, logger="flowkube_runner"):
        for model in ("my-llama", "my-llama", "ollama/llama3", "stub"):
            assert pricer.price(model, CallTokens(prompt=10, completion=5), AT) is None
    warned = [r.getMessage() for r in caplog.records if "unpriced" in r.getMessage()]
    assert len(warned) == 3 and "'my-llama'" in warned[0] and "FLOWKUBE_RUNNER_PRICES" in warned[0]


def test_pricing_a_call_takes_well_under_a_millisecond() -> None:
    pricer = Pricer()
    pricer.load()
    tokens = CallTokens(prompt=1000, completion=200, cached_prompt=100)
    pricer.price("gpt-4o-mini", tokens)
    n = 500
    start = time.perf_counter()
    for _ in range(n):
        pricer.price("gpt-4o-mini", tokens)
    per_call = (time.perf_counter() - start) / n
    print(f"pricing one call: {per_call * 1e3:.3f} ms")
    assert per_call < 0.005  # the target is < 1 ms; a shared 2-core machine gets some slack


# ------------------------------------------------------------------------------- the UsageRecorder


def event(model: str, prompt: int, completion: int, cached: int = 0) -> Any:
    """What crewAI's LLMCallCompletedEvent carries that the recorder reads."""
    return SimpleNamespace(model=model, timestamp=AT, usage={
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached}})


def test_the_recorder_reports_cost_and_unpriced_tokens_per_model_and_in_total() -> None:
    from flowkube_runner.engine.usage import UsageRecorder

    recorder = UsageRecorder(pricer=Pricer(parse_prices({"my-llama": LLAMA})))
    for e in (event("gpt-4o-mini", 1000, 100, cached=200), event("gpt-4o-mini", 300, 30),
              event("my-llama", 1000, 500), event("ollama/llama3", 40, 10), event("ollama/llama3", 7, 3)):
        recorder._on_llm_call_completed(None, e)
    usage = recorder.recorded()
    mini = table("gpt-4o-mini", CallTokens(1000, 100, 200)) + table("gpt-4o-mini", CallTokens(300, 30))
    assert usage.by_model["gpt-4o-mini"].cost == mini and usage.by_model["gpt-4o-mini"].unpriced_tokens == 0
    assert usage.by_model["my-llama"].cost == Decimal("0.0005")  # 1000 * 0.20 + 500 * 0.60, per million
    unknown = usage.by_model["ollama/llama3"]
    assert unknown.cost == 0 and (unknown.unpriced_tokens, unknown.total_tokens) == (60, 60)
    assert usage.cost == mini + Decimal("0.0005") and usage.unpriced_tokens == 60
    assert usage.currency == "USD" and usage.dump()["cost"] == money_text(usage.cost)


def test_max_cost_stops_before_the_next_call_once_reached() -> None:
    from crewai.hooks.dispatch import HookAborted

    from flowkube_runner.engine.usage import UsageRecorder

    call = event("my-llama", 1000, 500)  # USD 0.0005 at the override's prices
    recorder = UsageRecorder(budget=Budget(max_cost=Decimal("0.001")), pricer=Pricer(parse_prices({"my-llama": LLAMA})))
    with recorder.recording():
        recorder._check_before_call(None)
        recorder._on_llm_call_completed(None, call)
        recorder._check_after(None)
        recorder._check_before_call(None)  # USD 0.0005 of 0.001: the next call may start
        recorder._on_llm_call_completed(None, call)
        recorder._check_after(None)  # exactly the budget: not crossed...
        assert not recorder.exceeded
        with pytest.raises(HookAborted) as refused:  # ...but reached: no further call starts
            recorder._check_before_call(None)
    assert recorder.exceeded
    assert "USD 0.001 spent of budget.maxCost=0.001" in str(refused.value)

    # Crossed by a call already in flight: it is counted, and the run ends there.
    crossed = UsageRecorder(budget=Budget(max_cost=Decimal("0.0007")), prior_cost=Decimal("0.0003"),
                            pricer=Pricer(parse_prices({"my-llama": LLAMA})))
    with crossed.recording():
        crossed._on_llm_call_completed(None, call)
        with pytest.raises(HookAborted):
            crossed._check_after(None)
    assert crossed.usage().cost == Decimal("0.0005")
    assert "USD 0.0008 spent of budget.maxCost=0.0007" in crossed.budget_message()
    assert "USD 0.0003 in earlier runs" in crossed.budget_message()

    spent = UsageRecorder(budget=Budget(max_cost=Decimal("0.01")), prior_cost=Decimal("0.01"))
    assert spent.budget_already_spent() and "USD 0.01 spent of budget.maxCost=0.01" in spent.budget_message()
    short = UsageRecorder(budget=Budget(max_cost=Decimal("0.01")), prior_cost=Decimal("0.0099"))
    assert not short.budget_already_spent()


def test_max_total_tokens_exactly_reached_lets_the_run_finish_but_no_call_start() -> None:
    """The one budget rule (Budget.exceeded_by) at its boundary: a call that lands exactly on the
    budget does not end the run; the next call is refused; the message names the figure as the
    operator's does, and never claims more than was used."""
    from crewai.hooks.dispatch import HookAborted

    from flowkube_runner.engine.usage import UsageRecorder

    recorder = UsageRecorder(budget=Budget(max_total_tokens=150), prior_total_tokens=50)
    with recorder.recording():
        recorder._check_before_call(None)
        recorder._on_llm_call_completed(None, event("ollama/llama3", 60, 40))  # 50 + 100: exactly the budget
        recorder._check_after(None)  # not crossed: the run goes on, and may finish without another call
        assert not recorder.exceeded
        with pytest.raises(HookAborted) as refused:  # reached: no further call starts
            recorder._check_before_call(None)
    assert recorder.exceeded
    assert str(refused.value) == ("token budget exceeded: 150 tokens used of budget.maxTotalTokens=150 "
                                  "(50 in earlier runs + 100 in this run)")

    crossed = UsageRecorder(budget=Budget(max_total_tokens=149), prior_total_tokens=50)
    with crossed.recording():
        crossed._on_llm_call_completed(None, event("ollama/llama3", 60, 40))
        with pytest.raises(HookAborted):
            crossed._check_after(None)
    assert "150 tokens used of budget.maxTotalTokens=149" in crossed.budget_message()

    spent = UsageRecorder(budget=Budget(max_total_tokens=150), prior_total_tokens=150)
    assert spent.budget_already_spent()
    assert spent.budget_message() == ("token budget exceeded: 150 tokens used of budget.maxTotalTokens=150 "
                                      "(150 in earlier runs + 0 in this run)")
    assert not UsageRecorder(budget=Budget(max_total_tokens=150), prior_total_tokens=149).budget_already_spent()


# ---------------------------------------------------------------------------- configuration, both sides


def runner_env(**extra: str) -> dict[str, str]:
    return {c.ENV_FLOW_NAME: "demo", c.ENV_POD_NAME: "demo-1", c.ENV_TRIGGER: "kickoff",
            c.ENV_SPEC: json.dumps({"flowRef": "m:C", "budget": {"maxCost": "2.50"}}), **extra}


def test_the_runner_reads_max_cost_prior_cost_and_prices() -> None:
    config = RunnerConfig.from_env(runner_env(**{c.ENV_PRIOR_COST: "0.0123", c.ENV_PRICES: json.dumps({"m": LLAMA})}))
    assert config.spec.budget == Budget(max_cost=Decimal("2.50"))
    assert config.prior_cost == Decimal("0.0123")
    assert config.prices == {"m": ModelPrice(prompt=Decimal("0.20"), completion=Decimal("0.60"),
                                             cached_prompt=Decimal("0.05"), cache_creation=Decimal("0.25"))}
    bare = RunnerConfig.from_env(runner_env())
    assert bare.prior_cost == 0 and bare.prices == {}


@pytest.mark.parametrize(
    ("prices", "expected"),
    [
        ({"m": {"prompt": "-1", "completion": "1"}}, "model 'm': prompt: an amount of money is a decimal number >= 0"),
        ({"m": {"prompt": "cheap", "completion": "1"}}, "model 'm': prompt: Input should be a valid decimal"),
        ({"m": {"prompt": "1", "completion": "1", "input": "1"}}, "model 'm': input: unknown field"),
        ({"m": {"completion": "1"}}, "model 'm': prompt: required"),
        ({"m": "1"}, "model 'm': expected an object"),
        ([], "expected a JSON object"),
    ],
)
def test_a_malformed_override_names_the_model_and_the_field(prices: Any, expected: str) -> None:
    with pytest.raises(ValueError) as error:
        prices_from_json(json.dumps(prices))
    assert expected in str(error.value)
    with pytest.raises(ConfigError) as config_error:
        RunnerConfig.from_env(runner_env(**{c.ENV_PRICES: json.dumps(prices)}))
    assert config_error.value.reason == c.Reason.INTERNAL_ERROR and c.ENV_PRICES in str(config_error.value)
    with pytest.raises(ConfigError):
        RunnerConfig.from_env(runner_env(**{c.ENV_PRIOR_COST: "lots"}))


def test_the_operator_refuses_a_bad_price_at_start_up_and_hands_good_ones_to_every_runner(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from flowkube_operator.settings import Settings
    from tests.unit.operator.pods import pod_of as runner_pod

    monkeypatch.setenv("FLOWKUBE_RUNNER_PRICES", json.dumps({"my-llama": {"prompt": "0.2", "completion": "NaN"}}))
    with pytest.raises(ValidationError) as error:
        Settings()
    assert "runner_prices" in str(error.value) and "model 'my-llama': completion" in str(error.value)

    monkeypatch.setenv("FLOWKUBE_RUNNER_PRICES", json.dumps({"my-llama": LLAMA}))
    settings = Settings()
    assert settings.runner_prices == {"my-llama": LLAMA}
    # The Flow tries to price its own calls, by spec.env and through envFrom: the operator's value wins
    # (it is set even when there are no overrides, since a container's env beats its envFrom).
    flow = {"metadata": {"name": "f", "namespace": "ns", "uid": "u1"},
            "spec": {"flowRef": "m:C", "env": [{"name": c.ENV_PRICES, "value": "{}"}],
                     "envFrom": [{"configMapRef": {"name": "cheap-prices"}}]}}
    monkeypatch.delenv("FLOWKUBE_RUNNER_PRICES")
    for s, expected in ((settings, {"my-llama": LLAMA}), (Settings(), {})):
        pod = runner_pod(flow, index=0, trigger=c.Trigger.KICKOFF, settings=s)
        env = pod["spec"]["containers"][0]["env"]
        (prices,) = [e for e in env if e["name"] == c.ENV_PRICES]
        assert json.loads(prices["value"]) == expected
        config = RunnerConfig.from_env({**runner_env(), **{e["name"]: e["value"] for e in env if "value" in e}})
        assert config.prices == parse_prices(expected)


# ----------------------------------------------------------------- a real runner against the stub model


@pytest.mark.slow
def test_a_real_run_is_priced_per_call_and_max_cost_stops_it_before_the_next_call(
        tmp_path: Path, stub: StubModel) -> None:
    """ArticleFlow makes two calls. Unbudgeted, its cost is the ledger's, priced by the table; with
    maxCost at exactly the first call's cost, the second call never starts."""
    harness = Harness(tmp_path, stub)
    report = succeeded(harness.run(c.Trigger.KICKOFF, {"flowRef": ARTICLE_FLOW, "inputs": {"topic": "cats"}}))
    ledger = stub.ledger()
    assert len(ledger) == 2 and report.usage == ledger_usage(ledger)
    costs = [cost for e in ledger if (cost := ledger_cost(e)) is not None]
    assert len(costs) == 2 and all(cost > 0 for cost in costs)
    assert report.usage.cost == report.usage.by_model["gpt-4o-mini"].cost == sum(costs, Decimal(0))
    assert report.usage.unpriced_tokens == 0

    first = costs[0]
    spec = {"flowRef": ARTICLE_FLOW, "inputs": {"topic": "cats"}, "budget": {"maxCost": money_text(first)}}
    stopped = failed(harness.run(c.Trigger.KICKOFF, spec), c.Reason.BUDGET_EXCEEDED, c.EXIT_PERMANENT)
    again = stub.ledger()[2:]
    assert len(again) == 1, "the call that reached maxCost is the last one"
    assert stopped.usage == ledger_usage(again) and stopped.usage.cost == first
    assert f"USD {money_text(first)} spent of budget.maxCost={money_text(first)}" in stopped.message


@pytest.mark.slow
def test_a_real_run_prices_an_overridden_model_and_counts_an_unknown_one_as_unpriced(
        tmp_path: Path, stub: StubModel) -> None:
    """A self-hosted model (vLLM's OpenAI-compatible API, played by the stub) that no table knows."""
    harness = Harness(tmp_path, stub)
    llm = {"FLOWKUBE_EXAMPLE_MODEL": "hosted_vllm/my-llama", "VLLM_BASE_URL": stub.base_url}
    priced = succeeded(harness.run(c.Trigger.KICKOFF, {"flowRef": ARTICLE_FLOW},
                                   extra_env={**llm, c.ENV_PRICES: json.dumps({"my-llama": LLAMA})}))
    unpriced = succeeded(harness.run(c.Trigger.KICKOFF, {"flowRef": ARTICLE_FLOW}, extra_env=llm))
    ledger = stub.ledger()
    assert {e["model"] for e in ledger} == {"my-llama"}
    assert set(priced.usage.by_model) == set(unpriced.usage.by_model) == {"my-llama"}
    llama = ModelPrice.model_validate(LLAMA)
    expected = sum((llama.cost(prompt_tokens=e["usage"]["prompt_tokens"],
                               completion_tokens=e["usage"]["completion_tokens"],
                               cached_prompt_tokens=e["usage"]["prompt_tokens_details"]["cached_tokens"])
                    for e in ledger[:2]), Decimal(0))
    assert priced.usage.cost == expected > 0 and priced.usage.unpriced_tokens == 0
    assert unpriced.usage.cost == 0 and unpriced.usage.unpriced_tokens == unpriced.usage.total_tokens > 0
    assert unpriced.usage == ledger_usage(ledger[2:])
    assert sum("is unpriced" in line for line in harness.stderr(f"{harness.flow}-2").splitlines()) == 1


def test_charges_are_the_usage_by_quarter_hour_and_model_and_stay_bounded() -> None:
    import datetime as dt

    from flowkube_api.report import CHARGES_LIMIT, matching_charges
    from flowkube_runner.engine.usage import UsageRecorder

    recorder = UsageRecorder(pricer=Pricer(parse_prices({"my-llama": LLAMA})))
    start = dt.datetime(2026, 11, 28, 23, 50, tzinfo=dt.UTC)
    for minutes, model in ((0, "my-llama"), (5, "my-llama"), (12, "gpt-4o-mini"), (12, "my-llama")):
        call = event(model, 1000, 500)
        call.timestamp = start + dt.timedelta(minutes=minutes)
        recorder._on_llm_call_completed(None, call)
    charges = recorder.charges() or []
    assert [(c.at.isoformat(), c.model, c.total_tokens) for c in charges] == [
        ("2026-11-28T23:45:00+00:00", "my-llama", 3000),  # 23:50 and 23:55
        ("2026-11-29T00:00:00+00:00", "gpt-4o-mini", 1500), ("2026-11-29T00:00:00+00:00", "my-llama", 1500)]
    assert matching_charges(recorder.recorded(), charges) == charges, "they add up to the usage, cost included"
    # A run of days: past the bound, a model's oldest quarter hours merge into the next; nothing is lost.
    long = UsageRecorder()
    for q in range(CHARGES_LIMIT + 50):
        call = event("ollama/llama3", 2, 1)
        call.timestamp = start + dt.timedelta(minutes=15 * q)
        long._on_llm_call_completed(None, call)
    bounded = long.charges() or []
    assert len(bounded) == CHARGES_LIMIT and sum(c.total_tokens for c in bounded) == 3 * (CHARGES_LIMIT + 50)
    assert bounded[-1].at == start + dt.timedelta(minutes=15 * (CHARGES_LIMIT + 49)) - dt.timedelta(minutes=5)
