"""Deferred pydantic models first used on several threads at once (a flow's parallel branches
receiving their first model answers together) are built once, and every thread gets a valid model."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Fresh deferred models, first used by eight threads released together, a hundred times over; the
# thread switch interval is made tiny so that the threads interleave inside pydantic's build. Without
# the lock this failed 16-19 of 300 trials (AttributeError: no '__pydantic_core_schema__'; in a pod:
# "BaseModel cannot be instantiated directly").
RACE = textwrap.dedent("""
    import sys, threading
    from typing import Optional
    from pydantic import BaseModel, ConfigDict
    from flowkube_runner.engine.rebuilds import serialize_model_rebuilds

    serialize_model_rebuilds()
    serialize_model_rebuilds()  # idempotent
    sys.setswitchinterval(1e-6)
    failures = []
    for trial in range(100):
        class Base(BaseModel):
            model_config = ConfigDict(defer_build=True, extra="allow")
        class Choice(Base):
            index: int
            text: Optional[str] = None
        class Completion(Base):
            choices: list[Choice]
            first: Optional[Choice] = None
        barrier = threading.Barrier(8)
        def answer() -> None:
            barrier.wait()
            try:
                c = Completion.model_validate({"choices": [{"index": 0, "text": "hi"}], "first": {"index": 1}})
                assert isinstance(c.choices[0], Choice) and c.first.index == 1
            except Exception as e:
                failures.append(f"{type(e).__name__}: {e}")
        threads = [threading.Thread(target=answer) for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
    print(len(failures), failures[:3])
    """)


def test_deferred_models_first_used_by_parallel_threads_are_built_once_and_valid() -> None:
    out = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.startswith("0 "), out.stdout


def test_a_rebuild_still_resolves_names_from_the_callers_namespace() -> None:
    """pydantic reads the caller's frame to resolve a forward reference; the lock's wrapper keeps it."""
    from pydantic import BaseModel

    from flowkube_runner.engine.rebuilds import serialize_model_rebuilds

    serialize_model_rebuilds()

    class Later(BaseModel):
        child: Child

    class Child(BaseModel):
        n: int

    assert Later.model_rebuild() is True
    assert Later.model_validate({"child": {"n": 3}}).child.n == 3
