"""`tova` (Oren et al., 2024): token omission via attention.

When over budget, drop the rows the current last query attends to least,
averaged over all query heads of the layer (every head keeps the same tokens;
on a sharded model the heads of every rank).
Works in prefill (the last query of the chunk) and every decode step; sinks
protected.
"""

from __future__ import annotations

import mlx.core as mx

from .attention_probs import ProbabilityCache


class TOVACache(ProbabilityCache):
    name = "tova"
    prompt_cache_policy = "none"
    batchable = True  # one cache per sequence (caches/batch.py)
    summary = "attention of the current last query, mean over all heads"
    observed = "last"

    def observe(self, logits, probs, queries):
        self.last_probs = probs[:, :, :, -1, :]  # [B, Hkv, G, T]

    def after_attend(self, q, new_rows):
        super().after_attend(q, new_rows)
        self.last_probs = None  # read by this call's eviction only: not held

    def scores(self, q):
        B, Hkv, _, T = self.last_probs.shape
        # over every query head of the layer, those of other ranks included
        mean = self.shards.all_heads(self.last_probs).mean(axis=(1, 2))
        return mx.broadcast_to(mean[:, None, :], (B, Hkv, T))
