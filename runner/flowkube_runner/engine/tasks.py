"""Task-level recovery inside a flow method: every finished task of a crew is kept in the flow's
state document, so a retry after a lost pod skips what the crew had finished and pays only for the
rest (the model calls of finished tasks are not made again, and not counted again).

crewAI's own checkpoints do not serve here, measured on 1.15.30: a checkpoint holds the whole
runtime with every event since kickoff (0.4-2 MB for a four-task crew with 1 k-token answers,
past the 900 KiB a value of the state may have), is written by a background thread, restores from a
file on the pod's disk, and a method that runs again builds a new Crew its restore never matches.
What is kept instead is each finished task's ``TaskOutput`` (without its message history: 2.5-3 kB
gzipped for a 1 k-token answer), through three of crewAI's interception points:

- ``INPUT``, before a crew runs: the outputs kept for this crew (the same method, ``crew.key``,
  inputs and occurrence) are set on its first tasks and crewAI's resume flag is raised, so crewAI
  starts at the first task without an output and gives the later tasks the kept outputs as context;
- ``POST_STEP`` of a task: its output is kept, and the document written (best effort: a failed
  write only means that task is paid for again after a pod loss);
- ``EXECUTION_END``: the resume flag is lowered (crewAI never does; a crew kicked off again would
  otherwise return its old outputs).

A method's tasks are dropped from the document in the write that records the method as completed:
from then on a retry replays the method, not its tasks. So the document holds at most the tasks of
the methods running now.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from crewai.flow.flow_context import current_flow_method_name
from crewai.hooks.dispatch import InterceptionPoint, register
from crewai.tasks.task_output import TaskOutput

log = logging.getLogger("flowkube_runner")

Slots = dict[str, list[dict[str, Any]]]
RESUME_FLAG = "flowkube-task-resume"  # what crewAI's checkpoint_kickoff_event_id holds while the cache resumes a crew


def slot_method(slot: str) -> str:
    return slot.split("|", 1)[0]


class TaskCache:
    """The finished tasks of the crews of the methods running now, by slot
    (``method|crew key|inputs hash|occurrence``). ``save`` writes them into the state document."""

    def __init__(self, kept: Slots, save: Callable[[Slots], None], *, enabled: bool = True) -> None:
        """``enabled``: False keeps nothing and sets nothing (``spec.retries.keepTasks: false``)."""
        self.enabled = enabled
        self._slots: Slots = {k: list(v) for k, v in kept.items()} if enabled else {}
        self._save = save
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}  # kickoffs of each (method, crew, inputs) in this process
        self.skipped = 0  # tasks whose kept output was used instead of running them

    def snapshot(self) -> Slots:
        with self._lock:
            return {k: list(v) for k, v in self._slots.items()}

    def method_done(self, method: str) -> None:
        """``method`` completed: its tasks are no longer needed (the caller writes the document)."""
        with self._lock:
            for key in [k for k in self._slots if slot_method(k) == method]:
                del self._slots[key]
            for key in [k for k in self._seen if slot_method(k) == method]:
                del self._seen[key]

    def forget(self) -> None:
        """Keep nothing more (what was kept did not fit in the state with the rest)."""
        with self._lock:
            self._slots.clear()

    # -- crewAI's interception points ------------------------------------------------------------

    def on_input(self, ctx: Any) -> None:
        crew = getattr(ctx, "crew", None)
        method = current_flow_method_name.get(None)
        if crew is None or not method or not self.enabled:
            return
        digest = hashlib.sha256(json.dumps(ctx.payload or {}, sort_keys=True, default=str).encode()).hexdigest()
        base = f"{method}|{crew.key}|{digest[:16]}"
        with self._lock:
            occurrence = self._seen.get(base, 0)
            self._seen[base] = occurrence + 1
            slot = f"{base}|{occurrence}"
            kept = list(self._slots.get(slot, []))
        crew._flowkube_slot = slot
        done = 0
        for task, raw in zip(crew.tasks, kept, strict=False):
            try:
                task.output = _task_output(task, raw)
            except Exception as e:  # a kept output that no longer fits: run from here
                log.warning("a kept task output of %s does not fit (%s); running from task %d", method, e, done + 1)
                break
            done += 1
        if done:
            for task in crew.tasks[done:]:  # crewAI resumes at the first task without an output
                task.output = None
            crew.checkpoint_kickoff_event_id = RESUME_FLAG
            self.skipped += done
            log.info("%s: %d finished task(s) of the crew kept from an earlier run; not run again", method, done)

    def on_post_step(self, ctx: Any) -> None:
        task = getattr(ctx, "task", None)
        if getattr(ctx, "kind", None) != "task" or task is None or task.agent is None:
            return
        crew = getattr(task.agent, "crew", None)
        slot = getattr(crew, "_flowkube_slot", None)
        if crew is None or slot is None or not isinstance(ctx.payload, TaskOutput):
            return
        index = crew.tasks.index(task) if task in crew.tasks else -1
        output = ctx.payload.model_dump(mode="json", exclude={"messages"})
        with self._lock:
            outputs = self._slots.setdefault(slot, [])
            if index != len(outputs):  # only a contiguous prefix is kept (async or repeated tasks)
                return
            outputs.append(output)
            slots = {k: list(v) for k, v in self._slots.items()}
        try:
            self._save(slots)
        except Exception as e:  # best effort: a lost pod then runs this task again
            with self._lock:  # kept is what was written: never more than the state can hold
                if len(self._slots.get(slot, [])) == index + 1:
                    self._slots[slot].pop()
            log.warning("could not keep the output of task %d of %s: %s", index + 1, slot_method(slot), e)

    @staticmethod
    def on_end(ctx: Any) -> None:
        crew = getattr(ctx, "crew", None)
        if crew is not None and getattr(crew, "checkpoint_kickoff_event_id", None) == RESUME_FLAG:
            crew.checkpoint_kickoff_event_id = None


def _task_output(task: Any, raw: dict[str, Any]) -> TaskOutput:
    output = TaskOutput.model_validate({k: v for k, v in raw.items() if k != "pydantic"})
    model = getattr(task, "output_pydantic", None)
    if model is not None and raw.get("raw"):
        output.pydantic = model.model_validate_json(raw["raw"])
    return output


_current: list[TaskCache] = []  # the process's cache: the hooks are registered once, globally


def install(cache: TaskCache) -> None:
    """Make ``cache`` the one crewAI's interception points use in this process."""
    if not _current:
        register(InterceptionPoint.INPUT, lambda ctx: _current[0].on_input(ctx))
        register(InterceptionPoint.POST_STEP, lambda ctx: _current[0].on_post_step(ctx))
        register(InterceptionPoint.EXECUTION_END, TaskCache.on_end)
        _current.append(cache)
    _current[0] = cache
