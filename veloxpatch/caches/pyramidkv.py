"""`pyramidkv` (Cai et al., 2024): SnapKV scoring with a budget tapered over
layers, larger in lower layers, whose mean over layers is `budget`.

Prefix budget of layer l: k_l = max - l (max - min) / (L - 1) with
min = (budget - w) / beta and max = 2 (budget - w) - min; the window is added
to each. Rounding is distributed so the layers' rows sum to budget x L exactly.
l and L count the whole model's layers, also on a pipeline stage that holds
only some of them.
"""

from __future__ import annotations

import dataclasses
import math

from .options import check_number, option
from .snapkv import SnapKVCache, SnapKVOptions


@dataclasses.dataclass
class PyramidKVOptions(SnapKVOptions):
    """`beta`: how steep the pyramid is (top layer keeps (budget - w) / beta)."""

    beta: float = option(20.0, check_number, 1)


def pyramid_budgets(
    budget: int, window: int, num_layers: int, beta: float, protected: int = 0
) -> list[int]:
    """Rows kept per layer (window included), summing to budget * num_layers;
    none under `protected` (sinks and window, which a layer never evicts):
    the rows a steep pyramid's top layers lack come off its largest."""
    prefix = budget - window
    if num_layers == 1:
        return [budget]
    lo = prefix / beta
    hi = 2 * prefix - lo
    exact = [hi - layer * (hi - lo) / (num_layers - 1) for layer in range(num_layers)]
    counts = [math.floor(x) for x in exact]
    short = prefix * num_layers - sum(counts)
    by_remainder = sorted(range(num_layers), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[:short]:
        counts[i] += 1
    rows = [c + window for c in counts]
    lacking = sum(max(0, protected - r) for r in rows)
    rows = [max(r, protected) for r in rows]
    while lacking:  # budget > protected (checked), so the largest can give
        top = max(range(num_layers), key=lambda i: (rows[i], -i))
        rows[top] -= 1
        lacking -= 1
    return rows


class PyramidKVCache(SnapKVCache):
    name = "pyramidkv"
    batchable = True  # one cache per sequence (caches/batch.py)
    summary = "snapkv scores, per-layer budget tapered from lower to upper layers"
    Options = PyramidKVOptions

    def row_budget(self) -> int:
        o = self.options
        budgets = pyramid_budgets(
            o.budget, o.recent_rows(), self.num_layers, o.beta, o.protected()
        )
        return budgets[self.layer]
