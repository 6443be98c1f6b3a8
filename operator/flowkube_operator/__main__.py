"""`flowkube-operator`: run the operator (configuration from FLOWKUBE_* environment variables)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys

import kopf
import uvloop


def main(argv: list[str] | None = None) -> int:
    from flowkube_operator import handlers  # registers the kopf handlers

    settings = handlers.SETTINGS
    kopf.configure(
        log_format=kopf.LogFormat.JSON if settings.log_format == "json" else kopf.LogFormat.PLAIN,
        verbose=settings.log_level == "DEBUG",
        quiet=settings.log_level in ("WARNING", "ERROR"),
    )
    logging.getLogger().setLevel(settings.log_level)
    # Before kopf: its servers start with their files in place. The startup handler finds them in the memo.
    memo = kopf.Memo(tls=asyncio.run(handlers.prepare_tls()))
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
            # No kopf peering: with several replicas, the one holding the Lease reconciles (leader.py),
            # while all of them keep watching (peering would pause the followers' watches too).
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces,
            memo=memo,
        )
    loop.close()
    return 1 if handlers.LOST_LEADERSHIP else 0  # the kubelet restarts it either way


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    sys.exit(main(sys.argv[1:]))
