"""`knorm` (Devoto et al., 2024): keep the keys with the lowest L2 norm per KV head.

Low-norm keys tend to receive high attention. RoPE is a rotation, so the norm of
the stored (rotated) key equals that of the pre-RoPE key. Each row's norm is
computed once, when the row arrives (with `kv_bits`: of the key before it is
quantized), and follows its row through eviction.
"""

import dataclasses

import mlx.core as mx

from .eviction import EvictingCache, RecentOptions


@dataclasses.dataclass
class KNormOptions(RecentOptions):
    """`recent`: newest rows protected from eviction (`RecentOptions`)."""


class KNormCache(EvictingCache):
    name = "knorm"
    row_arrays = ("norms",)
    batchable = True  # one cache per sequence (caches/batch.py)
    summary = "lowest key L2 norm per KV head, sinks protected (no queries needed)"
    Options = KNormOptions

    @classmethod
    def holds(cls, options, heads, head_dim, dtype_size):
        held = super().holds(options, heads, head_dim, dtype_size)
        return held._replace(row_bytes=4)  # each row's key norm, float32

    def __init__(self, options=None, layer=0, num_layers=1):
        super().__init__(options, layer, num_layers)
        self.norms = None  # [B, Hkv, rows] minus the L2 norm of each row's key

    def after_attend(self, q, new_rows):
        held = 0 if self.norms is None else self.norms.shape[-1]
        if self.rows > held:  # the rows this call added
            keys = self.newest_keys(self.rows - held).astype(mx.float32)
            add = -mx.linalg.norm(keys, axis=-1)
            self.norms = (
                add
                if self.norms is None
                else mx.concatenate([self.norms, add], axis=-1)
            )
        super().after_attend(q, new_rows)

    def scores(self, q):
        return self.norms
