"""The cache every veloxpatch algorithm builds on.

A cache receives pre-RoPE q/k/v from the patched forward together with the
layer's rope, softmax scale and any query scale, and returns the attention output.
Storage is per KV head: keys/values [B, Hkv, T, D] in a step-grown buffer and,
once anything has been evicted, the absolute position of every row [B, Hkv, T].
`offset` is always the number of tokens seen (what RoPE reads), never the row count.

Algorithms override a few named hooks (see `VeloxCache`); they never touch mlx-lm.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any, ClassVar

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from ..errors import OptionError, PatchStateError, UnsupportedCacheOperation

# Position given to padding rows (heads that keep fewer rows than the buffer
# holds): larger than any query position, so the causal mask hides it.
PAD_POSITION = 2**31 - 1


@dataclasses.dataclass
class CacheOptions:
    """Options shared by every algorithm. Subclasses add fields and validate them
    in `__post_init__` (call super)."""

    def __post_init__(self):
        pass

    @classmethod
    def create(cls, algo: str, options: dict[str, Any]) -> CacheOptions:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            valid = ", ".join(names) if names else "(none)"
            raise OptionError(
                f"unknown option(s) {', '.join(unknown)} for {algo!r}; valid: {valid}"
            )
        try:
            return cls(**options)
        except (TypeError, ValueError) as e:
            if isinstance(e, OptionError):
                raise
            raise OptionError(f"{algo}: {e}") from None

    def bind(self, model) -> CacheOptions:
        """Checks and loads what depends on the model (calibration files),
        before anything is patched."""
        return self

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class VeloxCache(_BaseCache):
    """Dense attention with per-head storage; the parity path of `full`.

    Hooks for algorithms:
      - `rotate(q, k, rope, offset, query_scale)`: RoPE (A2ATS keeps keys unrotated);
      - `attention(q, keys, values, mask, scale)`: how to attend (default: fused SDPA);
      - `after_attend(q, new_rows)`: called after every call, evict here;
      - `end_prompt()`: the prompt is over: when the call after mlx-lm's lone
        last prompt token arrives (see `_resolve_prompt_end`), or on
        `Patch.end_prompt()`.
    """

    name: ClassVar[str] = "base"
    summary: ClassVar[str] = ""  # one line for `veloxpatch list`
    note: ClassVar[str] = ""  # a trade-off worth knowing, printed under it
    Options: ClassVar[type[CacheOptions]] = CacheOptions
    step: ClassVar[int] = 256

    def __init__(
        self, options: CacheOptions | None = None, layer: int = 0, num_layers: int = 1
    ):
        self.options = options if options is not None else self.Options()
        self.layer = layer
        self.num_layers = num_layers
        self.keys = None  # [B, Hkv, capacity, D]
        self.values = None
        self.positions = None  # None while dense: row t holds position t
        self.rows = 0  # rows in use (the same for every head; short heads pad)
        self.padded = False  # some heads hold padding rows (PAD_POSITION)
        self.offset = 0  # tokens seen = absolute position of the next token
        self._in_prompt = False  # the last calls were prompt chunks
        # A lone token may have ended the prompt: 1 right after multi-token calls
        # (it may be mlx-lm's lone prefill chunk), 2 after a lone chunk (it did).
        self._end_pending = 0
        self._last_multi = False  # the previous call had several tokens
        self._state_read = False  # `state` was read since the last call
        self.scale = None  # the softmax scale of the layer, known after a call

    # ---- the patched forward calls this -------------------------------------
    def attend(self, q, k, v, *, rope, scale, query_scale=None):
        L = q.shape[2]
        if L > 1 and self.rows and k.shape[0] != self.keys.shape[0]:
            raise PatchStateError("batch size changed while the cache holds tokens")
        self._resolve_prompt_end(L)
        offset = self.offset
        q, k = self.rotate(q, k, rope, offset, query_scale)
        keys, values = self._append(k, v, offset)
        self.scale = scale
        out = self.attention(q, keys, values, self._mask(L, offset, q.shape[1]), scale)
        self.offset = offset + L
        self.after_attend(q, L)
        side = self.side_arrays()
        if side:  # evaluated with the logits, so lazy graphs never pile up
            out = mx.depends(out, side)
        if L == 1 and self._in_prompt:
            self._end_pending = 1 if self._last_multi else 2
        self._in_prompt = L > 1 or bool(self._end_pending)
        self._last_multi = L > 1
        self._state_read = False
        return out

    def _resolve_prompt_end(self, L: int) -> None:
        """mlx-lm sends the last prompt token alone, but may also send a lone token
        just before it (when len(prompt) - 1 = 1 mod prefill_step_size). It reads
        `state` after every prefill chunk and never during decode, so a lone call
        right after multi-token calls and followed by a `state` read was a chunk;
        any other lone call in a prompt ended it, and `end_prompt` runs now,
        before the next call attends."""
        if self._end_pending == 1 and self._state_read:
            pass  # mlx-lm's lone prefill chunk: the prompt goes on
        elif self._end_pending:
            self._in_prompt = False
            self.end_prompt()
        self._end_pending = 0

    def close_prompt(self) -> None:
        """The caller says the prompt is over (`Patch.end_prompt()`)."""
        if self._in_prompt or self._end_pending:
            self._in_prompt, self._end_pending = False, 0
            self.end_prompt()

    # ---- hooks ----------------------------------------------------------------
    def rotate(self, q, k, rope, offset: int, query_scale):
        """Pre-RoPE q, k of a call -> what attention gets and what is stored
        (default: both rotated to their positions, q times any query scale)."""
        q, k = rope(q, offset=offset), rope(k, offset=offset)
        return (q if query_scale is None else q * query_scale), k

    def attention(self, q, keys, values, mask, scale):
        return mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=scale, mask=mask
        )

    def after_attend(self, q, new_rows: int) -> None:
        pass

    def end_prompt(self) -> None:
        pass

    def side_arrays(self) -> list:
        """Arrays the attention output does not depend on but must be evaluated
        every step (positions, query buffers, accumulators)."""
        return [] if self.positions is None else [self.positions]

    # ---- storage --------------------------------------------------------------
    def _append(self, k, v, offset):
        prev, L = self.rows, k.shape[2]
        if self.keys is None or prev + L > self.keys.shape[2]:
            self._grow(k, v, prev + L)
        self.keys[..., prev : prev + L, :] = k
        self.values[..., prev : prev + L, :] = v
        if self.positions is not None:
            B, H = k.shape[:2]
            new = mx.broadcast_to(
                mx.arange(offset, offset + L, dtype=mx.int32), (B, H, L)
            )
            self.positions[..., prev : prev + L] = new
        self.rows = prev + L
        return self._view()

    def _capacity(self, needed: int) -> int:
        """Rows to allocate when `needed` no longer fit (mlx-lm's step growth)."""
        return (needed + self.step - 1) // self.step * self.step

    def _grow(self, k, v, needed):
        B, H, _, Dk = k.shape
        cap = self._capacity(needed)
        if self.keys is None:
            self.keys = mx.zeros((B, H, cap, Dk), k.dtype)
            self.values = mx.zeros((B, H, cap, v.shape[3]), v.dtype)
            return
        extra = cap - self.keys.shape[2]
        k_pad = mx.zeros((B, H, extra, Dk), self.keys.dtype)
        v_pad = mx.zeros((B, H, extra, self.values.shape[3]), self.values.dtype)
        self.keys = mx.concatenate([self.keys, k_pad], axis=2)
        self.values = mx.concatenate([self.values, v_pad], axis=2)
        if self.positions is not None:
            p_pad = mx.full((B, H, extra), PAD_POSITION, mx.int32)
            self.positions = mx.concatenate([self.positions, p_pad], axis=2)

    def _view(self):
        if self.rows == self.keys.shape[2]:
            return self.keys, self.values
        return self.keys[..., : self.rows, :], self.values[..., : self.rows, :]

    def _mask(self, L: int, offset: int, n_q_heads: int):
        """mlx-lm's own choice ("causal" or none) unless heads are padded; then
        causal on the true positions, per KV head, expanded to the query heads."""
        if not self.padded:
            # Rows are in position order and all in the past of the new ones, so
            # the fused causal mask is exact, before and after eviction.
            return "causal" if L > 1 else None
        pos = self.positions[..., : self.rows]  # [B, Hkv, T]
        qpos = mx.arange(offset, offset + L, dtype=mx.int32)
        mask = pos[:, :, None, :] <= qpos[None, None, :, None]  # [B, Hkv, L, T]
        n_rep = n_q_heads // pos.shape[1]
        return mx.repeat(mask, n_rep, axis=1) if n_rep > 1 else mask

    def positions_view(self) -> mx.array:
        """Absolute position of every stored row, [B, Hkv, T] int32."""
        if self.positions is not None:
            return self.positions[..., : self.rows]
        B, H = self.keys.shape[:2]
        # Nothing evicted yet: row t holds the token at position t.
        return mx.broadcast_to(mx.arange(self.rows, dtype=mx.int32), (B, H, self.rows))

    def clone(self) -> VeloxCache:
        """An independent copy: new array objects (storage is updated in place
        by slice assignment), the same options object."""
        new = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, mx.array):
                setattr(new, name, mx.array(value))
        return new

    @property
    def evicted(self) -> bool:
        return self.positions is not None

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
        return False

    def trim(self, n):
        return 0

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        total = self.keys.nbytes + self.values.nbytes
        return total + (self.positions.nbytes if self.positions is not None else 0)

    @property
    def state(self):
        """Every array the cache holds, by name (what `save_cache` writes)."""
        self._state_read = True  # mlx-lm reads it after each prefill chunk
        return self.arrays()

    def arrays(self) -> dict:
        if self.keys is None:
            return {}
        k, v = self._view()
        st = {"keys": k, "values": v}
        if self.positions is not None:
            st["positions"] = self.positions[..., : self.rows]
        st.update(self.extra_state())
        return st

    @state.setter
    def state(self, st):
        st = dict(st or {})
        self.keys, self.values = st.pop("keys", None), st.pop("values", None)
        self.positions = st.pop("positions", None)
        self.rows = 0 if self.keys is None else self.keys.shape[2]
        self.load_extra_state(st)

    def extra_state(self) -> dict:
        """Side arrays of an algorithm (accumulators, query buffers)."""
        return {}

    def load_extra_state(self, st: dict) -> None:
        pass

    @property
    def meta_state(self):
        return {
            "algo": self.name,
            "options": json.dumps(self.options.as_dict()),
            "offset": self.offset,
            "layer": self.layer,
            "num_layers": self.num_layers,
            "in_prompt": self._in_prompt,
            "end_pending": self._end_pending,
            "last_multi": self._last_multi,
            "padded": self.padded,
        }

    @meta_state.setter
    def meta_state(self, m):
        self.options = self.Options(**json.loads(m["options"]))
        self.offset = int(m["offset"])
        self.layer = int(m["layer"])
        self.num_layers = int(m["num_layers"])
        self._in_prompt = bool(m["in_prompt"])
        self._end_pending = int(m["end_pending"])
        self._last_multi = bool(m["last_multi"])
        self.padded = bool(m["padded"])

    @classmethod
    def for_options(cls, options: CacheOptions) -> type[VeloxCache]:
        """The class that implements these options (a variant for some)."""
        return cls

    @classmethod
    def from_state(cls, state, meta_state):
        options = cls.Options.create(cls.name, json.loads(meta_state["options"]))
        cache = cls.for_options(options)(options)
        cache.state = state
        cache.meta_state = meta_state
        return cache

    # ---- mlx-lm features that would silently drop the algorithm ---------------
    def to_quantized(self, group_size: int = 64, bits: int = 4):
        raise UnsupportedCacheOperation(
            "mlx-lm's kv_bits quantization is not supported with veloxpatch caches "
            "(it would silently swap them for a plain quantized cache); drop "
            "kv_bits and pass it to veloxpatch.apply instead (any evicting "
            "algorithm, or algo='kivi'), or restore the patch to use mlx-lm's "
            "QuantizedKVCache"
        )

    @classmethod
    def merge(cls, caches):
        raise UnsupportedCacheOperation(
            "mlx-lm batch generation (BatchGenerator, the server) is not supported "
            "with veloxpatch caches; generate one prompt at a time, or pass an "
            "equal-length batch to model(...) directly"
        )
