"""A conversational class flow: chat by default, a custom ``refund`` route, its own exit commands.

``@ConversationConfig`` makes the class a conversation: flowkube opens a session for it and answers
one message per turn (see docs/api.md, Conversations).
"""

from __future__ import annotations

import os

from crewai.flow import ConversationConfig, ConversationState
from crewai.flow.flow import Flow, listen


@ConversationConfig(llm=os.environ.get("FLOWKUBE_EXAMPLE_MODEL", "gpt-4o-mini"),
                    system_prompt="You are a support agent.")
class SupportFlow(Flow[ConversationState]):  # type: ignore[misc]  # crewAI is untyped for mypy
    exit_commands = ("bye", "exit", "quit")

    @listen("refund")  # type: ignore[untyped-decorator]
    def handle_refund(self) -> str:
        """Start a refund for the customer."""
        return "Refund started"
