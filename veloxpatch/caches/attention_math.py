"""Attention in tiles of queries: probabilities computed explicitly, for the
algorithms that score rows by the attention of real queries (the fused kernel
never materialises them), the fused kernel itself on the CPU (where it does),
and the buffer of the newest queries those algorithms keep."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

# float32 elements of one tile of logits (16 MiB; on SmolLM2's 9 heads, 64
# queries against 7,281 rows): callers evaluate a tile before the next
TILE_ELEMENTS = 1 << 22
# scores of one tile of the CPU's fused attention: its kernel holds about four
# copies (16 MiB); as fast as untiled at 2,048 x 4,096 (docs/results.md)
FUSED_TILE_ELEMENTS = 1 << 20


def query_tiles(first: int, end: int, per_query: int, budget: int | None = None):
    """(start, stop) ranges covering queries first..end, each of at most
    `budget` (TILE_ELEMENTS) elements at `per_query` a query (at least one)."""
    step = max(1, (budget or TILE_ELEMENTS) // max(1, per_query))
    return [(s, min(s + step, end)) for s in range(first, end, step)]


def fused_attention(q, keys, values, scale, mask):
    """mlx's fused attention of q [B, Hq, L, D] over keys [B, Hkv, S, D]. On
    the CPU it materialises the call's [B, Hq, L, S] scores, so a long call
    runs in tiles of at most FUSED_TILE_ELEMENTS scores, each over the rows its
    queries can see ("causal": up to its last query), each after the previous
    (mx.depends: mlx would otherwise schedule every tile's scores at once).
    `mask`: as mlx's, or a function of (first, stop) giving the mask of those
    queries (built per tile)."""
    B, Hq, L, _ = q.shape
    S = keys.shape[2]
    if mx.default_device() != mx.cpu or B * Hq * L * S <= FUSED_TILE_ELEMENTS:
        m = mask(0, L) if callable(mask) else mask
        return mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=scale, mask=m
        )
    outs = []
    for a, b in query_tiles(0, L, B * Hq * S, FUSED_TILE_ELEMENTS):
        part = q[:, :, a:b] if not outs else mx.depends(q[:, :, a:b], outs[-1])
        k, v, m = keys, values, mask
        if isinstance(mask, str):  # "causal": the rows after the tile's last query go
            k, v = keys[:, :, : S - L + b], values[:, :, : S - L + b]
        elif callable(mask):
            m = mask(a, b)
        elif mask is not None and mask.shape[-2] == L:
            m = mask[..., a:b, :]
        outs.append(
            mx.fast.scaled_dot_product_attention(part, k, v, scale=scale, mask=m)
        )
    return mx.concatenate(outs, axis=2)


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
