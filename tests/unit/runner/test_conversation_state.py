"""How long a conversation fits in its state: the transcript is saved whole, gzip-compressed, in one
ConfigMap value (``STATE_LIMIT``); at the limit a turn is refused, never a transcript truncated."""

from __future__ import annotations

import random
from typing import Any

import pytest

from flowkube_api.constants import STATE_LIMIT
from flowkube_runner.engine.state import StateDocument
from flowkube_runner.store import StateTooLarge


def words(rng: random.Random, vocabulary: list[str], size: int) -> str:
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < size:
        out.append(rng.choice(vocabulary))
    return " ".join(out)[:size]


def session(turns: int, chars: int, seed: int = 7) -> StateDocument:
    """crewAI's ConversationState as the runner saves it: each message with every field crewAI dumps."""
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 11)))
                  for _ in range(5000)]
    empty: dict[str, Any] = {"name": None, "tool_call_id": None, "tool_calls": None, "files": None, "metadata": {}}
    messages = []
    for _ in range(turns):
        messages.append({"role": "user", "content": words(rng, vocabulary, chars), **empty})
        messages.append({"role": "assistant", "content": words(rng, vocabulary, chars), **empty})
    state: dict[str, Any] = {"id": "s1", "messages": messages, "current_user_message": None, "last_user_message": "x",
             "last_intent": "converse", "ended": False, "events": [], "agent_threads": {}, "session_ready": True}
    return StateDocument(flow_id="s1", state=state, conversation_turn=turns)


def test_a_thousand_turns_of_500_characters_each_way_fit_with_room_to_spare() -> None:
    size = len(session(1000, 500).encode())
    print(f"1000 turns, 500-character messages both ways (1,000,000 characters): {size} bytes gzip, "
          f"{size / STATE_LIMIT:.0%} of the {STATE_LIMIT}-byte limit")
    assert size < STATE_LIMIT * 0.8


def test_past_the_limit_the_state_is_refused_whole_with_the_sizes_named() -> None:
    with pytest.raises(StateTooLarge) as refused:
        session(3000, 500).encode()
    assert refused.value.size > STATE_LIMIT and str(STATE_LIMIT) in str(refused.value)
