"""`qfilters` (Godey et al., 2025): keep the keys that project most on the
head's Q-Filter, the principal direction of its real post-RoPE queries.

With `filters=FILE` (from `veloxpatch calibrate --algo qfilters`) the filters
are fixed and eviction runs whenever the cache is over budget, prefill and
decode. Without a file the filters come from the prompt's own queries: the
second moment of every query is accumulated while the prompt runs, and at its
end each head's filter is its top eigenvector, signed so that the mean query
projects positively (the majority rule needs the vectors, the moment does
not). Eviction therefore waits for the end of the prompt in that mode; a
prompt too short to end one (a lone token) takes its filter from the queries
seen so far once the rows first exceed the budget. Each sequence of a batch
has its own filter, from its own queries.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ..errors import OptionError
from .calibration_files import find, group_mean, load_filters
from .eviction import EvictingCache, EvictionOptions
from .options import check_int, check_path, option


@dataclasses.dataclass
class QFiltersOptions(EvictionOptions):
    """`window`: newest rows protected (default 64). `filters`: a calibration
    file; None takes this model's from the calibration cache (`veloxpatch
    calibrate --algo qfilters`), or, with none there, the prompt's own
    queries."""

    window: int = option(64, check_int, 0)
    filters: str | None = option(None, check_path)

    def recent_rows(self):
        return self.window

    def __post_init__(self):
        super().__post_init__()
        self.loaded = None  # per layer [Hkv, D], once bound to a model

    def bind(self, model, dims):
        """Load and check the filters file against `model` (before patching)."""
        if self.filters is not None:
            self.loaded = load_filters(self.filters, dims)
        else:  # this model's file in the calibration cache, if there is one
            found = find("qfilters", dims, lambda p: load_filters(p, dims))
            if found is not None:
                self.filters, self.loaded = found
        return super().bind(model, dims)


class QFiltersCache(EvictingCache):
    name = "qfilters"
    batchable = True  # one cache per sequence (caches/batch.py)
    summary = "top key projection on the head's Q-Filter (real queries), + window"
    note = (
        "filters=FILE (veloxpatch calibrate) evicts during prefill too; without "
        "one the filters come from the prompt's own queries, so eviction waits "
        "for the end of the prompt and peak memory holds the whole prompt."
    )
    Options = QFiltersOptions

    @classmethod
    def holds(cls, options, heads, head_dim, dtype_size):
        held = super().holds(options, heads, head_dim, dtype_size)
        if options.filters is not None:
            return held  # the file's filters are the model's, not a sequence's
        moments = heads * (head_dim * head_dim + 2 * head_dim) * 4  # and filter
        return held._replace(side=moments)

    def __init__(self, options=None, layer=0, num_layers=1):
        super().__init__(options, layer, num_layers)
        self.moment = None  # on the fly: sum of q q^T per query head [B, Hq, D, D]
        self.total = None  # and sum of q [B, Hq, D]
        self.filter = None  # [Hkv, D] (a file's) or [B, Hkv, D] (the prompt's)
        if self.options.loaded is not None:
            self.filter = self.options.loaded[layer]

    def after_attend(self, q, new_rows):
        if self.options.filters is None:
            q = q.astype(mx.float32)  # [B, Hq, L, D]
            m, s = q.swapaxes(2, 3) @ q, q.sum(axis=2)
            self.moment = m if self.moment is None else self.moment + m
            self.total = s if self.total is None else self.total + s
            if self.filter is None and not self.in_prompt:
                if self.rows > self.row_budget():  # no prompt has ended
                    self.filter = self._prompt_filter()
        elif self.filter is None:  # options made without veloxpatch.apply
            raise OptionError("qfilters: the filters file was not loaded for a model")
        if self.filter is not None and self.rows > self.row_budget():
            self.evict_to(self.row_budget(), self.scores(q))

    def end_prompt(self):
        if self.options.filters is None and self.moment is not None:
            self.filter = self._prompt_filter()
            if self.rows > self.row_budget():
                self.evict_to(self.row_budget(), self.scores(None))

    def _prompt_filter(self) -> mx.array:
        """[B, Hkv, D] each sequence's filters from its queries' moments."""
        with mx.stream(mx.cpu):  # eigh runs on the CPU only
            _, vecs = mx.linalg.eigh(self.moment)
            v1 = vecs[..., -1]  # [B, Hq, D], the largest eigenvalue's
            sign = mx.where((v1 * self.total).sum(-1) >= 0, 1.0, -1.0)
            v1 = v1 * sign[..., None]
            out = mx.stack([group_mean(v, self.keys.shape[1]) for v in v1])
            mx.eval(out)
        return out

    def scores(self, q):
        keys, _ = self._view()
        B, H, _, D = keys.shape
        f = self.filter if self.filter.ndim == 3 else self.filter[None]
        f = mx.broadcast_to(f[:, :, None, :], (B, H, 1, D)).astype(mx.float32)
        if hasattr(keys, "logits"):  # quantized rows, read in place (qview.py)
            return keys.logits(f)[:, :, 0].astype(mx.float32)
        return (keys.astype(mx.float32) * f).sum(-1)

    def extra_state(self):
        names = ("filter", "moment", "total")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def load_extra_state(self, st):
        for n in ("filter", "moment", "total"):
            setattr(self, n, st.get(n))
        if self.moment is not None and self.moment.ndim == 3:  # saved before batches
            self.moment, self.total = self.moment[None], self.total[None]

    def side_arrays(self):
        side = super().side_arrays()
        return side + [self.moment, self.total] if self.moment is not None else side

    def held_arrays(self):
        own = (self.moment, self.total) + (
            () if self.options.filters else (self.filter,)
        )
        return super().held_arrays() + [a for a in own if a is not None]
