"""`full`: keep everything. The parity reference: same storage and the same fused
attention call as mlx-lm's KVCache, so the patched model is bit-identical."""

from .base import VeloxCache


class FullCache(VeloxCache):
    name = "full"
    summary = "keeps everything; bit-identical to unpatched mlx-lm (parity reference)"

    def is_trimmable(self):
        return True  # speculative decoding and trim_prompt_cache rely on this

    def trim(self, n):
        n = min(self.rows, n)
        self.rows -= n
        self.offset -= n
        return n
