"""What kvzip's generated tokens do after the compressed context: the
compressed size plus `window` generated rows (see `kvzip.py`'s docstring for
`decode="attention"` and `decode="frozen"`)."""

from __future__ import annotations

import mlx.core as mx

from .attention_math import newest_queries, query_probs
from .base import PAD_POSITION
from .snapkv import SnapKVOptions, window_score


class KVzipDecode:
    """Decode-time methods of KVzipCache (an EvictingCache)."""

    @property
    def frozen(self) -> bool:
        return self.options.decode == "frozen"

    def after_attend(self, q, new_rows):
        if self.context_rows is None or self.in_prompt:
            return
        w = self.options.window
        if not self.frozen:  # the newest queries (at least this call's) score rows
            self.decode_queries = newest_queries(self.decode_queries, q, max(w, 1))
        if self.rows <= self._decode_limit() + w:
            return
        if not self.frozen:
            self.evict_to(self.options.budget, self.decode_scores())
            self.decode_rows = self.options.budget
            return
        pos = self.positions_view()
        counts = (pos < self.context_end).sum(-1) + w
        scores = pos.astype(mx.float32)  # context and window are protected
        self.evict_to(int(counts.max().item()), scores, counts)

    def _decode_limit(self) -> int:
        return self.context_rows if self.decode_rows is None else self.decode_rows

    def decode_scores(self) -> mx.array:
        """[B, Hkv, T] SnapKV's score under the buffered decode queries: their
        summed probabilities, max-pooled over 7 positions, mean over the group."""
        keys, _ = self._view()
        q = self.decode_queries
        start = self.offset - q.shape[2]
        _, probs = query_probs(q, keys, self.positions_view(), start, self.scale)
        return window_score(probs, SnapKVOptions.kernel, SnapKVOptions.pool)

    def trim(self, n):
        n = super().trim(n)
        if n:
            self.decode_queries = None  # they may include trimmed tokens
            if self.zscore is not None:
                self.zscore = self.zscore[..., : self.rows]
        return n

    def row_bound(self) -> int:
        if self.context_rows is None:
            return max(self.rows, self.options.budget)
        return self._decode_limit() + self.options.window

    def protected_mask(self, pos):
        if self.context_rows is None:
            return super().protected_mask(pos)
        # after compression: the sinks (or the whole kept context, frozen) and
        # the newest window rows stay
        recent = (pos >= self.offset - self.options.window) & (pos != PAD_POSITION)
        kept = (pos < self.context_end) if self.frozen else (pos < self.options.sinks)
        return kept | recent
