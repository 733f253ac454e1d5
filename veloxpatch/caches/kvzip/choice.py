"""kvzip's choice of rows: one threshold over every (layer, KV head, position)
of the model (or one per layer), each head's best `floor` x budget kept first,
the budget counting rows held (heads are stored padded to their layer's largest).
"""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import numpy as np

from ...errors import OptionError
from ..eviction import EvictionOptions
from ..options import check_bool, check_int, check_number, option


@dataclasses.dataclass
class ModelWideOptions(EvictionOptions):
    """Options of the algorithms that choose rows over the whole model at once
    (kvzip, kvzap's budget mode). `floor`: fraction of the budget every head
    keeps at least. `tail`: the prompt's newest queries that also rank rows at
    the choice (the maximum of their probability and the score): what a
    continuation reads. `window`: newest rows kept while decoding, cut back
    every `window` tokens by SnapKV's score under the last `window` queries.
    `layerwise`: one choice per layer instead (a pipeline-split model's only
    way). Measured defaults: docs/results.md."""

    floor: float = option(0.5, check_number, 0, 1)
    tail: int = option(32, check_int, 0, 2**31 - 1)  # a slice bound: mlx takes int32
    window: int = option(32, check_int, 0)
    layerwise: bool = option(False, check_bool)
    own_head_budgets = True  # the choice shares rows among heads itself

    def chooses_over_layers(self) -> bool:
        """Whether one choice spans every layer (else each layer chooses)."""
        return not self.layerwise

    split_hint = "use layerwise=True"  # what a pipeline-split model can take

    def load(self, model, dims) -> None:
        """Loads the files the options name, checked against `model` (kvzap's
        scorer), once the layers are known to fit the choice."""

    def bind(self, model, dims):
        shards = getattr(dims, "shards", None)
        split = shards is not None and shards.num_layers is not None
        if split and self.chooses_over_layers():
            raise OptionError(
                "one choice over all layers needs every layer in this process; "
                f"on a pipeline-split model {self.split_hint}"
            )
        self.load(model, dims)
        return super().bind(model, dims)


def model_wide_holds(held, options, heads: int, head_dim: int, dtype_size: int):
    """`held` (a `kv_budget.Holds`) with what kvzip and kvzap hold besides their
    rows: each kept row's float32 score (a later choice reads it), the decode
    window's queries (the tail's are gone once the prompt ends), and the
    generated rows until the next cut."""
    queries = heads * options.window * head_dim * dtype_size
    return held._replace(decode_rows=options.window, row_bytes=4, side=queries)


def compress_together(caches: list) -> None:
    """One threshold over every (layer, KV head, position) of kvzip `caches` (or one
    per layer with `layerwise`), sinks, the `recent` newest rows and each head's
    best `floor` x budget rows kept first (scores first raised by the `tail`
    queries, `KVzipCache.raise_tail_scores`). Heads are stored padded to their
    layer's largest, so a head below it fills the padding with its next best
    rows: each layer keeps the rows its largest head needs, in every head, and
    the budget counts rows held:
    the lowest threshold whose layers hold at most budget x layers x KV heads."""
    o = caches[0].options
    for c in caches:
        c.raise_tail_scores()
    scores = []
    for c in caches:
        s = c.shards.all_heads(c.row_scores())  # [B, H, T] every head
        pos = c.shards.all_heads(c.positions_view())
        s = mx.where(pos < o.sinks, mx.inf, s)
        if o.recent_rows():  # the newest rows (kvzip: where a continuation starts)
            s = mx.where(pos >= c.offset - o.recent_rows(), mx.inf, s)
        floor = min(s.shape[-1], math.ceil(o.floor * o.budget))
        if floor:
            kth = mx.sort(s, axis=-1)[..., -floor][..., None]
            s = mx.where(s >= kth, mx.inf, s)  # each head's best `floor`
        scores.append(s)
    groups = [[i] for i in range(len(caches))] if o.layerwise else [range(len(caches))]
    for group in groups:
        part = [scores[i] for i in group]
        rows = layer_rows(part, o.budget * sum(s.shape[1] for s in part))
        for i, n in zip(group, rows):
            caches[i].keep_counted(caches[i].shards.my_heads(scores[i]), n)


def layer_rows(scores: list, total: int) -> list[int]:
    """Rows per layer (the same in each head) for the lowest threshold t whose
    cost, sum over layers of heads x the largest head's count of scores >= t,
    stays within `total` (batch item 0 decides: B is 1 or equal rows)."""
    per = [np.array(s[0].astype(mx.float32)) for s in scores]  # [H, T] each
    ranked = [-np.sort(-p, axis=-1) for p in per]  # best first, per head

    def rows_at(t):
        return [int((r >= t).sum(-1).max()) for r in ranked]

    def cost(t):
        return sum(n * r.shape[0] for n, r in zip(rows_at(t), ranked))

    cands = np.unique(np.concatenate([r.reshape(-1) for r in ranked]))[::-1]
    lo, hi = 0, len(cands) - 1  # the largest index still within total
    if cost(cands[0]) > total:
        hi = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(cands[mid]) <= total:
            lo = mid
        else:
            hi = mid - 1
    return [max(1, n) for n in rows_at(cands[lo])]
