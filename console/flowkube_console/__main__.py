"""`flowkube-console` (or `python -m flowkube_console`): serve the web console."""

from __future__ import annotations

import logging
import sys

from aiohttp import web

from flowkube_console.app import make_app
from flowkube_console.settings import load


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = load(sys.argv[1:] if argv is None else argv)
    print(f"flowkube console on http://{settings.host}:{settings.port}/ (API server {settings.api_server}, "
          f"sign-in: {settings.mode})", flush=True)
    web.run_app(make_app(settings), host=settings.host, port=settings.port, print=None, access_log=None,
                shutdown_timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
