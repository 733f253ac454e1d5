"""`expected_attention` (Devoto et al., 2025): score each stored key by the
attention that future queries are expected to give it, from the distribution of
the context's own queries. Question-agnostic: it never needs the question.

Statistics: every real query at a position >= `sinks` (prompt and decode) adds
to the per-query-head mean mu and covariance Sigma of the pre-RoPE queries
(after any query scale, Ministral 3's attn_scale: a scalar per position, which
commutes with the rotation). They are merged chunk by chunk (Chan et al.), so
memory is O(D^2) per query head whatever the context length.

Scoring: future queries sit at positions t in [T, T + n_future) after the
T tokens seen. With R-bar the mean over those t of the layer's rotation to t
(the layer's own `rope` applied to the identity basis, so scaled ropes need
nothing special; `mean_rotation`), a query head's expected post-RoPE query is
mu-bar = R-bar mu with covariance Sigma-bar = R-bar Sigma R-bar^T, and a
Gaussian query gives key k the expected logit
    s mu-bar . k + s^2 k^T Sigma-bar k / 2
with s the layer's softmax scale (the paper writes 1/sqrt(d) and 1/(2d), which
is this for s = 1/sqrt(d)). Score = softmax of that over the stored keys at
positions >= `sinks`, averaged over the query heads of the GQA group, times the
value's L2 norm.

When: the prompt is held whole and compressed when it ends (like snapkv, so the
kept set does not depend on `prefill_step_size`) to `budget` rows: the sinks,
the newest `window` rows and the best-scored rest. During decode the statistics
keep growing and the cache recompresses to `budget` once `window` new rows have
accumulated, so it holds at most budget + window rows.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from .base import PAD_POSITION
from .eviction import EvictingCache, PromptCompressionOptions
from .options import check_int, option

MAX_FUTURE = 1 << 16
ROPE_CHUNK = 256  # positions per rope call in `mean_rotation`


@dataclasses.dataclass
class ExpectedAttentionOptions(PromptCompressionOptions):
    """`n_future`: future positions the rotation is averaged over (paper and
    kvpress: 512). `sinks`: first tokens, kept and left out of the statistics
    (kvpress: 4). `window`: newest rows kept at every compression, and how many
    decode rows accumulate before recompressing (kvpress protects none).
    `compress="chunks"`: every `chunk` prompt tokens, with the statistics of
    the queries seen so far (`PromptCompressionOptions`)."""

    window: int = option(16, check_int, 0)
    n_future: int = option(512, check_int, 1, MAX_FUTURE)

    def recent_rows(self):
        return self.window


def mean_rotation(rope, start: int, n: int, dim: int) -> mx.array:
    """R-bar [dim, dim] (float32): the mean over positions start .. start + n - 1
    of the linear map `rope` applies at each position, so that the mean of
    rope(x at t) over those t is R-bar x (x a column vector)."""
    eye = mx.eye(dim, dtype=mx.float32)[:, None, None, :]  # [dim, 1, 1, dim]
    total = mx.zeros((dim, dim), mx.float32)
    for first in range(0, n, ROPE_CHUNK):
        c = min(ROPE_CHUNK, n - first)
        basis = mx.broadcast_to(eye, (dim, 1, c, dim))
        # row j at position t: (R_t e_j)^T, the j-th column of R_t
        rotated = rope(basis, offset=start + first)
        total = total + rotated[:, 0].astype(mx.float32).sum(axis=1)
    return total.T / n


def merge_moments(count: int, mean, m2, x: mx.array):
    """Add the vectors x [B, H, L, D] to a running count, mean [B, H, D] and sum
    of centred outer products m2 [B, H, D, D] (Chan et al.'s pairwise update)."""
    x = x.astype(mx.float32)
    n = x.shape[2]
    x_mean = x.mean(axis=2)
    centred = x - x_mean[:, :, None]
    x_m2 = centred.swapaxes(-1, -2) @ centred
    if not count:
        return n, x_mean, x_m2
    total = count + n
    delta = x_mean - mean
    mean = mean + delta * (n / total)
    outer = delta[..., :, None] * delta[..., None, :]
    return total, mean, m2 + x_m2 + outer * (count * n / total)


class ExpectedAttentionCache(EvictingCache):
    name = "expected_attention"
    # its query statistics keep every query seen, a trim cannot take one back
    prompt_cache_policy = "none"
    trim_keeps_queries = True
    batchable = True  # one cache per sequence (caches/batch.py)
    summary = "expected attention of future queries (context query statistics) x |v|"
    note = (
        "Question-agnostic: compresses when the prompt ends, from the prompt's "
        "own queries. Holds a query mean and covariance per query head (counted "
        "in nbytes); the whole prompt is held until it ends."
    )
    Options = ExpectedAttentionOptions

    @classmethod
    def holds(cls, options, heads, head_dim, dtype_size):
        # float32 query mean and covariance; new rows until the next cut
        side = heads * (head_dim + head_dim**2) * 4
        held = super().holds(options, heads, head_dim, dtype_size)
        return held._replace(decode_rows=options.window, side=side)

    def __init__(self, options=None, layer=0, num_layers=1):
        super().__init__(options, layer, num_layers)
        self.q_count = 0  # queries in the statistics
        self.q_mean = None  # [B, Hq, D] float32
        self.q_m2 = None  # [B, Hq, D, D] sum of centred outer products
        self.rope = None  # the layer's rope, known once a call was seen
        self.compressed_rows = None  # rows kept by the last compression

    # ---- hooks ------------------------------------------------------------------
    def attend(self, q, k, v, *, rope, scale, query_scale=None):
        self.rope = rope  # before the base runs a pending end_prompt
        return super().attend(q, k, v, rope=rope, scale=scale, query_scale=query_scale)

    def rotate(self, q, k, rope, offset, query_scale):
        scaled = q if query_scale is None else q * query_scale
        skip = max(0, self.options.sinks - offset)
        if skip < q.shape[2]:
            self.q_count, self.q_mean, self.q_m2 = merge_moments(
                self.q_count, self.q_mean, self.q_m2, scaled[:, :, skip:]
            )
        return super().rotate(q, k, rope, offset, query_scale)

    def after_attend(self, q, new_rows):
        if self.cut_after_window(self._limit(), self.row_budget(), self.scores):
            self.compressed_rows = self.rows

    def end_prompt(self):
        # Without a rope yet (a loaded cache ended by Patch.end_prompt) the first
        # decode call compresses instead.
        if self.rope is not None and self.rows > self.row_budget():
            self.compress()

    def _limit(self) -> int:
        if self.compressed_rows is not None:
            return self.compressed_rows
        return self.head_bound(self.row_budget())

    def row_bound(self) -> int:
        return self._limit() + self.options.window

    def compress(self) -> None:
        self.evict_to(self.row_budget(), self.scores())
        self.compressed_rows = self.rows

    # ---- scoring -----------------------------------------------------------------
    def query_statistics(self) -> tuple[mx.array, mx.array]:
        """mu-bar [B, Hq, D] and Sigma-bar [B, Hq, D, D]: the statistics rotated
        by the mean rotation over the next `n_future` positions."""
        D = self.q_mean.shape[-1]
        R = mean_rotation(self.rope, self.offset, self.options.n_future, D)
        mu = self.q_mean @ R.T
        cov = R @ (self.q_m2 / self.q_count) @ R.T
        return mu, cov

    def scores(self, q=None) -> mx.array:
        """Expected attention per stored row [B, Hkv, T] (see the module doc)."""
        keys, values = self._view()
        if hasattr(keys, "rows_dense"):  # quantized rows (qview.py)
            keys, values = keys.rows_dense()
        keys = keys.astype(mx.float32)
        B, Hkv, T, D = keys.shape
        mu, cov = self.query_statistics()
        G = mu.shape[1] // Hkv
        mu = mu.reshape(B, Hkv, G, 1, D)
        cov = cov.reshape(B, Hkv, G, D, D)
        k = keys[:, :, None]  # [B, Hkv, 1, T, D]
        s = self.scale
        mean_term = (mu @ k.swapaxes(-1, -2))[..., 0, :]  # [B, Hkv, G, T]
        quad = ((k @ cov) * k).sum(axis=-1)
        logits = s * mean_term + (s * s / 2) * quad
        pos = self.positions_view()
        scored = (pos != PAD_POSITION) & (pos >= self.options.sinks)
        logits = mx.where(scored[:, :, None], logits, -mx.inf)
        probs = mx.softmax(logits, axis=-1).mean(axis=2)
        norms = mx.linalg.norm(values.astype(mx.float32), axis=-1)
        return mx.where(scored, probs * norms, 0.0)

    # ---- contract ----------------------------------------------------------------
    def side_arrays(self):
        side = super().side_arrays()
        return side + [self.q_mean, self.q_m2] if self.q_count else side

    def held_arrays(self):
        held = super().held_arrays()
        return held + [self.q_mean, self.q_m2] if self.q_count else held

    def extra_state(self):
        return {"q_mean": self.q_mean, "q_m2": self.q_m2} if self.q_count else {}

    def load_extra_state(self, st):
        self.q_mean, self.q_m2 = st.get("q_mean"), st.get("q_m2")

    def extra_meta(self):
        return {"q_count": self.q_count, "compressed_rows": self.compressed_rows}

    def load_extra_meta(self, m):
        self.q_count = int(m.get("q_count", 0))
        self.compressed_rows = m.get("compressed_rows")
