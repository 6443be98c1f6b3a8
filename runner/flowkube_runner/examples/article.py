"""A two-step class flow: draft an article, then summarise it. Each step is one model call."""

from __future__ import annotations

import os

from crewai import LLM
from crewai.flow.flow import Flow, listen, start
from pydantic import BaseModel


class ArticleState(BaseModel):
    topic: str = "Kubernetes operators"
    draft: str = ""
    summary: str = ""


def _model() -> LLM:
    return LLM(model=os.environ.get("FLOWKUBE_EXAMPLE_MODEL", "gpt-4o-mini"))


class ArticleFlow(Flow[ArticleState]):  # type: ignore[misc]  # crewAI is untyped for mypy
    @start()  # type: ignore[untyped-decorator]
    def write_draft(self) -> str:
        draft = str(_model().call(f"Write a short draft about {self.state.topic}."))
        self.state.draft = draft
        return draft

    @listen(write_draft)  # type: ignore[untyped-decorator]
    def summarize(self) -> str:
        summary = str(_model().call(f"Summarise in one line: {self.state.draft}"))
        self.state.summary = summary
        return summary
