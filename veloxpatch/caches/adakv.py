"""`adakv` (Feng et al., 2024): SnapKV scoring with the budget shared across
the KV heads of a layer, so focused heads give rows to dispersed ones.

This is `snapkv` with `head_budget="adaptive"` (the allocation lives in
`eviction.py`, where every scoring algorithm can use it): over the prefix
(window excluded), take the layer-wide top H x (budget - w) scores of all heads;
c_h is how many fall in head h; head h keeps round(c_h (1 - alpha) + alpha
(budget - w)) prefix rows plus the window. Heads are stored padded to the largest
head, padding masked out and counted in nbytes. On a sharded model the heads of
every rank compete (`sharding.py`).
"""

from __future__ import annotations

import dataclasses

from ..errors import OptionError
from .eviction import head_budgets
from .snapkv import SnapKVCache, SnapKVOptions

__all__ = ["AdaKVCache", "AdaKVOptions", "head_budgets"]


@dataclasses.dataclass
class AdaKVOptions(SnapKVOptions):
    """snapkv's options with `head_budget` "adaptive"; `alpha`: floor, the
    fraction of the uniform budget every head keeps (default 0.2)."""

    head_budget: str = "adaptive"

    def __post_init__(self):
        if self.head_budget != "adaptive":
            raise OptionError(
                "adakv is snapkv with head_budget='adaptive'; for uniform "
                f"budgets use snapkv (got head_budget={self.head_budget!r})"
            )
        super().__post_init__()


class AdaKVCache(SnapKVCache):
    name = "adakv"
    batchable = True  # one cache per sequence (caches/batch.py)
    summary = "snapkv scores, budget shared across a layer's KV heads (alpha floor)"
    Options = AdaKVOptions
