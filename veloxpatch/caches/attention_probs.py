"""Attention with explicit probabilities, for algorithms that score keys by the
attention real queries give them (H2O, TOVA, Keyformer).

The fused kernel never materialises probabilities, so these caches compute
softmax(q k^T * scale) themselves for the call's queries over the stored rows
plus the new ones: O(L x T) per head, the same order as the attention itself.
"""

from __future__ import annotations

import mlx.core as mx

from .eviction import EvictingCache


def visible(pos: mx.array, offset: int, L: int) -> mx.array:
    """[B, Hkv, L, T]: query i (at offset + i) may see row t (causal on positions)."""
    qpos = mx.arange(offset, offset + L, dtype=mx.int32)
    return pos[:, :, None, :] <= qpos[None, None, :, None]


def attention_with_logits(q, keys, values, mask, scale):
    """Returns (output [B, Hq, L, D], logits and probabilities [B, Hkv, G, L, T]
    in float32, hidden logits at -inf). Output in the input dtype."""
    B, Hq, L, D = q.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    qg = q.reshape(B, Hkv, G * L, D).astype(mx.float32)
    logits = (qg @ keys.astype(mx.float32).swapaxes(-1, -2)) * scale
    logits = logits.reshape(B, Hkv, G, L, T)
    logits = mx.where(mask[:, :, None], logits, -mx.inf)
    probs = mx.softmax(logits, axis=-1)
    out = probs.reshape(B, Hkv, G * L, T) @ values.astype(mx.float32)
    return out.reshape(B, Hq, L, -1).astype(q.dtype), logits, probs


class ProbabilityCache(EvictingCache):
    """An evicting cache whose attention also hands the logits to `observe`."""

    def attention(self, q, keys, values, mask, scale):
        L = q.shape[2]
        offset = self.offset  # not yet advanced: the new rows start here
        out, logits, probs = attention_with_logits(
            q, keys, values, visible(self.positions_view(), offset, L), scale
        )
        self.observe(logits, probs)
        return out

    def observe(self, logits: mx.array, probs: mx.array) -> None:
        """[B, Hkv, G, L, T] logits and probabilities of this call's queries over
        every held row (old rows first, then the new ones)."""
        raise NotImplementedError
