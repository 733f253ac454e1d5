"""`full` in mlx-lm's batch layout (see batch.py): mlx-lm's own `BatchKVCache`,
attended exactly as unpatched mlx-lm attends it, so batched output is
bit-identical to unpatched mlx-lm's."""

from __future__ import annotations

import weakref

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from .batch import BatchCache, SequenceBatch, as_list, phase_copy


class FullBatch(BatchCache):
    """`full` in mlx-lm's own batch layout, attended exactly as unpatched mlx-lm
    attends a `BatchKVCache`."""

    def __init__(self, template, inner: BatchKVCache, phases: list):
        super().__init__(template)
        self.template = template
        self.inner = inner
        self.phases = phases  # each sequence's prompt phase, for `extract`
        self.shards = template.shards

    @classmethod
    def merge(cls, caches):
        phases = [phase_copy(c.phase, c.layer) for c in caches]
        return cls(caches[0], BatchKVCache.merge(caches), phases)

    @property
    def offset(self):
        return self.inner.offset

    @property
    def keys(self):  # mlx-lm's pipeline stages set it (see SequenceBatch.keys)
        return self.inner.keys

    @keys.setter
    def keys(self, value):
        self.inner.keys = value

    def attend(self, q, k, v, *, rope, scale, query_scale=None):
        inner = self.inner
        mask = inner.make_mask(q.shape[2])  # what mlx-lm builds before the layers
        q, k = rope(q, offset=inner.offset), rope(k, offset=inner.offset)
        if query_scale is not None:
            q = q * query_scale
        keys, values = inner.update_and_fetch(k, v)
        return mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=scale, mask=mask
        )

    def prepare(self, **kwargs):
        self.inner.prepare(**kwargs)

    def finalize(self):
        self.inner.finalize()

    def filter(self, batch_indices):
        keep = [int(i) for i in as_list(batch_indices)]
        self.inner.filter(keep)
        self.phases = [self.phases[i] for i in keep]

    def extend(self, other):
        self.inner.extend(other.inner)
        self.phases = self.phases + other.phases

    def extract(self, idx: int):
        kv = self.inner.extract(idx)
        t = self.template
        cache = type(t)(t.options, t.layer, t.num_layers)
        cache.shards, cache.scale = t.shards, t.scale
        cache.phase = phase_copy(self.phases[idx], t.layer)
        cache.phase.members.append(weakref.ref(cache))
        if kv.keys is not None and kv.keys.shape[2]:
            cache.keys, cache.values, cache.rows = kv.keys, kv.values, kv.offset
        cache.offset = kv.offset
        return cache

    @property
    def state(self):
        i = self.inner
        return [
            a for a in (i.keys, i.values, i.offset, i.left_padding) if a is not None
        ]

    @state.setter
    def state(self, v):
        SequenceBatch.state.fset(self, v)

    def size(self):
        return self.inner.size()

    def empty(self):
        return self.inner.empty()

    def is_trimmable(self):
        return True

    def trim(self, n):
        return self.inner.trim(n)

    @property
    def nbytes(self):
        return self.inner.nbytes
