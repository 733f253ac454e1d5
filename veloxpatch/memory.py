"""What a list of caches holds, and what mlx-lm's own caches would hold instead.

Both count allocated rows, the way `nbytes` does on both sides: a veloxpatch
cache holds its step-grown buffer (padding included), and mlx-lm's `KVCache`
allocates 256 rows at a time, so after a short prompt it holds 256 rows, not the
prompt's few tokens. Counting rows allocated on one side and tokens seen on the
other made a short prompt report more KV held than a full cache would hold.
"""

from __future__ import annotations

from mlx_lm.models.cache import KVCache

from .caches import VeloxCache


def kv_bytes(caches) -> int:
    """Bytes really held by the caches (veloxpatch or mlx-lm), padding included."""
    return sum(c.nbytes for c in caches if not c.empty())


def full_rows(tokens: int, step: int = KVCache.step) -> int:
    """Rows mlx-lm's KVCache has allocated once it has seen `tokens` tokens
    (prefilled in chunks of a multiple of `step`, then one token at a time,
    as mlx-lm's generation does)."""
    return -(-tokens // step) * step


def full_kv_bytes(caches) -> int:
    """Bytes mlx-lm's own caches would hold for the same tokens, counted as
    `kv_bytes` counts: a KVCache of the same dtype on every veloxpatch layer,
    allocated rows included; layers that keep an mlx-lm cache (sliding-window
    layers) count as they are, as they would be unpatched."""
    total = 0
    for c in caches:
        if c.empty():
            continue
        if not isinstance(c, VeloxCache):
            total += c.nbytes
            continue
        keys, values = c.keys, c.values
        B, H, _, Dk = keys.shape
        Dv = values.shape[-1]
        row = Dk * keys.dtype.size + Dv * values.dtype.size
        total += B * H * full_rows(c.offset) * row
    return total
