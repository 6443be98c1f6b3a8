"""pydantic model schemas built one thread at a time.

The model SDKs defer building their response models' validators to first use (openai's 1,056 models
are ``defer_build``; crewAI leaves six of its own with unresolved forward references), and pydantic
builds a deferred model inside ``model_rebuild``, which is not thread-safe (pydantic#11849; the same
race is reported against google-genai's deferred models): while one thread completes
``ChatCompletion``, a second that saw it incomplete deletes the validator the first just built, and
a third reading it in that moment falls through to a parent's placeholder. crewAI runs a flow's
parallel start methods and ``and_``/``or_`` branches on threads, so the first model answers of such
a flow arrive together, and one of them failed with "BaseModel cannot be instantiated directly"
(found by the integration suite's six parallel branch calls, 2026-11-28).

Completing every deferred model at load would cost 5 s of a cold start (measured: 1,062 models), so
rebuilds are serialized instead: with one lock around ``model_rebuild``, the second thread finds the
model complete and returns, deleting nothing. A rebuild is a few milliseconds, once per model per
process; the lock is re-entrant because building one model can build the models it names.
"""

from __future__ import annotations

import threading
from typing import Any

from pydantic import BaseModel

_lock = threading.RLock()
_installed = False


def serialize_model_rebuilds() -> None:
    """Make ``BaseModel.model_rebuild`` (and so pydantic's build on first use) one thread at a time
    (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        rebuild = BaseModel.model_rebuild.__func__  # type: ignore[attr-defined]

        def model_rebuild(cls: type[BaseModel], **kwargs: Any) -> bool | None:
            # pydantic reads the caller's namespace this many frames up: this wrapper is one more.
            depth = kwargs.get("_parent_namespace_depth", 2)
            if depth > 0:
                kwargs["_parent_namespace_depth"] = depth + 1
            with _lock:
                result: bool | None = rebuild(cls, **kwargs)
                return result

        model_rebuild.__doc__ = rebuild.__doc__
        BaseModel.model_rebuild = classmethod(model_rebuild)  # type: ignore[assignment,method-assign,arg-type]
