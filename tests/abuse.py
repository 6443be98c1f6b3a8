"""Hostile bytes the abuse tests send (unit and integration alike)."""

from __future__ import annotations

import zlib


def gzip_bomb(size: int) -> bytes:
    """``size`` bytes of zeros (whole MiB), gzip-compressed about 1000:1, written piecewise: 900 MiB
    make 917,278 bytes, under the state API's and a ConfigMap's value limits."""
    out = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    chunk = bytes(1 << 20)
    return b"".join([*(out.compress(chunk) for _ in range(size >> 20)), out.flush()])
