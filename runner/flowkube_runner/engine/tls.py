"""One TLS context per process for the model clients, instead of one per client.

crewAI builds a new LLM object, and with it a new OpenAI client (a sync and an async one), wherever
a definition names a model by string: a ``human_feedback`` step's ``llm`` at every answer, an agent
at every call. Each httpx client built with the default ``verify=True`` reads the whole CA bundle
into a new ``ssl.SSLContext``: 50 ms of CPU apiece, 105 ms of a warm resume's 160 (measured with
cProfile on the benchmark's feedback flow, 2026-11-27). The bundle does not change while the process
lives, so every such client gets the same context, built once. A client asking for anything else
(its own context, a CA file, ``verify=False``, a client certificate) is left alone.

httpcore sets a context's ALPN protocols on each connection from its own transport's ``http2``
flag, so HTTP/1.1-only and HTTP/2 transports get separate contexts.
"""

from __future__ import annotations

import functools
import os
import ssl
import threading
from typing import Any

import httpx

_lock = threading.Lock()
_contexts: dict[tuple[bool, bool, str, str], ssl.SSLContext] = {}
_installed = False


def _shared(http2: bool, trust_env: bool) -> ssl.SSLContext:
    key = (http2, trust_env, os.environ.get("SSL_CERT_FILE", "") if trust_env else "",
           os.environ.get("SSL_CERT_DIR", "") if trust_env else "")
    with _lock:
        ctx = _contexts.get(key)
        if ctx is None:
            ctx = _contexts[key] = httpx.create_ssl_context(verify=True, trust_env=trust_env)
        return ctx


def _sharing(init: Any) -> Any:
    @functools.wraps(init)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        if not args and kwargs.get("verify", True) is True and kwargs.get("cert") is None:
            kwargs["verify"] = _shared(bool(kwargs.get("http2", False)), bool(kwargs.get("trust_env", True)))
        init(self, *args, **kwargs)

    return wrapped


def share_default_contexts() -> None:
    """Make every httpx transport built with the default TLS settings share one context (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    for transport in (httpx.HTTPTransport, httpx.AsyncHTTPTransport):
        transport.__init__ = _sharing(transport.__init__)  # type: ignore[method-assign]
