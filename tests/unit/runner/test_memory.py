"""crewAI's automatic flow memory: built only for a flow that uses it (it costs seconds of a pod's start)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from flowkube_runner.engine.definitions import import_flow_class, load_definition, uses_memory

PLAIN: dict[str, Any] = {"schema": "crewai.flow/v1", "name": "plain",
                         "methods": {"hello": {"start": True, "do": {"call": "expression", "expr": "'hi'"}}}}

BUILD = textwrap.dedent("""\
    import json, sys
    from pathlib import Path
    from flowkube_runner.engine import session
    from flowkube_runner.store import FileStore
    s = session.FlowSession(FileStore(Path(sys.argv[1])), "probe", None)
    spec = json.loads(sys.argv[2])
    s.load(definition=spec.get("definition"), flow_ref=spec.get("flowRef"))
    print(type(s._new_flow().memory).__name__)
""")


def built_memory(tmp_path: Path, spec: dict[str, Any]) -> str:
    """The memory of the Flow a runner process builds for ``spec`` (a process of its own, as a pod)."""
    out = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path), json.dumps(spec)], capture_output=True,
                         text=True, timeout=240, env={"CREWAI_DISABLE_TELEMETRY": "true", "OTEL_SDK_DISABLED": "true",
                                                      "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_what_turns_memory_on() -> None:
    assert not uses_memory(load_definition(PLAIN))
    assert uses_memory(load_definition({**PLAIN, "config": {"memory": {"enabled": True}}}))
    assert not uses_memory(load_definition({**PLAIN, "config": {"memory": {"enabled": False}}}))
    learning = {**PLAIN, "methods": {"hello": {"start": True, "do": {"call": "expression", "expr": "'hi'"},
                                               "human_feedback": {"message": "ok?", "learn": True}}}}
    assert uses_memory(load_definition(learning))
    article = import_flow_class("flowkube_runner.examples.article:ArticleFlow")
    assert not uses_memory(article.flow_definition(), article)


def test_a_class_that_recalls_uses_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "recalling.py").write_text(textwrap.dedent("""\
        from crewai.flow.flow import Flow, start

        class Recalling(Flow):
            @start()
            def ask(self):
                return self.recall("what did we learn?")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    cls = import_flow_class("recalling:Recalling")
    assert uses_memory(cls.flow_definition(), cls)


@pytest.mark.slow
def test_a_flow_is_built_without_memory_unless_it_uses_it(tmp_path: Path) -> None:
    assert built_memory(tmp_path / "a", {"definition": PLAIN}) == "NoneType"
    assert built_memory(tmp_path / "b", {"definition": {**PLAIN, "config": {"memory": {"enabled": True}}}}) == "Memory"
