"""`snapkv` (Li et al., 2024): score the prompt by the attention of its last `w`
real queries, keep the best-scored prefix plus the window.

The cache buffers the last `window` post-RoPE queries (after any query scale)
across prefill chunks. When the prompt ends it scores every stored key j as
sum over window queries i of softmax_i(q_i . k_j)[j], pools the scores over
positions (kernel k), averages them over the query heads sharing the KV head,
and keeps the top (budget - window) plus the window. During decode it keeps
buffering queries and recompresses to `budget` once `window` new rows have
accumulated, so memory stays under budget + window.

With `lookahead=k` the prompt-end compression waits for k answer tokens: the
observation window is then the last `window` prompt queries plus the k
answer-time queries, and the k answer rows are kept with the window. Until then
the cache holds the whole prompt.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ..errors import OptionError
from .attention_math import newest_queries, query_probs
from .eviction import EvictingCache, PromptCompressionOptions
from .options import check_int, option

DEFAULT_KERNEL = 7  # SnapKV's pooling width (the paper's)


@dataclasses.dataclass
class SnapKVOptions(PromptCompressionOptions):
    """`window`: observation window of last queries, always kept. `kernel`: odd
    max-pooling width over positions. `sinks`: default 0. `lookahead`: answer
    tokens to wait for before the prompt-end compression. `compress="chunks"`:
    every `chunk` prompt tokens, by the last `window` queries before that point
    (`PromptCompressionOptions`)."""

    sinks: int = option(0, check_int, 0)
    window: int = option(32, check_int, 1)
    kernel: int = option(DEFAULT_KERNEL, check_int, 1)
    lookahead: int = option(0, check_int, 0)

    def recent_rows(self):
        return self.window + self.lookahead

    def __post_init__(self):
        super().__post_init__()
        if self.kernel % 2 == 0:
            raise OptionError(f"kernel must be odd, got {self.kernel}")
        if self.lookahead and self.compress == "chunks":
            raise OptionError(
                "lookahead waits for answer tokens holding the whole prompt; "
                'it needs compress="prompt_end"'
            )
        if self.lookahead * 4 > self.budget:
            # The k answer rows are kept on top of the window: a large k would
            # leave little of the budget to the scored prompt.
            raise OptionError(
                f"lookahead ({self.lookahead}) must be at most budget / 4 "
                f"({self.budget // 4})"
            )


def pool_positions(scores: mx.array, kernel: int) -> mx.array:
    """1-D max pooling along the last axis, 'same' size, zero padding (scores
    >= 0)."""
    if kernel == 1:
        return scores
    T = scores.shape[-1]
    r = min(kernel // 2, T)  # a wider window sees nothing more (zero padding)
    pad = [(0, 0)] * (scores.ndim - 1) + [(r, r)]
    padded = mx.pad(scores, pad)
    out = padded[..., :T]
    for i in range(1, 2 * r + 1):
        out = mx.maximum(out, padded[..., i : i + T])
    return out


def window_score(probs: mx.array, kernel: int) -> mx.array:
    """SnapKV's score [B, Hkv, T] from the probabilities [B, Hkv, G, n, T] of n
    window queries: summed over them, pooled over positions, mean over the group."""
    return pool_positions(probs.sum(axis=3), kernel).mean(axis=2)


def newest_queries_score(cache, q: mx.array) -> mx.array:
    """[B, Hkv, T] SnapKV's score (default kernel) of the rows `cache` holds
    under its newest queries q: how kvzip and kvzap cut while decoding."""
    probs = newest_query_probs(cache, q)
    return window_score(probs, DEFAULT_KERNEL)


def newest_query_probs(cache, q: mx.array) -> mx.array:
    """[B, Hkv, G, n, T] attention of the n newest queries q (those that end
    at the cache's offset) over the rows `cache` holds."""
    keys, _ = cache._view()
    start = cache.offset - q.shape[2]
    _, probs = query_probs(q, keys, cache.positions_view(), start, cache.scale)
    return probs


class SnapKVCache(EvictingCache):
    name = "snapkv"
    prompt_cache_policy = "prompt"
    batchable = True  # one cache per sequence (caches/batch.py)
    summary = "top attention of the last w prompt queries, pooled; + the window"
    note = (
        "lookahead=k waits for k answer tokens and scores with their queries too, "
        "so the answer chooses what is kept. Until then the whole prompt stays in "
        "memory: peak memory is unchanged, memory after k tokens is the budget."
    )
    Options = SnapKVOptions

    @classmethod
    def holds(cls, options, heads, head_dim, dtype_size):
        # the window's queries (and lookahead's); new rows until the next cut
        queries = heads * (options.window + options.lookahead) * head_dim
        held = super().holds(options, heads, head_dim, dtype_size)
        return held._replace(decode_rows=options.window, side=queries * dtype_size)

    def __init__(self, options=None, layer=0, num_layers=1):
        super().__init__(options, layer, num_layers)
        self.window_queries = None  # last `window` post-RoPE queries [B, Hq, w, D]
        self.compressed_rows = None  # rows kept by the last compression
        self.lookahead_left = 0  # answer tokens still to come before compressing

    # ---- hooks ------------------------------------------------------------------
    def after_attend(self, q, new_rows):
        w = self.options.window
        n = w + self.options.lookahead
        self.window_queries = newest_queries(self.window_queries, q, n)
        if self.in_prompt:  # (decode calls of several tokens: speculative decoding)
            return
        if self.lookahead_left:
            self.lookahead_left = max(0, self.lookahead_left - new_rows)
            if not self.lookahead_left and self.rows > self.row_budget():
                self.compress()
        elif self.cut_after_window(self._limit(), self.row_budget(), self.scores):
            self.compressed_rows = self.rows

    def end_prompt(self):
        if self.options.lookahead:
            self.lookahead_left = self.options.lookahead  # each turn waits again
        elif self.rows > self.row_budget():
            self.compress()

    def trim(self, n):
        n = super().trim(n)
        if n and self.window_queries is not None:
            kept = self.window_queries.shape[2] - n
            self.window_queries = self.window_queries[:, :, :kept] if kept > 0 else None
        return n

    @property
    def queries_short(self) -> int:
        # the newest window + lookahead queries, or all if fewer tokens came
        held = 0 if self.window_queries is None else self.window_queries.shape[2]
        want = min(self.offset, self.options.window + self.options.lookahead)
        return max(0, want - held)

    def side_arrays(self):
        side = super().side_arrays()
        return side + [self.window_queries] if self.window_queries is not None else side

    def held_arrays(self):
        held = super().held_arrays()
        return held + [self.window_queries] if self.window_queries is not None else held

    # ---- scoring -----------------------------------------------------------------
    def _limit(self) -> int:
        if self.compressed_rows is not None:
            return self.compressed_rows
        return self.row_budget()

    def row_bound(self) -> int:
        if self.lookahead_left:  # the whole prompt is held until the answer starts
            return self.rows
        return self._limit() + self.options.window

    def window_probs(self) -> mx.array:
        """[B, Hkv, G, w, T] attention of the buffered queries over stored rows."""
        return newest_query_probs(self, self.window_queries)

    def scores(self, q=None) -> mx.array:
        """SnapKV score per stored row [B, Hkv, T]: summed window attention
        (answer-time queries included), pooled over positions, averaged over
        the GQA group."""
        return window_score(self.window_probs(), self.options.kernel)

    def compress(self) -> None:
        n_keep = self.row_budget()
        self.evict_to(n_keep, self.scores())
        self.compressed_rows = self.rows

    def extra_state(self):
        return (
            {}
            if self.window_queries is None
            else {"window_queries": self.window_queries}
        )

    def load_extra_state(self, st):
        self.window_queries = st.get("window_queries")

    def extra_meta(self):
        return {
            "compressed_rows": self.compressed_rows,
            "lookahead_left": self.lookahead_left,
        }

    def load_extra_meta(self, m):
        self.compressed_rows = m.get("compressed_rows")
        self.lookahead_left = int(m.get("lookahead_left", 0))
