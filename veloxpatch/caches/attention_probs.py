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

from .attention_math import query_probs
from .eviction import EvictingCache


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
