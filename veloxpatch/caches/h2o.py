"""`h2o` (Zhang et al., 2023): heavy hitters plus recent tokens.

Per KV head, every real query (prefill and decode) adds the attention
probability it gives each key, averaged over the query heads of the group.
When over budget, keep the sinks, the `recent` newest rows and the rows with
the largest accumulated attention. Evicts every call, prefill and decode.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from .attention_probs import ProbabilityCache
from .eviction import RecentOptions


@dataclasses.dataclass
class H2OOptions(RecentOptions):
    """`recent`: newest rows always kept (`RecentOptions`)."""


class H2OCache(ProbabilityCache):
    name = "h2o"
    prompt_cache_policy = "none"
    batchable = True  # one cache per sequence (caches/batch.py)
    summary = "accumulated attention of every real query (heavy hitters) + recent"
    Options = H2OOptions
    row_arrays = ("acc",)
    trim_keeps_queries = True

    @classmethod
    def holds(cls, options, heads, head_dim, dtype_size):
        held = super().holds(options, heads, head_dim, dtype_size)
        return held._replace(row_bytes=4)  # each row's accumulated attention, float32

    def __init__(self, options=None, layer=0, num_layers=1):
        super().__init__(options, layer, num_layers)
        self.acc = None  # [B, Hkv, rows] accumulated attention, float32

    def weights(self, logits, probs, queries=None):
        """What a query contributes to each key: its attention probability."""
        return probs

    def observe(self, logits, probs, queries):
        add = self.weights(logits, probs, queries).mean(axis=2).sum(axis=2)
        if self.acc is not None:
            old = self.acc.shape[-1]
            add = mx.concatenate([add[..., :old] + self.acc, add[..., old:]], axis=-1)
        self.acc = add

    def observed_arrays(self):
        return [self.acc]

    def scores(self, q):
        return self.acc
