"""A warm pod's wait: the long polls, each in its own thread, for the next message of a
conversation or the answer to a feedback request, ended at once by SIGTERM."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from flowkube_api import constants as c
from flowkube_api.report import RunReport

from .store import MessageGone

log = logging.getLogger("flowkube_runner")


def release_memory() -> None:
    """Between two answers, give back what the step freed: a turn serialises the whole transcript
    several times (crewAI's saves, the state commit), and glibc keeps those freed pages otherwise, so
    a warm pod's resident memory would climb with the transcript many times over (1 ms)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def answered_and_open(report: RunReport) -> bool:
    turn = report.conversation
    return (report.result == c.RunResult.SUCCEEDED and report.exit_code == c.EXIT_OK
            and turn is not None and not turn.ended)


def paused_on(report: RunReport) -> bool:
    return report.result == c.RunResult.PAUSED and report.feedback_request is not None


def _poll(poll: Callable[[float], dict[str, Any] | None], wait: float) -> tuple[threading.Event, list[Any]]:
    """One long poll in its own thread: (set when it answered, [its answer or exception])."""
    done, box = threading.Event(), list[Any]()

    def run() -> None:
        try:
            box.append(poll(wait))
        except BaseException as e:  # handed to the waiting thread
            box.append(e)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="warm-poll").start()
    return done, box


def wait_warm(poll: Callable[[float], dict[str, Any] | None], window: float,
               stop: threading.Event | None) -> dict[str, Any] | None:
    """What the pod waits for, or None when the window passed, the operator said nothing will come,
    or the pod is being stopped (SIGTERM ends the wait at once: each poll runs in its own thread)."""
    deadline = time.monotonic() + window
    stopping = stop or threading.Event()
    while not stopping.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        done, box = _poll(poll, min(float(c.MESSAGE_POLL_SECONDS), left))
        while not done.wait(0.2):  # SIGTERM sets `stop`, which cannot wake a wait on `done`: look every 0.2 s
            if stopping.is_set():
                return None
        found = box[0] if box else None
        if isinstance(found, MessageGone):
            log.info("nothing more will come to this pod: %s", found)
            return None
        if isinstance(found, BaseException):
            log.warning("waiting failed; the pod ends (the answer starts another): %s", found)
            return None
        if found is not None:
            return dict(found)
    return None
