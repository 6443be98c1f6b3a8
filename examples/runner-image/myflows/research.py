"""A two-step research flow: outline a topic, then summarise the outline.

Run by flowkube as `flowRef: "myflows.research:ResearchFlow"`; `spec.inputs` fill the state.
The model comes from the MODEL env var (any LiteLLM model id), its API key from the Flow's env.
"""

from __future__ import annotations

import os

from crewai import LLM
from crewai.flow.flow import Flow, listen, start
from pydantic import BaseModel


class ResearchState(BaseModel):
    topic: str = "Kubernetes operators"
    outline: str = ""
    summary: str = ""


def _llm() -> LLM:
    return LLM(model=os.environ.get("MODEL", "openai/gpt-4o-mini"))


class ResearchFlow(Flow[ResearchState]):
    @start()
    def outline(self) -> str:
        self.state.outline = str(_llm().call(f"List three key points about {self.state.topic}."))
        return self.state.outline

    @listen(outline)
    def summarize(self, outline: str) -> str:
        self.state.summary = str(_llm().call(f"Summarise in two sentences:\n{outline}"))
        return self.state.summary
