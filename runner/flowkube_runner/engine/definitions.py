"""Naming a flow: inline definitions (crewAI's ``FlowDefinition``, with its verdict in the runner's
terms for the admission webhook's validator) and ``flowRef`` classes."""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

from crewai.flow.flow_definition import FlowDefinition, FlowPersistenceDefinition
from crewai.flow.runtime import Flow as RuntimeFlow
from pydantic import ValidationError

from . import celcache
from .api import InvalidFlow

_RUNNER_PERSISTENCE = FlowPersistenceDefinition(enabled=True)


def with_runner_persistence(definition: FlowDefinition) -> FlowDefinition:
    """Persist after every method, always to the runner's store.

    Retry and resume need every completed method on record, whatever the definition asked for;
    a backend named in the definition (a SQLite file, say) would not survive the pod anyway.
    """
    methods = {
        name: method.model_copy(update={"persist": None}) if method.persist is not None else method
        for name, method in definition.methods.items()
    }
    return definition.model_copy(update={"persist": _RUNNER_PERSISTENCE, "methods": methods})


@dataclass(frozen=True)
class DefinitionProblem:
    """One finding of crewAI's about a definition; ``loc`` is a path into the definition's JSON."""

    loc: tuple[str | int, ...]
    msg: str

    def render(self) -> str:
        path = ".".join(str(part) for part in self.loc)
        return f"{path}: {self.msg}" if path else self.msg


class _IssueCollector(logging.Handler):
    """crewAI's error-severity definition issues, which it logs instead of raising.

    Only records of the collecting thread are kept: the validate server checks definitions on
    several threads at once through the one shared crewAI logger.
    """

    _ISSUE_FORMAT = "Flow definition issue for %s%s [%s]: %s"

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.thread = threading.get_ident()
        self.problems: list[DefinitionProblem] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread != self.thread:
            return
        args = record.args
        if record.msg == self._ISSUE_FORMAT and isinstance(args, tuple) and len(args) == 4:
            location, message = str(args[1]), str(args[3])
            self.problems.append(DefinitionProblem(_split_path(location.removeprefix(" at ")), message))
        else:
            self.problems.append(DefinitionProblem((), record.getMessage()))


_TOP_LEVEL = sorted({f.alias or n for n, f in FlowDefinition.model_fields.items()}, key=len, reverse=True)
# crewAI names the place in the message of its model-level errors ("... at methods.a.do.expr: ...",
# "methods.a.listen listen condition ..."); pydantic only gives those an empty location.
_PATH_IN_MESSAGE = re.compile(rf"(?<![\w.])((?:{'|'.join(_TOP_LEVEL)})(?:\.\w+|\[\d+\])+)")


def _split_path(path: str) -> tuple[str | int, ...]:
    parts: list[str | int] = []
    for piece in path.split("."):
        name, *indexes = piece.replace("]", "").split("[")
        if name:
            parts.append(name)
        parts.extend(int(i) for i in indexes if i.isdigit())
    return tuple(parts)


Loc = tuple[str | int, ...]


def _data_path(raw: Any, loc: Loc) -> tuple[Loc, Loc]:
    """pydantic's location split into the path through the user's JSON and the union branch:
    where the union sits plus the member labels pydantic inserts (``FlowCodeActionDefinition``,
    ``function-after[...]``, a tag value)."""
    path: list[str | int] = []
    labels: list[str | int] = []
    branch: Loc = ()
    node: Any = raw
    for index, part in enumerate(loc):
        in_data = (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        )
        if in_data:
            node = node[part]
        elif index < len(loc) - 1:
            # Not in the data and not the missing field itself: a union member's label.
            labels.append(part)
            branch = (*path, *labels)
            continue
        path.append(part)
    return tuple(path), branch


def _validation_problems(raw: Any, error: ValidationError) -> list[DefinitionProblem]:
    """crewAI's errors by JSON path. Where a value matched no member of a union (``do`` with a
    misspelt ``call``), pydantic reports every member's complaints; only the members whose
    literal tag (``call: agent``) the value did carry are kept, or else one merged "should be"."""
    problems: list[DefinitionProblem] = []
    branches: list[tuple[Loc, DefinitionProblem, Any]] = []
    for detail in error.errors(include_url=False, include_input=False):
        msg = str(detail["msg"]).removeprefix("Value error, ")
        loc, branch = _data_path(raw, tuple(detail["loc"]))
        if not loc and (found := _PATH_IN_MESSAGE.search(msg)):
            loc = _split_path(found.group(1))
        if branch:
            branches.append((branch, DefinitionProblem(loc, msg), detail))
        else:
            problems.append(DefinitionProblem(loc, msg))
    tag_mismatch = {branch for branch, _, d in branches if d["type"] == "literal_error"}
    expected: dict[Loc, list[str]] = {}
    for branch, problem, detail in branches:
        siblings = {b for b, _, _ in branches if b[:-1] == branch[:-1]}
        if siblings - tag_mismatch:  # some member's tag matched: its complaints are the real ones
            if branch not in tag_mismatch:
                problems.append(problem)
        elif detail["type"] == "literal_error":
            expected.setdefault(problem.loc, []).append(str((detail.get("ctx") or {}).get("expected", "")))
    for loc, values in expected.items():
        values = list(dict.fromkeys(values))
        options = values[0] if len(values) == 1 else ", ".join(values[:-1]) + f" or {values[-1]}"
        problems.append(DefinitionProblem(loc, f"Input should be {options}"))
    return problems


def check_definition(raw: Any) -> tuple[FlowDefinition | None, list[DefinitionProblem]]:
    """crewAI's own verdict on an inline definition: its ``FlowDefinition`` model, plus the
    error-severity issues its loader only logs (an invalid ``default_outcome``, say).

    What ``Flow.from_declaration`` adds on top (importing ``code``/``tool`` refs, reading crew
    files, the script-execution switch) depends on the image and env of the flow's own pod, so
    it is left to the run; it fails there with ``InvalidDefinition`` too.
    """
    if not isinstance(raw, dict):
        return None, [DefinitionProblem((), "a flow definition must be a JSON object")]
    celcache.prepare()  # the parser crewAI checks ${...} templates with, from the image's cache
    collector = _IssueCollector()
    definition_logger = logging.getLogger("crewai.flow.flow_definition")
    definition_logger.addHandler(collector)
    try:
        definition = FlowDefinition.from_declaration(contents=raw)
    except ValidationError as e:
        return None, _dedupe(_validation_problems(raw, e))
    except (ValueError, TypeError) as e:
        return None, [DefinitionProblem((), str(e))]
    finally:
        definition_logger.removeHandler(collector)
    if collector.problems:
        return None, _dedupe(collector.problems)
    if unreachable := unreachable_listens(definition):
        return None, unreachable
    return definition, []


def unreachable_listens(definition: FlowDefinition) -> list[DefinitionProblem]:
    """Methods whose ``listen`` no method can ever satisfy: crewAI accepts them and they never run.

    A label is emitted when a method of that name finishes, or by a router (``emit``, or a feedback
    step's ``emit``). A router that declares no ``emit`` may return any label, and a conversational
    flow routes by its own labels: then nothing is refused. ``or`` needs one reachable branch,
    ``and`` every branch.
    """
    methods = definition.methods
    routes = {name: [*(m.emit or []), *((m.human_feedback.emit or []) if m.human_feedback else [])]
              for name, m in methods.items()}
    if definition.conversational is not None or any(m.router and not routes[n] for n, m in methods.items()):
        return []
    labels = set(methods) | {label for emitted in routes.values() for label in emitted}
    return [DefinitionProblem(("methods", name, "listen"),
                              f"listens to {method.listen!r}, which no method emits or routes to: it would never run "
                              f"(labels: {', '.join(sorted(labels))})")
            for name, method in methods.items()
            if method.listen is not None and not _reachable(method.listen, labels)]


def _reachable(condition: Any, labels: set[str]) -> bool:
    if isinstance(condition, str):
        return condition in labels
    if isinstance(condition, dict):
        if "and" in condition:
            return all(_reachable(c, labels) for c in condition["and"])
        if "or" in condition:
            return any(_reachable(c, labels) for c in condition["or"])
    return True  # a shape crewAI has and this does not know: not refused here


def _dedupe(problems: list[DefinitionProblem]) -> list[DefinitionProblem]:
    return list(dict.fromkeys(problems))


def load_definition(raw: dict[str, Any]) -> FlowDefinition:
    """Validate exactly as the admission webhook's validator does (``check_definition``)."""
    definition, problems = check_definition(raw)
    if definition is None:
        raise InvalidFlow("; ".join(p.render() for p in problems))
    return with_runner_persistence(definition)


def import_flow_class(ref: str) -> type[RuntimeFlow[Any]]:
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidFlow(f"flowRef {ref!r} is not of the form 'package.module:ClassName'")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except Exception as e:
        raise InvalidFlow(f"flowRef {ref!r} does not import: {type(e).__name__}: {e}") from e
    if not (isinstance(target, type) and issubclass(target, RuntimeFlow)):
        raise InvalidFlow(f"flowRef {ref!r} is not a crewAI Flow subclass")
    flow_class: Any = target
    try:
        definition = flow_class.flow_definition()
    except Exception as e:
        raise InvalidFlow(f"flowRef {ref!r}: crewAI cannot build its definition: {e}") from e
    # The class-level cache is what every instance reads, so this is where persistence is forced.
    flow_class._flow_definition = with_runner_persistence(definition)
    return target


# What in a Flow class's source reaches the flow's memory (crewAI's Flow.remember, recall, memory).
_MEMORY_USE = re.compile(r"\b(?:remember|remember_many|recall|extract_memories)\s*\(|\.memory\b")


def uses_memory(definition: FlowDefinition, flow_class: type[RuntimeFlow[Any]] | None = None) -> bool:
    """Whether the flow reaches crewAI's flow-level memory: its definition turns memory on
    (``config.memory``, not ``enabled: false``) or a feedback step learns (``learn: true``), or its
    class (a flowRef) sets ``memory`` itself or names it in its source. A class whose source cannot
    be read is taken to use it."""
    memory = definition.config.memory
    if memory and memory.get("enabled", True) is not False:
        return True
    if any(m.human_feedback is not None and m.human_feedback.learn for m in definition.methods.values()):
        return True
    if flow_class is None:
        return False
    field = flow_class.model_fields.get("memory")
    if field is not None and (field.default is not None or field.default_factory is not None):
        return True
    for cls in flow_class.__mro__:
        if not issubclass(cls, RuntimeFlow) or cls.__module__.partition(".")[0] == "crewai":
            continue  # crewAI's own classes (Flow, its generic aliases) are not the user's code
        try:
            if _MEMORY_USE.search(inspect.getsource(cls)):
                return True
        except (OSError, TypeError):
            return True
    return False


def automatic_memory(flow_class: type[RuntimeFlow[Any]], wanted: bool) -> None:
    """crewAI gives every Flow a Memory when it is built (a LanceDB store, an embedder: about 280
    modules, 95 MB and seconds of a pod's start): only a flow that uses it gets it."""
    flow_class._skip_auto_memory = not wanted  # crewAI's own switch (its internal flows set it)
