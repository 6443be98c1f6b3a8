"""`flowkube-operator`: run the operator (configuration from FLOWKUBE_* environment variables)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys

import kopf
import uvloop

from flowkube_operator import handlers
from flowkube_operator.app import App, prepare_tls
from flowkube_operator.settings import Settings


def main(argv: list[str] | None = None) -> int:
    settings = Settings()
    kopf.configure(
        log_format=kopf.LogFormat.JSON if settings.log_format == "json" else kopf.LogFormat.PLAIN,
        verbose=settings.log_level == "DEBUG",
        quiet=settings.log_level in ("WARNING", "ERROR"),
    )
    logging.getLogger().setLevel(settings.log_level)
    # Before kopf: its webhook server starts with its files in place.
    app = App(settings, asyncio.run(prepare_tls(settings)))
    namespaces = settings.watch_namespaces
    # uvloop: the operator's work is I/O and JSON; its loop and transports, in C, cost less CPU per
    # event than asyncio's own (docs/architecture.md, "What a Flow costs").
    loop = uvloop.new_event_loop()
    # Everything made so far (modules, classes, settings) lives as long as the process: out of the
    # collector's full passes, which then walk only what the Flows and events bring.
    gc.freeze()
    with contextlib.suppress(KeyboardInterrupt):
        kopf.run(
            loop=loop,
            registry=handlers.register(app),
            # No kopf peering: with several replicas, the one holding the Lease reconciles (leader.py),
            # while all of them keep watching (peering would pause the followers' watches too).
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces,
        )
    loop.close()
    return 1 if app.lost_leadership else 0  # the kubelet restarts it either way


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    sys.exit(main(sys.argv[1:]))
