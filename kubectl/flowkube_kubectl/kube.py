"""Calls to kubectl itself (or $KUBECTL): contexts, namespaces and credentials as in kubectl."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from flowkube_api.constants import (
    SINGULAR,
)


class KubectlError(Exception):
    def __init__(self, out: subprocess.CompletedProcess[str]) -> None:
        super().__init__(out.stderr)
        self.returncode = out.returncode or 1


def run_kubectl(args: list[str], kube: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([os.environ.get("KUBECTL", "kubectl"), *args, *kube], capture_output=True, text=True,
                          input=stdin)


def kubectl_json(args: list[str], kube: list[str], stdin: str | None = None) -> dict[str, Any]:
    out = run_kubectl([*args, "-o", "json"], kube, stdin)
    if out.returncode != 0:
        raise KubectlError(out)
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def patch_status(name: str, patch: dict[str, Any], kube: list[str]) -> subprocess.CompletedProcess[str]:
    return run_kubectl(["patch", SINGULAR, name, "--subresource=status", "--type=merge", "-p",
                     json.dumps(patch, separators=(",", ":"))], kube)
