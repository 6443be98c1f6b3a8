"""`python -m flowkube_kubectl`: the same as `kubectl flow`."""

from __future__ import annotations

import sys

from flowkube_kubectl.cli import main

if __name__ == "__main__":
    sys.exit(main())
