"""Attention probabilities of real queries, for algorithms that score keys by the
attention they receive (H2O, TOVA, Keyformer).

The fused kernel never materialises probabilities, so these caches still attend
with it (the output is the same as every other cache's) and compute
softmax(q k^T * scale) only for the queries they need: every query of the call
for H2O and Keyformer, the last one for TOVA. They are computed in tiles of
queries, so a prompt chunk never materialises chunk x rows x heads at once.
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx

from .attention_math import query_probs, query_tiles
from .eviction import EvictingCache


class ProbabilityCache(EvictingCache):
    """An evicting cache that hands the attention of real queries to `observe`."""

    observed: ClassVar[str] = "all"  # which of the call's queries: "all" or "last"

    def attention(self, q, keys, values, mask, scale):
        out = super().attention(q, keys, values, mask, scale)
        B, Hq, L, _ = q.shape
        first = 0 if self.observed == "all" else L - 1
        pos = self.positions_view()
        tiles = query_tiles(first, L, B * Hq * keys.shape[2])
        for start, stop in tiles:
            logits, probs = query_probs(
                q[:, :, start:stop], keys, pos, self.offset + start, scale
            )
            self.observe(logits, probs, L)
            if len(tiles) > 1:  # else mlx schedules every tile's probabilities at once
                mx.eval(self.observed_arrays())
        return out

    def observed_arrays(self) -> list[mx.array]:
        """What `observe` accumulates over a call's tiles."""
        return []

    def observe(self, logits: mx.array, probs: mx.array, queries: int) -> None:
        """[B, Hkv, G, l, T] logits and probabilities of l observed queries (one
        tile of a call of `queries`) over every held row (old rows first, then
        the new ones). A call's tiles come in order."""
        raise NotImplementedError
