"""`full`: keep everything. The parity reference: same storage and the same fused
attention call as mlx-lm's KVCache, so the patched model is bit-identical."""

import mlx.core as mx

from .base import VeloxCache
from .batch import sequence_batch
from .batch_full import FullBatch


class FullCache(VeloxCache):
    name = "full"
    summary = "keeps everything; bit-identical to unpatched mlx-lm (parity reference)"
    batchable = True

    def attention(self, q, keys, values, mask, scale):
        # mlx-lm's very call, untiled: bit for bit the unpatched model
        return mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=scale, mask=mask
        )

    @classmethod
    def batch_of(cls, caches):
        # mlx-lm's layout has no per-sequence hook for a probe: those go one by one
        if all(c.probe is None for c in caches):
            return FullBatch.merge(caches)
        return sequence_batch(caches)
