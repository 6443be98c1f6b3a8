"""Benchmark: what taking checkpoints costs a run (``spec.checkpoints.keep``). Prints figures.

    .venv/bin/python -m tests.benchmarks.bench_checkpoints [--rounds 7] [--methods 6] [--words 700]

One runner process (this one), crewAI loaded once, the stub model answering each method's agent with
about ``--words`` words (a 1 k-token answer at the default). Each round kicks off the same flow of
``--methods`` chained agent methods twice, in a fresh file store each time: with checkpoints (the
default) and with ``keep: 0`` (the peer, in the same round, alternating which goes first). It reports
each side's median run time, the difference per method, and the checkpoints' writes and bytes: a
checkpoint is the state document as written after a method completed, sent once more under
``checkpoint.<n>``, so it grows with the outputs the document holds. Through the operator's state API
such a write is one PUT (``bench_state``: p50 5.5 ms for 20 kB) and one ConfigMap write; here the
store is a local file, so the difference is the runner's own work per checkpoint.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from tests.benchmarks.bench_tasks import WRITER, CountingKeys, paired_rounds, print_sides, prose


def chain(methods: int) -> dict[str, Any]:
    """``step1`` … ``stepN``, each an agent reading the previous step's answer."""
    steps: dict[str, Any] = {}
    for i in range(1, methods + 1):
        prompt = f"STEP{i} after: " + (f"${{outputs.step{i - 1}.raw}}" if i > 1 else "the start")
        steps[f"step{i}"] = {**({"start": True} if i == 1 else {"listen": f"step{i - 1}"}),
                             "do": {"call": "agent", "with": {**WRITER, "input": prompt}}}
    return {"schema": "crewai.flow/v1", "name": "Chain", "state": {"type": "dict", "default": {}}, "methods": steps}


def run_once(taking: bool, methods: int, root: Path) -> tuple[float, list[int]]:
    from flowkube_api.report import SpentSoFar
    from flowkube_runner.engine.checkpoints import CheckpointLog
    from flowkube_runner.engine.session import FlowSession

    store = CountingKeys(root)
    log = CheckpointLog(store, SpentSoFar, enabled=taking)
    session = FlowSession(store, "bench-0", None, checkpoints=log)
    session.load(definition=chain(methods))
    started = time.perf_counter()
    ending = session.kickoff({})
    took = time.perf_counter() - started
    assert not ending.paused and ending.output, ending
    assert len(log.entries() or []) == (methods if taking else 0)
    return took, store.sizes("checkpoint.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--methods", type=int, default=6)
    parser.add_argument("--words", type=int, default=700)
    args = parser.parse_args()
    rules = {"default": "A plain reply.",
             "rules": [{"contains": f"STEP{i} after", "reply": f"Step {i}: {prose(i, args.words)}"}
                       for i in range(1, args.methods + 1)]}
    sides = paired_rounds(rules, args.rounds, lambda taking, root: run_once(taking, args.methods, root))
    print(f"{args.methods} chained agent methods, answers of ~{args.words} words, {args.rounds} rounds "
          f"(medians; min-max)")
    on, off = print_sides(sides, {True: "checkpoints (default)", False: "keep: 0 (peer)"}, "checkpoint writes")
    sent = sides[1][True]
    print(f"  checkpoints / peer: {on / off:.3f}; per method: {(on - off) / args.methods * 1000:+.2f} ms; "
          f"{sum(sent)} bytes gzipped sent in all (the last, {sent[-1]}, is the whole document)")


if __name__ == "__main__":
    main()
