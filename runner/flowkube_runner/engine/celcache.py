"""crewAI's CEL parser, built once at image build time instead of at every run's start.

crewAI checks every ``${...}`` template of an inline definition with celpy's parser, a Lark LALR
parser that celpy builds from its grammar the first time one is asked for: 0.25 s of CPU on an idle
machine, in every runner pod and on each validate-server start. Lark can keep what it built in a
file and load it again (``cache=``, keyed by a hash of the grammar, the options, Lark's and Python's
versions, so any change rebuilds). The runner image writes that file while it is built
(``python -m flowkube_runner.engine.celcache``) and names it in ``FLOWKUBE_CEL_PARSER_CACHE``; a run
then loads it (0.02 s). celpy still builds the parser itself, with its own grammar and options: the
cache is only handed to the ``Lark`` it calls. Without the variable (a development run), or with a
file that does not match, the parser is built as before (Lark cannot write the file as the runner's
user, and says so only at its CRITICAL-filtered logger).

crewAI-free: it imports celpy and Lark only.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
from pathlib import Path
from typing import Any

CACHE_ENV = "FLOWKUBE_CEL_PARSER_CACHE"
_BUILDING = threading.Lock()  # the validate server checks definitions on several threads


def prepare(cache: str | None = None) -> bool:
    """Build celpy's one parser (``CELParser.CEL_PARSER``) through the cache file, unless it is built
    already or no file is named. True when this call built it."""
    path = cache if cache is not None else os.environ.get(CACHE_ENV, "")
    if not path:
        return False
    celparser: Any = importlib.import_module("celpy.celparser")
    with _BUILDING:
        if celparser.CELParser.CEL_PARSER is not None:
            return False
        lark = celparser.Lark
        celparser.Lark = functools.partial(lark, cache=path)
        try:
            celparser.CELParser()
        finally:
            celparser.Lark = lark
    return True


def main(argv: list[str]) -> int:
    """Write the cache file (the image build runs this as root, before the runner's user)."""
    path = argv[0] if argv else os.environ.get(CACHE_ENV, "")
    if not path:
        print(f"usage: python -m flowkube_runner.engine.celcache PATH (or set {CACHE_ENV})", file=sys.stderr)
        return 2
    prepare(path)
    if not Path(path).is_file():
        print(f"the CEL parser cache was not written to {path}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
