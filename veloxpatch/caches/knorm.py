"""`knorm` (Devoto et al., 2024): keep the keys with the lowest L2 norm per KV head.

Low-norm keys tend to receive high attention. RoPE is a rotation, so the norm of
the stored (rotated) key equals that of the pre-RoPE key.
"""

import dataclasses

import mlx.core as mx

from .eviction import EvictingCache, EvictionOptions
from .options import check_int


@dataclasses.dataclass
class KNormOptions(EvictionOptions):
    """`recent`: newest rows protected from eviction; default half of what sinks
    leave, (budget - sinks) // 2, as h2o (scripts/results/knorm_recent.json: with
    recent 0 perplexity is 17-33x full, at about half the budget 1.09-1.41x)."""

    recent: int | None = None

    def recent_rows(self):
        return self.recent

    def __post_init__(self):
        if self.recent is None:
            self.recent = self.half_left_by_sinks()
        check_int("recent", self.recent, 0)
        super().__post_init__()


class KNormCache(EvictingCache):
    name = "knorm"
    summary = "lowest key L2 norm per KV head, sinks protected (no queries needed)"
    Options = KNormOptions

    def scores(self, q):
        keys, _ = self._view()
        return -mx.linalg.norm(keys.astype(mx.float32), axis=-1)
