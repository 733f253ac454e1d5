"""Attention probabilities of real queries, for algorithms that score keys by the
attention they receive (H2O, TOVA, Keyformer).

The fused kernel never materialises probabilities, so these caches still attend
with it (the output is the same as every other cache's) and compute
softmax(q k^T * scale) only for the queries they need: every query of the call
for H2O and Keyformer, the last one for TOVA. O(L x T) per head, or O(T).
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx

from .eviction import EvictingCache


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
    return logits, mx.softmax(logits, axis=-1)


def newest_queries(buffer, q: mx.array, n: int) -> mx.array:
    """The last `n` queries of `buffer` (or None) followed by q, along axis 2."""
    buf = q if buffer is None else mx.concatenate([buffer, q], axis=2)
    return buf[:, :, -n:] if buf.shape[2] > n else buf


class ProbabilityCache(EvictingCache):
    """An evicting cache that hands the attention of real queries to `observe`."""

    observed: ClassVar[str] = "all"  # which of the call's queries: "all" or "last"

    def attention(self, q, keys, values, mask, scale):
        out = super().attention(q, keys, values, mask, scale)
        first = 0 if self.observed == "all" else q.shape[2] - 1
        logits, probs = query_probs(
            q[:, :, first:], keys, self.positions_view(), self.offset + first, scale
        )
        self.observe(logits, probs)
        return out

    def observe(self, logits: mx.array, probs: mx.array) -> None:
        """[B, Hkv, G, L, T] logits and probabilities of the observed queries over
        every held row (old rows first, then the new ones)."""
        raise NotImplementedError
