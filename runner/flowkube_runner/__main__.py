"""``flowkube-runner`` / ``python -m flowkube_runner``.

- no arguments (or ``run``): run one Flow run from the pod environment (what runner pods do). On
  SIGTERM (the pod deleted, evicted or drained) it lets the model call in flight finish, starts no
  new one, reports the run ``RunInterrupted`` with every answered call counted, and exits with the
  retryable code, within the pod's grace period;
- ``validate-server [--host H] [--port P]``: the definition validator the operator's admission
  webhook asks (see ``validate.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
from datetime import UTC, datetime
from types import FrameType
from typing import NoReturn

from flowkube_api import constants as c
from flowkube_api.report import RunReport, excerpt

from .config import ConfigError, RunnerConfig
from .run import execute, publish
from .store import FileStore, StateApiStore, StoreError

log = logging.getLogger("flowkube_runner")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    if not sys.stderr.isatty():
        handler.setFormatter(_JsonFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler])


USAGE = "usage: flowkube-runner [run | validate-server [--host HOST] [--port PORT]]"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    command, rest = (args[0], args[1:]) if args else ("run", [])
    _configure_logging()
    if command == "validate-server":
        from .validate import serve

        return serve(rest)
    if command != "run" or rest:
        print(USAGE, file=sys.stderr)
        return c.EXIT_PERMANENT
    code = run_from_environment()
    end_now(code)
    return code  # not reached


def end_now(code: int) -> NoReturn:
    """Exit as soon as the run is published. The report and the state are written (synchronously) by
    then; the interpreter's own teardown of crewAI's modules and threads takes seconds on a busy node,
    and a runner pod's end is what the operator waits for to fold its run."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


STOP_LOG = "SIGTERM: stopping; the model call in flight may finish, no new one starts"


def stop_on_sigterm() -> threading.Event:
    """An event SIGTERM sets. Installed first thing, so a stop during the seconds crewAI takes to
    import is not lost (a runner pod's process is PID 1, which ignores a signal it has no handler for).
    The handler only sets the event: logging from it could re-enter a stream the main thread is
    writing, so a thread says it."""
    stop = threading.Event()

    def on_sigterm(_signum: int, _frame: FrameType | None) -> None:
        if not stop.is_set():
            stop.set()
            threading.Thread(target=log.warning, args=(STOP_LOG,), daemon=True).start()

    signal.signal(signal.SIGTERM, on_sigterm)
    return stop


# crewAI's start-up work that has no one to serve in a pod, off unless the pod's env (a Flow's
# spec.env, the image) says otherwise. The first-run trace: every pod starts with an empty $HOME, so
# every run was crewAI's "first" and buffered its spans for a consent prompt that a pod without a
# terminal always declines. The version check: each run asked pypi.org for crewAI's latest version
# (a DNS lookup and HTTPS, up to 2 s where egress is blocked) to print an upgrade hint for a pinned image.
CREWAI_DEFAULTS = {"CREWAI_TRACING_ENABLED": "false", "CREWAI_DISABLE_VERSION_CHECK": "true"}


def run_from_environment() -> int:
    started_at = datetime.now(UTC)
    stop = stop_on_sigterm()
    for name, value in CREWAI_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        config = RunnerConfig.from_env()
    except ConfigError as e:
        log.error("%s", e)
        failed = RunReport(
            pod="",
            trigger=c.Trigger.KICKOFF,
            result=c.RunResult.FAILED,
            reason=e.reason,
            message=excerpt(str(e)),
            exit_code=c.EXIT_PERMANENT,
            started_at=started_at,
            finished_at=datetime.now(UTC),
        )
        publish(failed, None, RunnerConfig.termination_log_from_env())
        return c.EXIT_PERMANENT

    store: FileStore | StateApiStore | None = None
    try:
        store = FileStore(config.state_dir) if config.state_dir else StateApiStore.from_environment()
    except StoreError as e:
        report = RunReport(
            pod=config.pod,
            flow=config.flow,
            trigger=config.trigger,
            result=c.RunResult.FAILED,
            reason=c.Reason.INTERNAL_ERROR,
            message=excerpt(f"state store: {e}"),
            exit_code=c.EXIT_RETRYABLE,
            started_at=started_at,
            finished_at=datetime.now(UTC),
        )
    else:
        report = execute(config, store, started_at=started_at, stop=stop, inbox=store)
    publish(report, store, config.termination_log)
    log.info("run ended: %s %s (exit %d)", report.result, report.reason, report.exit_code)
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
