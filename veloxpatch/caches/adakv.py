"""`adakv` (Feng et al., 2024): SnapKV scoring with the budget shared across
the KV heads of a layer, so focused heads give rows to dispersed ones.

Over the prefix (window excluded), take the layer-wide top H x (budget - w)
scores of all heads; c_h is how many fall in head h; head h keeps
round(c_h (1 - alpha) + alpha (budget - w)) prefix rows plus the window. Heads
are stored padded to the largest head, padding masked out and counted in nbytes.
On a sharded model the heads of every rank compete (`sharding.py`).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from .base import PAD_POSITION
from .options import check_number
from .snapkv import SnapKVCache, SnapKVOptions


@dataclasses.dataclass
class AdaKVOptions(SnapKVOptions):
    """`alpha`: floor, the fraction of the uniform budget every head keeps."""

    alpha: float = 0.2

    def __post_init__(self):
        check_number("alpha", self.alpha, 0, 1)
        super().__post_init__()


def head_budgets(scores: mx.array, prefix: int, alpha: float) -> mx.array:
    """Prefix rows per head [B, H] from prefix scores [B, H, T]; rows sum to
    H * prefix per batch item (largest remainders, ties to the lower head)."""
    B, H, T = scores.shape
    flat = scores.reshape(B, H * T)
    total = min(H * prefix, H * T)
    top = mx.argpartition(-flat, kth=total - 1, axis=-1)[:, :total] // T
    counts = (top[:, :, None] == mx.arange(H)[None, None, :]).sum(axis=1)
    exact = counts.astype(mx.float32) * (1 - alpha) + alpha * prefix
    exact = mx.minimum(exact, T)
    base = mx.floor(exact).astype(mx.int32)
    short = total - base.sum(axis=-1, keepdims=True)
    remainder = exact - base
    rank = mx.argsort(mx.argsort(-remainder, axis=-1), axis=-1)
    return base + (rank < short).astype(mx.int32)


class AdaKVCache(SnapKVCache):
    name = "adakv"
    summary = "snapkv scores, budget shared across a layer's KV heads (alpha floor)"
    Options = AdaKVOptions

    def compress(self) -> None:
        o = self.options
        scores = self.scores()
        pos = self.positions_view()
        # Heads compete only for the prefix: sinks and window are kept anyway.
        free = (pos != PAD_POSITION) & ~self.protected_mask(pos)
        prefix_budget = o.budget - o.protected()
        # every KV head of the layer competes, those of other ranks included
        competing = self.shards.all_heads(mx.where(free, scores, -mx.inf))
        counts = head_budgets(competing, prefix_budget, o.alpha) + o.protected()
        # every rank pads to the layer's largest head, as unsharded
        n_keep = int(counts.max().item())
        self.evict_to(n_keep, scores, self.shards.my_heads(counts))
        self.compressed_rows = self.rows
