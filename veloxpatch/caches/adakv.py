"""`adakv` (Feng et al., 2024): SnapKV scoring with the budget shared across
the KV heads of a layer, so focused heads give rows to dispersed ones.

A preset: `snapkv` with `head_budget="adaptive"`. The allocation is the
`head_budget="adaptive"` wrapper of `eviction.py`, which any scoring algorithm
takes (as kvpress's AdaKVPress wraps any scorer); its floor `alpha` and its
rule are documented there.
"""

from __future__ import annotations

import dataclasses

from .eviction import head_budgets
from .options import check_choice, option
from .snapkv import SnapKVCache, SnapKVOptions

__all__ = ["AdaKVCache", "AdaKVOptions", "head_budgets"]


@dataclasses.dataclass
class AdaKVOptions(SnapKVOptions):
    """snapkv's options with `head_budget` "adaptive" (for uniform budgets use
    snapkv)."""

    head_budget: str = option("adaptive", check_choice, ("adaptive",))


class AdaKVCache(SnapKVCache):
    name = "adakv"
    batchable = True  # one cache per sequence (caches/batch.py)
    summary = "snapkv scores, budget shared across a layer's KV heads (alpha floor)"
    Options = AdaKVOptions
