"""A model split across processes (`mlx.launch`), as its caches see it.

mlx-lm splits a model two ways. `model.shard(group)` (tensor parallel) gives
each rank of `group` a contiguous slice of every layer's query and KV heads:
rank r holds KV heads r*h .. r*h + h - 1 of each layer (h = KV heads / ranks)
and their query heads, so every GQA group stays on one rank. Pipeline sharding
(`model.model.pipeline(group)`) gives each rank a run of whole layers.

A cache only ever holds its rank's heads of its layer. What an algorithm computes
per head needs nothing more; a statistic over all heads of a layer (TOVA's mean
over query heads, Ada-KV's layer-wide top-k, adaptive bit widths) asks
`all_heads` for every rank's part, computes what the unsharded model computes
and keeps its own heads with `my_heads`. Every rank runs the same evictions at
the same steps, so the collectives line up. Layer numbers are global: a cache
is told its layer's index in the whole model and the whole model's layer count.
The adapter finds all this on the model (`model_adapters.sharding`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass(frozen=True, eq=False)
class Shards:
    """`group`: the tensor-parallel group the heads are split over (None: every
    head is here). `layer_offset`: global index of this process's first layer.
    `num_layers`: layers of the whole model (None: not known, all are here)."""

    group: Any = None
    layer_offset: int = 0
    num_layers: int | None = None

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size()

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank()

    @property
    def split(self) -> bool:
        """Heads or layers live on other processes too."""
        return self.size > 1 or self.layer_offset > 0 or self.num_layers is not None

    @property
    def layout(self) -> tuple:
        """What tells two splits apart (ranks, first layer, layer count)."""
        return self.size, self.layer_offset, self.num_layers

    def all_heads(self, x: mx.array, axis: int = 1) -> mx.array:
        """`x` (this rank's heads along `axis`) with every rank's heads, in the
        model's head order (an all_gather over the group)."""
        if self.size == 1:
            return x
        front = mx.moveaxis(x, axis, 0)
        gathered = mx.distributed.all_gather(front, group=self.group)
        return mx.moveaxis(gathered, 0, axis)

    def head_slice(self, total: int) -> slice:
        """This rank's part of `total` heads."""
        n = total // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def my_heads(self, x: mx.array, axis: int = 1) -> mx.array:
        """This rank's heads of `x`, which holds every head along `axis`."""
        if self.size == 1:
            return x
        index = (slice(None),) * axis + (self.head_slice(x.shape[axis]),)
        return x[index]


LOCAL = Shards()  # nothing is split: the default of a cache built by hand
