"""What a list of caches holds, and what a full cache would hold instead."""

from __future__ import annotations


def kv_bytes(caches) -> int:
    """Bytes really held by the caches (veloxpatch or mlx-lm), padding included."""
    return sum(c.nbytes for c in caches if not c.empty())


def full_kv_bytes(caches) -> int:
    """Bytes an uncompressed cache of the same dtype would hold for these tokens."""
    total = 0
    for c in caches:
        if c.empty():
            continue
        keys, values = c.keys, c.values
        B, H, _, Dk = keys.shape
        Dv = values.shape[-1]
        total += B * H * c.offset * (Dk * keys.dtype.size + Dv * values.dtype.size)
    return total
