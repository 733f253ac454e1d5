"""Attention probabilities computed explicitly, for the algorithms that score
rows by the attention of real queries (the fused kernel never materialises
them), in tiles of queries, and the buffer of the newest queries those
algorithms keep."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

# float32 elements of one tile of logits (16 MiB; on SmolLM2's 9 heads, 64
# queries against 7,281 rows): callers evaluate a tile before the next
TILE_ELEMENTS = 1 << 22


def query_tiles(first: int, end: int, per_query: int, budget: int | None = None):
    """(start, stop) ranges covering queries first..end, each of at most
    `budget` (TILE_ELEMENTS) elements at `per_query` a query (at least one)."""
    step = max(1, (budget or TILE_ELEMENTS) // max(1, per_query))
    return [(s, min(s + step, end)) for s in range(first, end, step)]


def query_probs(q, keys, pos, qstart: int, scale):
    """Logits and probabilities [B, Hkv, G, L, T] (float32) of queries q
    [B, Hq, L, D] at positions qstart.. over rows at positions pos [B, Hkv, T],
    causal on the true positions (hidden logits are -inf)."""
    B, Hq, L, D = q.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    qg = q.reshape(B, Hkv, G * L, D).astype(mx.float32)
    if hasattr(keys, "logits"):  # quantized rows, read in place (qview.py)
        logits = keys.logits(qg).astype(mx.float32) * scale
    else:
        logits = (qg @ keys.astype(mx.float32).swapaxes(-1, -2)) * scale
    logits = logits.reshape(B, Hkv, G, L, T)
    qpos = mx.arange(qstart, qstart + L, dtype=mx.int32)
    visible = pos[:, :, None, None, :] <= qpos[None, None, None, :, None]
    logits = mx.where(visible, logits, -mx.inf)
    return logits, softmax(logits)


def softmax(logits: mx.array) -> mx.array:
    """mx.softmax over the last axis of float32 logits. On the CPU through
    numpy: mlx's CPU exp is scalar, ~25x slower than numpy's vectorised one on
    these x86 machines (docs/results.md, "Softmax on the CPU"), and a tile's
    softmax was most of kvzip's reconstruction."""
    if mx.default_device().type != mx.cpu:
        return mx.softmax(logits, axis=-1)
    a = np.array(logits, dtype=np.float32)  # a copy, made in place below
    with np.errstate(invalid="ignore"):  # a row with nothing visible: NaN, as mlx
        a -= a.max(axis=-1, keepdims=True)
        np.exp(a, out=a)
        a /= a.sum(axis=-1, keepdims=True)
    return mx.array(a)


def newest_queries(buffer, q: mx.array, n: int) -> mx.array:
    """The last `n` queries of `buffer` (or None) followed by q, along axis 2
    (copied out: a slice would keep a prefill chunk's queries alive)."""
    buf = q if buffer is None else mx.concatenate([buffer, q], axis=2)
    return mx.contiguous(buf[:, :, -n:]) if buf.shape[2] > n else buf
