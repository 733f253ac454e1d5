"""`full`: keep everything. The parity reference: same storage and the same fused
attention call as mlx-lm's KVCache, so the patched model is bit-identical."""

from .base import VeloxCache


class FullCache(VeloxCache):
    name = "full"
    summary = "keeps everything; bit-identical to unpatched mlx-lm (parity reference)"
    batchable = True
    batch_layout = "full"  # mlx-lm's own BatchKVCache: bit-identical batches
