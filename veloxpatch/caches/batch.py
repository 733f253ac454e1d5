"""mlx-lm's batch-cache contract (`merge`, `prepare`/`finalize`, `filter`,
`extend`, `extract`, an offset per sequence) for veloxpatch caches, so that
`BatchGenerator` (`mlx_lm.batch_generate`, `mlx_lm.server`) serves several
sequences at once.

Two layouts, one per layer of the batch:
  - `FullBatch` (`full`): mlx-lm's own `BatchKVCache` (left padding, its mask,
    one fused attention over the batch), so a patched model's batched output is
    bit-identical to unpatched mlx-lm's.
  - `SequenceBatch` (every other batchable algorithm): each sequence keeps its
    own cache (batch size 1), fed its own rows of every call. Kept sets,
    positions, prompt phase and budget are per sequence by construction: padding
    never reaches a score, and no sequence evicts another's rows. The price is
    one attention call per sequence and layer instead of one per layer.

mlx-lm right-pads the prompts of a prefill call and says so with `prepare`;
their padding tokens are never given to a sequence's cache (their outputs are
zeros, which mlx-lm never reads).
"""

from __future__ import annotations

import copy
import weakref

import mlx.core as mx

from ..errors import KV_BITS_ERROR, UnsupportedCacheOperation

__all__ = ["BatchCache", "SequenceBatch", "merge"]


def merge(cls, caches) -> BatchCache:
    """The batch cache of one layer from the per-sequence caches (copied: mlx-lm
    expects the caches it passes in to stay as they were)."""
    caches = list(caches)
    for c in caches:
        if not getattr(type(c), "batchable", False):
            raise UnsupportedCacheOperation(
                f"mlx-lm batch generation (BatchGenerator, the server) is not "
                f"supported with veloxpatch {c.name!r} caches: {c.batch_refusal}; "
                "generate one prompt at a time"
            )
    if len({type(c) for c in caches}) > 1:
        raise UnsupportedCacheOperation(
            "mlx-lm batch generation was given caches of different veloxpatch "
            "algorithms; batch only sequences of one patch"
        )
    return cls.batch_of(caches)


def sequence_batch(caches) -> SequenceBatch:
    """Every sequence keeps its own cache inside the batch."""
    return SequenceBatch([detached(c) for c in caches])


# The layers of one sequence share one prompt phase; copied one layer at a time
# (mlx-lm merges and extracts layer by layer, in order), they must share one copy.
_COPIES: dict = {}  # id(phase) -> (weakref to it, last layer copied, its copy)


def detached(cache):
    """A deep copy of one sequence's layer cache whose phase is shared with the
    copies of its other layers made just before (layers copied in order)."""
    phase = cache.phase
    return copy.deepcopy(cache, {id(phase): phase_copy(phase, cache.layer)})


def deep_copy(cache, memo):
    """An independent copy of a sequence's cache (mlx-lm deep-copies cache lists
    when it splits a batch): `clone` (new arrays, and any store an algorithm
    holds), the layers of one list sharing one phase again."""
    new = cache.clone()
    memo[id(cache)] = new
    new.phase = copy.deepcopy(cache.phase, memo)
    new.phase.members.append(weakref.ref(new))
    for name, value in vars(cache).items():
        if name not in cache._shared_attrs and isinstance(
            value, (list, dict, tuple, set)
        ):
            setattr(new, name, copy.deepcopy(value, memo))
    return new


class BatchCache:
    """What the patched forward needs of a layer's batch cache (as of a
    `VeloxCache`): `layer`, `name`, `flags_checked`, `shards`, `offset`, `attend`."""

    batch = True
    wants_layer_input = False  # handed (x, o_proj) before attend (attention.py)

    def __init__(self, template):
        self.layer = template.layer
        self.name = template.name
        self.flags_checked = template.flags_checked
        self._shards = template.shards
        self.layer_input = None

    def update_and_fetch(self, keys, values):
        template = type(self).__name__
        raise UnsupportedCacheOperation(
            f"a veloxpatch {template} was passed to an attention module that is "
            "not patched (was the patch restored?)"
        )

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        # Ignored by the patched forward: each batch cache masks its own rows.
        return None

    @classmethod
    def merge(cls, caches):
        return merge(cls, caches)

    def __deepcopy__(self, memo):
        # Options, shards and templates are shared; sequences are copied.
        new = copy.copy(self)
        memo[id(self)] = new
        for name in ("caches", "inner", "phases", "_todo", "_skip"):
            if name in vars(self):
                setattr(new, name, copy.deepcopy(getattr(self, name), memo))
        return new

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        raise UnsupportedCacheOperation(KV_BITS_ERROR)


class SequenceBatch(BatchCache):
    def __init__(self, caches):
        super().__init__(caches[0])
        self.caches = list(caches)
        self._todo = None  # tokens each sequence still has in a right-padded prefill
        self._skip = None  # left padding of the next call, per sequence

    @property
    def wants_layer_input(self) -> bool:
        return any(c.wants_layer_input for c in self.caches)

    @property
    def shards(self):
        return self._shards

    @shards.setter
    def shards(self, value):
        self._shards = value
        for c in self.caches:
            c.shards = value

    @property
    def offset(self) -> mx.array:
        """Tokens each sequence has seen (what RoPE and Ministral 3 read)."""
        return mx.array([c.offset for c in self.caches], dtype=mx.int32)

    # mlx-lm's pipeline stages make the last layer's keys depend on what they
    # send on; every sequence's state is evaluated, so one sequence's will do
    @property
    def keys(self):
        return self.caches[-1].keys

    @keys.setter
    def keys(self, value):
        self.caches[-1].keys = value

    def attend(self, q, k, v, *, rope, scale, query_scale=None):
        B, _, L, _ = q.shape
        if B != len(self.caches):
            raise UnsupportedCacheOperation(
                f"a batch cache of {len(self.caches)} sequences was given {B}"
            )
        outs = []
        for b, c in enumerate(self.caches):
            start, end = self.span(b, L)
            if end <= start:  # only padding for this sequence in this call
                outs.append(mx.zeros((1, *q.shape[1:]), q.dtype))
                continue
            part = slice(start, end)
            qs = query_scale
            if isinstance(qs, mx.array) and qs.ndim == 4 and qs.shape[0] == B:
                qs = qs[b : b + 1, :, part]  # per sequence, from the array offset
            elif isinstance(qs, mx.array) and qs.ndim == 2:
                qs = qs[part]
            if self.layer_input is not None:
                x, o_proj = self.layer_input
                c.layer_input = (x[b : b + 1, part], o_proj)
            o = c.attend(
                q[b : b + 1, :, part],
                k[b : b + 1, :, part],
                v[b : b + 1, :, part],
                rope=rope,
                scale=scale,
                query_scale=qs,
            )
            c.layer_input = None  # only during the call (its o_proj is the model's)
            if end - start < L:
                o = mx.pad(o, [(0, 0), (0, 0), (start, L - end), (0, 0)])
            outs.append(o)
        if self._todo is not None:
            self._todo = [
                t - (L - s) for t, s in zip(self._todo, self._skip or [0] * B)
            ]
        self._skip = None
        return outs[0] if B == 1 else mx.concatenate(outs, axis=0)

    def span(self, b: int, length: int) -> tuple[int, int]:
        """Where sequence b's own tokens lie in a call of `length` tokens (the
        rest is padding)."""
        start = 0 if self._skip is None else self._skip[b]
        end = length if self._todo is None else start + max(0, self._todo[b])
        return start, min(length, end)

    # ---- mlx-lm's batch contract ------------------------------------------------
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None and max(left_padding) > 0:
            self._skip = [int(p) for p in left_padding]
        if lengths is not None:
            self._todo = [int(n) for n in lengths]

    def finalize(self):
        self._todo = None

    def filter(self, batch_indices):
        keep = [int(i) for i in as_list(batch_indices)]
        self.caches = [self.caches[i] for i in keep]
        if self._todo is not None:
            self._todo = [self._todo[i] for i in keep]

    def extend(self, other):
        self.caches.extend(other.caches)

    def subset(self, indices) -> SequenceBatch:
        """The batch of some sequences only, sharing their caches (a model call
        that leaves the others untouched: serve/replay.py)."""
        new = copy.copy(self)
        new.caches = [self.caches[i] for i in indices]
        return new

    def extract(self, idx: int):
        """Sequence `idx` as the algorithm's own cache (a copy: mlx-lm's server
        extracts prompt caches of sequences that go on generating)."""
        return detached(self.caches[idx])

    @property
    def state(self):
        # mlx-lm evaluates `state` after every prefill chunk: each sequence's
        # phase learns of it (see phase.py).
        return [c.state for c in self.caches]

    @state.setter
    def state(self, v):
        raise UnsupportedCacheOperation(
            "a veloxpatch batch cache cannot be rebuilt from a state; save and "
            "load the caches of each sequence (extract)"
        )

    def size(self):
        return max((c.size() for c in self.caches), default=0)

    def empty(self):
        return all(c.empty() for c in self.caches)

    def is_trimmable(self):
        return all(c.is_trimmable() for c in self.caches)

    def trim(self, n):
        return min((c.trim(n) for c in self.caches), default=0)

    @property
    def nbytes(self):
        return sum(c.nbytes for c in self.caches)


def as_list(indices) -> list:
    return indices.tolist() if isinstance(indices, mx.array) else list(indices)


def phase_copy(phase, layer: int):
    """One copy of `phase` for the layers of one sequence copied in order."""
    found = _COPIES.get(id(phase))
    if found is not None and found[0]() is phase and layer > found[1]:
        new = found[2]
    else:
        new = copy.deepcopy(phase)
        for key in [k for k, f in _COPIES.items() if f[0]() is None]:
            del _COPIES[key]  # phases gone since
    _COPIES[id(phase)] = (weakref.ref(phase), layer, new)
    return new
