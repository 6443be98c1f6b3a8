"""Benchmark: what keeping a crew's finished tasks costs a run (``spec.retries.keepTasks``). Prints figures.

    .venv/bin/python -m tests.benchmarks.bench_tasks [--rounds 7] [--tasks 4] [--words 700]

One runner process (this one), crewAI loaded once, the stub model answering each task with about
``--words`` words (a 1 k-token answer at the default). Each round kicks off the same one-method flow
of a ``--tasks``-task crew twice, in a fresh file store each time: with the tasks kept (the default)
and without (the peer, in the same round, alternating which goes first). It reports each side's
median run time, the difference per task, and the state writes and their bytes: with the tasks kept,
every finished task writes the state document once. Through the operator's state API such a write
is one PUT (``bench_state``: p50 5.5 ms for 20 kB); here the store is a local file, so the
difference is the runner's own work per task (its output serialised, the document encoded).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowkube_api.constants import STATE_KEY
from flowkube_devstack.stubmodel import Rules, StubModel
from tests.definitions import crew_definition, crewai_in_process

MODEL = "gpt-4o-mini"
WRITER = {"role": "Writer", "goal": "Write well", "backstory": "A careful writer.", "settings": {"llm": MODEL}}


class CountingKeys:
    """The runner's file store, counting the writes of each key and their bytes."""

    def __init__(self, root: Path) -> None:
        from flowkube_runner.store import FileStore

        self.inner = FileStore(root)
        self.written: list[tuple[str, int]] = []

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def put(self, key: str, value: bytes, *, leader_for: float | None = None) -> None:
        self.inner.put(key, value)
        self.written.append((key, len(value)))

    def sizes(self, prefix: str) -> list[int]:
        """The bytes of each write of a key starting with ``prefix``, in order."""
        return [n for key, n in self.written if key.startswith(prefix)]


def prose(seed: int, words: int) -> str:
    """``words`` made-up words, different for each seed: it compresses about as English does, and no
    answer repeats another (which gzip would then store almost for free)."""
    rng = random.Random(seed)
    return " ".join("".join(rng.choice("etaoinshrdlucmfwypvbgkjqxz"[:rng.randint(8, 26)])
                            for _ in range(rng.randint(2, 9))) for _ in range(words))


def run_once(keep: bool, tasks: int, root: Path) -> tuple[float, list[int]]:
    from flowkube_runner.engine.session import FlowSession

    store = CountingKeys(root)
    session = FlowSession(store, "bench-0", None, keep_tasks=keep)
    session.load(definition=crew_definition(WRITER, tasks))
    started = time.perf_counter()
    ending = session.kickoff({})
    took = time.perf_counter() - started
    assert not ending.paused and ending.output, ending
    return took, store.sizes(STATE_KEY)


Sides = tuple[dict[bool, list[float]], dict[bool, list[int]]]


def paired_rounds(rules: dict[str, Any], rounds: int, run: Callable[[bool, Path], tuple[float, list[int]]]) -> Sides:
    """``run(on, root)`` against ``run(off, root)`` in each of ``rounds``, alternating which goes first,
    each in a fresh store, after one warm-up (imports and first-call costs out of the figures), the
    stub model answering by ``rules``: each side's run times, and the byte sizes of its last run's writes."""
    with StubModel(Rules.from_json(rules)) as stub, crewai_in_process(stub.base_url) as tmp:
        run(True, tmp / "warmup")
        times: dict[bool, list[float]] = {True: [], False: []}
        sizes: dict[bool, list[int]] = {True: [], False: []}
        for r in range(rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                took, sizes[on] = run(on, tmp / f"{r}-{on}")
                times[on].append(took)
    return times, sizes


def print_sides(sides: Sides, labels: dict[bool, str], writes: str) -> tuple[float, float]:
    """Each side's median run (min-max) and its writes; (median on, median off)."""
    times, sizes = sides
    for on in (True, False):
        ts = times[on]
        spread = f"{min(ts) * 1000:.1f}-{max(ts) * 1000:.1f}"
        print(f"  {labels[on]:24} run {statistics.median(ts) * 1000:7.1f} ms ({spread}); "
              f"{writes} {len(sizes[on])}, bytes {sizes[on]}")
    return statistics.median(times[True]), statistics.median(times[False])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--words", type=int, default=700)
    args = parser.parse_args()
    rules = {"default": "A plain reply.",
             "rules": [{"contains": f"PART{i} of", "reply": f"Part {i}: {prose(i, args.words)}"}
                       for i in range(1, args.tasks + 1)]}
    sides = paired_rounds(rules, args.rounds, lambda keep, root: run_once(keep, args.tasks, root))
    print(f"a {args.tasks}-task crew in one method, answers of ~{args.words} words, {args.rounds} rounds "
          f"(medians; min-max)")
    on, off = print_sides(sides, {True: "tasks kept (default)", False: "keepTasks: false (peer)"}, "state writes")
    kept = sides[1][True][:args.tasks]  # one write per finished task, before the method's own
    print(f"  kept / peer: {on / off:.3f}; per task: {(on - off) / args.tasks * 1000:+.2f} ms; the document "
          f"grows {(kept[-1] - kept[0]) / max(args.tasks - 1, 1):.0f} bytes gzipped per kept task "
          f"({kept[-1]} with all {args.tasks})")


if __name__ == "__main__":
    main()
