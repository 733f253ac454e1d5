"""The cache every veloxpatch algorithm builds on.

A cache receives pre-RoPE q/k/v from the patched forward together with the
layer's rope, softmax scale and any query scale, and returns the attention output.
Storage is per KV head (`storage.RowStorage`). `offset` is always the number of
tokens seen (what RoPE reads), never the row count. Where the sequence is
(prefill, prompt end, decode) is one `PromptPhase` shared by all layers.

Algorithms override a few named hooks (see `VeloxCache`); they never touch mlx-lm.
"""

from __future__ import annotations

import copy
import json
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import KV_BITS_ERROR, PatchStateError, UnsupportedCacheOperation
from ..sharding import LOCAL
from .attention_math import fused_attention
from .batch import (
    deep_copy,
    merge,  # a clear error where `batchable` is False
    sequence_batch,
)
from .kv_budget import Holds
from .options import CacheOptions
from .phase import PromptPhase
from .storage import PAD_POSITION, RowStorage

__all__ = ["PAD_POSITION", "CacheOptions", "Seen", "VeloxCache"]


@dataclass(frozen=True)
class Seen:
    """What one attention call hands a layer's cache (given to a probe)."""

    layer: int
    offset: int  # position of the call's first token
    q_pre: mx.array  # [B, Hq, L, D] before RoPE (after Qwen3's q_norm)
    k_pre: mx.array  # [B, Hkv, L, D]
    v: mx.array
    q: mx.array  # as attention gets it: rotated, times any query scale
    k: mx.array  # as stored (rotated; A2ATS stores it pre-RoPE)
    rope: Any
    scale: float
    query_scale: Any  # None, or Ministral 3's per-position attn_scale
    x: Any = None  # [B, L, hidden] the hidden state entering attention
    o_proj: Any = None  # the layer's output projection (KVzip+ weights)


# An mlx-lm cache by its methods alone: mlx-lm duck-types caches (no base class).
def piece_of(query_scale, part: slice, length: int):
    """The query scale of queries `part` of a call of `length` (a per-query
    array, [..., L, 1], or one for the whole call)."""
    if isinstance(query_scale, mx.array) and query_scale.ndim >= 2:
        if query_scale.shape[-2] == length:
            return query_scale[..., part, :]
    return query_scale


class VeloxCache(RowStorage):
    """Dense attention with per-head storage; the parity path of `full`.

    Hooks for algorithms (each optional):
      - `rotate(q, k, rope, offset, query_scale)`: RoPE (A2ATS keeps keys unrotated);
      - `attention(q, keys, values, mask, scale)`: how to attend (default: fused SDPA);
      - `after_attend(q, new_rows)`: after every call; evict here;
      - `end_prompt()`: the prompt is over (see `phase.py`), before the next call;
      - `side_arrays()`: arrays to evaluate with every step's logits;
      - `extra_state()` / `load_extra_state(st)`: the algorithm's own arrays;
      - `extra_meta()` / `load_extra_meta(m)`: the algorithm's own scalars;
      - `held_arrays()`: what `nbytes` counts (storage adds its own).
    """

    name: ClassVar[str] = "base"
    summary: ClassVar[str] = ""  # one line for `veloxpatch list`
    note: ClassVar[str] = ""  # a trade-off worth knowing, printed under it
    Options: ClassVar[type[CacheOptions]] = CacheOptions
    wants_layer_input: ClassVar[bool] = False  # handed (x, o_proj) before attend
    wants_token_ids: ClassVar[bool] = False  # records the ids of each model call
    batchable: ClassVar[bool] = False  # `merge` builds a batch (caches/batch.py)
    batch_refusal: ClassVar[str] = "its batch contract is not implemented"
    # not deep-copied: kvzap's o_proj is the model's module (an nn.Module is a dict)
    _shared_attrs: ClassVar[tuple] = (
        "options",
        "shards",
        "probe",
        "book",
        "o_proj",
        "layer_input",
    )
    # What a server keeps of this cache for later requests (serve/prompt_cache.py):
    # "as_is": the kept set never reads a query, so any state of it is agnostic;
    # "prompt": the copy taken as the prompt ends, before its question-aware
    # compression; "none": queries of the question evicted during the prompt.
    prompt_cache_policy: ClassVar[str] = "as_is"

    @classmethod
    def policy_for(cls, options) -> str:
        """`prompt_cache_policy` with these options (compressing during the
        prompt reads its queries, the question's among them: "none")."""
        chunked = getattr(options, "prompt_chunk", lambda: None)() is not None
        return "none" if chunked else cls.prompt_cache_policy

    # Per-row side state, each [B, Hkv, <= rows] aligned with the stored rows
    # (h2o's accumulated attention, knorm's norms, ...): kept with the rows an
    # eviction keeps, truncated with them, evaluated each step, saved and loaded.
    row_arrays: ClassVar[tuple[str, ...]] = ()
    # Running statistics of every query seen (h2o's accumulated attention,
    # expected_attention's moments): a trim leaves the trimmed queries in them.
    trim_keeps_queries: ClassVar[bool] = False

    def __init__(
        self, options: CacheOptions | None = None, layer: int = 0, num_layers: int = 1
    ):
        self.options = options if options is not None else self.Options()
        self.layer = layer
        self.num_layers = num_layers
        self._init_storage()
        self.offset = 0  # tokens seen = absolute position of the next token
        # tokens seen when the state last took in what a trim cannot undo (an
        # eviction; trimmed queries' statistics): a trim back past it is not the
        # state those tokens alone leave (serve/prompt_cache.py reuses only
        # trims before it)
        self.irreversible_at = None
        self.decode_from = None  # tokens seen when the last prompt ended
        self.phase = PromptPhase()  # make_cache shares one across the layers
        self.phase_ends = 0  # prompt ends this cache has acted on
        self.scale = None  # the softmax scale of the layer, known after a call
        self.probe = None  # fn(Seen), called on every attention call
        self.layer_input = None  # (x, o_proj) during a call (attention.py)
        self.call_offset = 0  # the offset the call began at
        self.flags_checked = False  # mlx-lm's kv_bits looked for (attention.py)
        self.shards = LOCAL  # the model's split across processes (sharding.py)

    # ---- the patched forward calls this -------------------------------------
    def attend(self, q, k, v, *, rope, scale, query_scale=None):
        L = q.shape[2]
        if self.keys is not None and self.keys.shape[1::2] != k.shape[1::2]:
            raise PatchStateError(
                f"this cache holds {self.keys.shape[1]} KV heads of width "
                f"{self.keys.shape[3]}, the layer gives {k.shape[1]} of width "
                f"{k.shape[3]}: a cache from another model"
            )
        if L > 1 and self.rows and k.shape[0] != self.keys.shape[0]:
            raise PatchStateError("batch size changed while the cache holds tokens")
        offset = self.offset
        self.call_offset = offset  # where the call's layer input starts
        self.phase.begin_call(self.layer, offset, L)
        self.scale = scale
        self.sync_phase()
        if L == 1 or self.next_cut(offset, offset + L) is None:
            return self._attend_piece(q, k, v, rope, scale, query_scale)
        # a prompt call is attended in pieces ending where the cache cuts back
        # (`next_cut`, then `chunk_done`): the caller's chunking changes nothing
        outs, start = [], 0
        while start < L:
            cut = self.next_cut(offset + start, offset + L)
            end = L if cut is None else cut - offset
            part = slice(start, end)
            # each piece after the previous: mlx would schedule them all at once
            piece_q = q[:, :, part] if not outs else mx.depends(q[:, :, part], outs[-1])
            outs.append(
                self._attend_piece(
                    piece_q,
                    k[:, :, part],
                    v[:, :, part],
                    rope,
                    scale,
                    piece_of(query_scale, part, L),
                )
            )
            if cut is not None:
                self.chunk_done()
                self.evaluate_rewrite()
            start = end
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

    def _attend_piece(self, q, k, v, rope, scale, query_scale):
        L, offset = q.shape[2], self.offset
        q_pre, k_pre = q, k
        q, k = self.rotate(q, k, rope, offset, query_scale)
        if self.probe is not None:
            x, o_proj = self.layer_input or (None, None)
            if x is not None:  # this piece's rows of the call's input
                x = x[:, offset - self.call_offset : offset - self.call_offset + L]
            seen = Seen(
                self.layer,
                offset,
                q_pre,
                k_pre,
                v,
                q,
                k,
                rope,
                scale,
                query_scale,
                x,
                o_proj,
            )
            self.probe(seen)
        keys, values = self._append(k, v, offset)
        out = self.attention(q, keys, values, self._mask(L, offset, q.shape[1]), scale)
        if out.dtype != q.dtype:  # rows held in another dtype
            out = out.astype(q.dtype)
        self.offset = offset + L
        self.after_attend(q, L)
        side = self.side_arrays()
        if side:  # evaluated with the logits, so lazy graphs never pile up
            out = mx.depends(out, side)
        return out

    def next_cut(self, start: int, end: int) -> int | None:
        """The first position in (start, end] of a prompt call at which this
        cache cuts back during the prompt (`compress="chunks"`), or None."""
        return None

    def chunk_done(self) -> None:
        """The prompt reached the position `next_cut` gave."""

    def evaluate_rewrite(self) -> None:
        """Evaluate what the cache holds right after it rewrote it (a cut, the
        prompt's end, a compaction): every layer rewrites in the same step, and
        left lazy each would hold what it read (all its rows, dequantized
        copies) until the step's end, every layer's at the peak."""
        mx.eval(self.held_arrays())

    @property
    def in_prompt(self) -> bool:
        return self.phase.in_prompt

    def sync_phase(self) -> None:
        """Run `end_prompt` if the phase has ended a prompt this cache has not
        (with a snapshot for the server's prompt cache, before or after)."""
        if self.phase_ends < self.phase.ends:
            snap = self.phase.keep_snapshot
            first = snap and self.snapshot_first()
            if first:
                self.take_snapshot(pending=True)
            self.phase_ends = self.phase.ends
            self.decode_from = self.offset
            if self.keys is not None:
                self.end_prompt()
                self.evaluate_rewrite()
            if snap and not first:
                self.take_snapshot(pending=False)

    def phase_members(self) -> list:
        """The caches of this prompt cache running the same algorithm, in layer
        order (kvzip's and kvzap's model-wide choices)."""
        caches = [r() for r in self.phase.members]
        return [c for c in caches if c is not None and c.name == self.name]

    def snapshot_first(self) -> bool:
        """Whether the prompt-end snapshot is taken before `end_prompt` runs
        (its compression reads the question's queries) or after (kvzip's
        reconstruction scores are question-agnostic)."""
        return True

    def take_snapshot(self, pending: bool) -> None:
        """A copy of every layer's cache as it is now, for the server's prompt
        cache (`serve/prompt_cache.py`). `pending`: the copies have not seen this prompt
        end, so the next request sharing their tokens continues the prompt.
        Taken once per prompt end, by the first layer to see it."""
        phase = self.phase
        if phase.snapshot is not None and phase.snapshot[0] == phase.ends:
            return
        caches = [r() for r in phase.members]
        if any(c is None for c in caches) or len(caches) != phase.size:
            return  # a layer is gone, or mlx-lm's caches share the list
        copied = phase.copy()  # keeps keep_snapshot: a later turn snapshots too
        copied.snapshot = None
        if pending:
            copied.state, copied.ends = "prefill", phase.ends - 1
        if pending or (phase.prompt_logits or (None,))[0] != self.offset:
            copied.prompt_logits = None  # they go with a prompt that has ended
        clones = []
        for c in caches:
            new = c.clone()
            new.fit_buffer()  # its rows only, not the growth step past them
            new.phase, new.phase_ends = copied, copied.ends
            copied.members.append(weakref.ref(new))
            clones.append(new)
        phase.snapshot = (phase.ends, self.offset, clones)

    def close_prompt(self) -> None:
        """The caller says the prompt is over (`Patch.end_prompt()`)."""
        self.phase.end()
        self.sync_phase()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "Options" in vars(cls):  # those options are priced by this class
            cls.Options.cache = cls

    @classmethod
    def holds(cls, options, heads: int, head_dim: int, dtype_size: int) -> Holds:
        """What one layer holds besides its budget's rows (`kv_budget.Holds`),
        with `heads` query heads of `head_dim`: what `max_kv_bytes` prices.
        An algorithm that buffers queries or keeps statistics declares them
        here, beside its scores. Default: nothing."""
        return Holds()

    # ---- hooks ----------------------------------------------------------------
    def rotate(self, q, k, rope, offset: int, query_scale):
        """Pre-RoPE q, k of a call -> what attention gets and what is stored
        (default: both rotated to their positions, q times any query scale)."""
        q, k = rope(q, offset=offset), rope(k, offset=offset)
        return (q if query_scale is None else q * query_scale), k

    def attention(self, q, keys, values, mask, scale):
        if hasattr(keys, "attend"):  # rows in another layout (qview.py)
            return keys.attend(q, scale)
        # a long prompt call in tiles of queries on the CPU (a bounded peak)
        return fused_attention(q, keys, values, scale, mask)

    def after_attend(self, q, new_rows: int) -> None:
        pass

    def end_prompt(self) -> None:
        pass

    @classmethod
    def finish_context(cls, model, caches, context: list[int], tokenizer, reuse=None):
        """A context's prefill is done and its prompt about to end
        (`Patch.prefill`, the eval): an algorithm's own pass over `context`,
        the ids of its newest positions (kvzip's reconstruction). Returns what
        the pass found, which `reuse` hands back to skip the pass on the same
        context (the eval's arms that differ only in how rows are chosen).
        Default: none."""
        return None

    @classmethod
    def model_call(cls, patch, wrapped, model, args, kwargs):
        """A whole-model call (the ids reach no attention layer: kvzip records
        them, `wants_token_ids`). Default: the call as it is."""
        return wrapped(*args, **kwargs)

    def side_arrays(self) -> list:
        """Arrays the attention output does not depend on but must be evaluated
        every step (positions, query buffers, accumulators)."""
        held = [self.positions, *(getattr(self, n) for n in self.row_arrays)]
        return [a for a in held if a is not None]

    def extra_state(self) -> dict:
        """Side arrays of an algorithm (accumulators, query buffers); the
        `row_arrays` by name."""
        named = {n: getattr(self, n) for n in self.row_arrays}
        return {n: a for n, a in named.items() if a is not None}

    def load_extra_state(self, st: dict) -> None:
        for n in self.row_arrays:
            setattr(self, n, st.get(n))

    def held_arrays(self) -> list:
        rows = (getattr(self, n) for n in self.row_arrays)  # each row's side state
        return super().held_arrays() + [a for a in rows if a is not None]

    def truncate_rows(self, n: int) -> None:
        super().truncate_rows(n)
        self.truncate_row_arrays(n)

    def fit_buffer(self) -> None:
        super().fit_buffer()
        for name in self.row_arrays:  # each row's side state, to the rows too
            a = getattr(self, name)
            if a is not None and a.shape[-1] > self.rows:
                setattr(self, name, mx.take(a, mx.arange(self.rows), axis=-1))

    def truncate_row_arrays(self, n: int) -> None:
        """Each row's side state follows its rows (any storage's truncate)."""
        for name in self.row_arrays:
            a = getattr(self, name)
            if a is not None:
                setattr(self, name, a[..., :n])

    def extra_meta(self) -> dict:
        """Scalars of an algorithm (counters, flags), JSON-serialisable."""
        return {}

    def load_extra_meta(self, m: dict) -> None:
        pass

    def clone(self) -> VeloxCache:
        """An independent copy: new array objects (storage is updated in place
        by slice assignment), its own copy of the phase, the same options. A
        whole list: `veloxpatch.copy_cache` or copy.deepcopy, whose copies share
        one phase (model-wide choices, as kvzip's, need every layer in it)."""
        new = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, mx.array):
                setattr(new, name, mx.array(value))
        new.phase = self.phase.copy()
        return new

    def __deepcopy__(self, memo):

        return deep_copy(self, memo)

    # ---- mlx-lm cache contract ------------------------------------------------
    def update_and_fetch(self, keys, values):
        raise PatchStateError(
            f"a veloxpatch {self.name!r} cache was passed to an attention module "
            "that is not patched (was the patch restored?); make a new cache with "
            "model.make_cache() or mlx_lm's make_prompt_cache"
        )

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        # Ignored by the patched forward: each cache builds its own mask.
        return "causal" if N > 1 else None

    def size(self):
        return self.rows

    def empty(self):
        return self.keys is None

    def is_trimmable(self):
        return True

    @property
    def queries_short(self) -> int:
        """How many more tokens must come before the queries this cache holds
        are those a cache that never saw the trimmed tokens would hold (a trim
        takes buffered queries back, not those they pushed out). Default: 0."""
        return 0

    def trim(self, n):
        """Forget the last `n` tokens (speculative decoding, prompt-cache reuse);
        rows evicted meanwhile stay evicted, running statistics keep them
        (`irreversible_at` says so)."""
        n = max(0, min(int(n), self.offset))
        if n and self.trim_keeps_queries:
            self.irreversible_at = max(self.irreversible_at or 0, self.offset)
        if n and self.keys is not None:
            self.forget_after(self.offset - n)
        self.offset -= n
        return n

    @property
    def nbytes(self):
        return sum(a.nbytes for a in self.held_arrays())

    @property
    def state(self):
        """Every array the cache holds, by name, and its meta state as JSON under
        "meta": all mlx-lm's save_prompt_cache writes and from_state reads."""
        # mlx-lm evaluates `state` after each prefill chunk, never while decoding:
        # the one signal that tells its lone last chunk from the last token
        # (generate_step's behaviour, pinned in mlx_lm_internals).
        self.phase.chunk_evaluated()
        return {**self.arrays(), "meta": json.dumps(self.meta_state)}

    @state.setter
    def state(self, st):
        st = dict(tree_flatten(dict(st or {}), destination={}))  # mlx-lm nests "a.b"
        st.pop("meta", None)  # read by from_state
        self.load_storage(st)
        self.load_extra_state(st)

    def arrays(self) -> dict:
        if self.keys is None:
            return {}
        return {**self.storage_arrays(), **self.extra_state()}

    @property
    def meta_state(self):
        return {
            "algo": self.name,
            "options": json.dumps(self.options.as_dict()),
            "offset": self.offset,
            "layer": self.layer,
            "num_layers": self.num_layers,
            "padded": self.padded,
            "irreversible_at": self.irreversible_at,
            "decode_from": self.decode_from,
            "scale": self.scale,
            "phase_seen": self.phase_ends,
            **self.phase.as_meta(),
            **self.extra_meta(),
        }

    @meta_state.setter
    def meta_state(self, m):
        self.options = self.Options.from_saved(self.name, json.loads(m["options"]))
        self.offset = int(m["offset"])
        self.layer = int(m["layer"])
        self.num_layers = int(m["num_layers"])
        self.padded = bool(m["padded"])
        at, since = m.get("irreversible_at"), m.get("decode_from")
        self.irreversible_at = None if at is None else int(at)
        self.decode_from = None if since is None else int(since)
        self.scale = None if m.get("scale") is None else float(m["scale"])
        self.phase = PromptPhase.from_meta(m)
        self.phase.members.append(weakref.ref(self))
        self.phase_ends = int(m["phase_seen"])
        self.load_extra_meta(m)

    @classmethod
    def for_options(cls, options: CacheOptions) -> type[VeloxCache]:
        """The class that implements these options (a variant for some)."""
        return cls

    @classmethod
    def from_state(cls, state, meta_state=None):
        """A cache from its state (and meta state, which mlx-lm's
        load_prompt_cache does not pass: then the JSON inside the state)."""
        if meta_state is None:
            meta_state = json.loads(dict(state)["meta"])
        options = cls.Options.from_saved(cls.name, json.loads(meta_state["options"]))
        cache = cls.for_options(options)(options)
        cache.state = state
        cache.meta_state = meta_state
        return cache

    # ---- mlx-lm features that would silently drop the algorithm ---------------
    def to_quantized(self, group_size: int = 64, bits: int = 4):
        raise UnsupportedCacheOperation(KV_BITS_ERROR)

    @classmethod
    def merge(cls, caches):
        """mlx-lm's batch cache of one layer (BatchGenerator, the server)."""
        return merge(cls, caches)

    @classmethod
    def batch_of(cls, caches):
        """The batch cache of checked per-sequence caches (default: each keeps
        its own inside the batch; `full` uses mlx-lm's layout)."""
        return sequence_batch(caches)


CacheOptions.cache = VeloxCache  # options no algorithm declares hold nothing more
