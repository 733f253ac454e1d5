"""`tova` (Oren et al., 2024): token omission via attention.

When over budget, drop the rows the current last query attends to least,
averaged over all query heads of the layer (every head keeps the same tokens).
Works in prefill (the last query of the chunk) and every decode step; sinks
protected.
"""

from __future__ import annotations

import mlx.core as mx

from .attention_probs import ProbabilityCache


class TOVACache(ProbabilityCache):
    name = "tova"
    summary = "attention of the current last query, mean over all heads"
    observed = "last"

    def observe(self, logits, probs):
        last = probs[:, :, :, -1, :]  # [B, Hkv, G, T]
        B, Hkv = last.shape[:2]
        mean = last.mean(axis=(1, 2))  # over every query head of the layer
        self.last_scores = mx.broadcast_to(mean[:, None, :], (B, Hkv, mean.shape[-1]))

    def scores(self, q):
        return self.last_scores
