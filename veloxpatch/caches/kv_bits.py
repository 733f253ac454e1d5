"""Quantized storage for any cache: `kivi`, and `kv_bits=` on eviction algorithms.

New rows enter a full-precision residual; after each call (after the algorithm
has evicted) the oldest whole groups beyond `residual` rows are quantized
(`quantized.QuantizedStore`). Attention and eviction both see the quantized rows
dequantized on the fly, so an algorithm scores exactly the keys the model
attended with. Eviction keeps, per head, any rows: the rows every head keeps
from quantized storage stay quantized untouched; a head that keeps more of them
than the others has the extra few moved to the residual as their dequantized
values (requantized at the next flush), so every head holds the same rows.

`kv_bits="adaptive"` keeps the prompt in full precision until it ends, then
gives each KV head 2, 3 or 4 bits from the entropy of its real attention over
the last prompt window (`allocate_bits`), and quantizes.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from ..errors import OptionError
from .attention_probs import query_probs
from .options import check_choice, check_int
from .quantized import QuantizedStore

BITS = (2, 3, 4, 8)
GROUPS = (32, 64, 128)  # multiples of the 32 codes a packed word holds
ADAPTIVE_WIDTHS = (2, 3, 4)
ENTROPY_WINDOW = 32  # last prompt queries whose attention sets adaptive widths


def check_quant(bits, group, residual, target_bits, prefix: str = "") -> None:
    """Validate quantization options (`prefix`: "kv_" on eviction algorithms,
    where bits may be None: no quantization)."""
    if bits is None and prefix:
        pass
    elif bits != "adaptive" and (isinstance(bits, bool) or bits not in BITS):
        raise OptionError(
            f"{prefix}bits must be one of {BITS} or 'adaptive', got {bits!r}"
        )
    check_choice(f"{prefix}group", group, GROUPS)
    check_int(f"{prefix}residual", residual, 0)
    if bits == "adaptive":
        lo, hi = ADAPTIVE_WIDTHS[0], ADAPTIVE_WIDTHS[-1]
        ok = isinstance(target_bits, (int, float)) and not isinstance(target_bits, bool)
        if not ok or not lo <= target_bits <= hi:
            raise OptionError(
                f"target_bits must be a number in [{lo}, {hi}] with "
                f"{prefix}bits='adaptive', got {target_bits!r}"
            )
    elif target_bits is not None:
        raise OptionError(f"target_bits needs {prefix}bits='adaptive'")


def check_group_divides(dims, group: int, prefix: str = "") -> None:
    widths = set(dims.head_dims)
    if any(d % group for d in widths):
        raise OptionError(
            f"{prefix}group ({group}) must divide the head dim {sorted(widths)}: "
            "values are quantized per token in groups of channels"
        )


def layer_total(target: float, heads: int, layer: int) -> int:
    """Bits of a layer's heads together: running rounding of target x heads over
    the layers, so the model-wide mean is on target even when a layer's is not."""

    def upto(n):
        return math.floor(target * heads * n + 0.5)

    return upto(layer + 1) - upto(layer)


def allocate_bits(entropy: list[float], total: int) -> tuple[int, ...]:
    """Widths from {2, 3, 4} summing to `total` (at most): each head weighs
    exp(entropy) (how many rows its attention spreads over) and each extra bit
    goes where it removes the most weighted error, w x 4^-bits. Heads with equal
    weight and width are served together or not at all, so the result follows
    the heads when they are permuted; bits such a tie cannot share are left out."""
    lo, hi = ADAPTIVE_WIDTHS[0], ADAPTIVE_WIDTHS[-1]
    weights = [float(f"{math.exp(e):.6g}") for e in entropy]
    bits = [lo] * len(weights)
    left = total - lo * len(weights)
    frozen = set()
    while left > 0:
        gains = {
            h: w * 4.0 ** -bits[h]
            for h, w in enumerate(weights)
            if bits[h] < hi and h not in frozen
        }
        if not gains:
            break
        best = max(gains.values())
        tied = [h for h, g in gains.items() if g == best]
        if len(tied) > left:
            frozen.update(tied)
            continue
        for h in tied:
            bits[h] += 1
        left -= len(tied)
    return tuple(bits)


class QuantizedKV:
    """Mixin over a VeloxCache: the storage described above. Reads the options
    `kv_bits`, `kv_group`, `kv_residual`, `target_bits`."""

    def __init__(self, options=None, layer=0, num_layers=1):
        super().__init__(options, layer, num_layers)
        # self.keys / self.values: the full-precision residual [B, Hkv, Tr, D]
        self.store: QuantizedStore | None = None
        self.window_q = None  # adaptive: last prompt queries [B, Hq, W, D]

    # ---- storage ------------------------------------------------------------------
    @property
    def quantized(self) -> int:
        return 0 if self.store is None else self.store.rows

    def _append(self, k, v, offset):
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = mx.concatenate([self.keys, k], axis=2)
            self.values = mx.concatenate([self.values, v], axis=2)
        if self.positions is not None:
            B, H, L = *k.shape[:2], k.shape[2]
            new = mx.arange(offset, offset + L, dtype=mx.int32)
            self.positions = mx.concatenate(
                [self.positions, mx.broadcast_to(new, (B, H, L))], axis=2
            )
        self.rows = self.quantized + self.keys.shape[2]
        return self._view()

    def _view(self):
        if not self.quantized:
            return self.keys, self.values
        keys, values = self.store.dequantize(self.keys.dtype)
        keys = mx.concatenate([keys, self.keys], axis=2)
        return keys, mx.concatenate([values, self.values], axis=2)

    def truncate_rows(self, n):
        tq = self.quantized
        if n >= tq:
            self.keys, self.values = (
                self.keys[:, :, : n - tq],
                self.values[:, :, : n - tq],
            )
        else:
            B, H = self.keys.shape[:2]
            self.store.take(mx.broadcast_to(mx.arange(n, dtype=mx.int32), (B, H, n)))
            self.keys, self.values = self.keys[:, :, :0], self.values[:, :, :0]
        if self.positions is not None:  # held exactly, not in a grown buffer
            self.positions = self.positions[..., :n]
        self.rows = n

    def trim(self, n):
        n = super().trim(n)
        if n and self.window_q is not None:
            kept = self.window_q.shape[2] - n
            self.window_q = self.window_q[:, :, :kept] if kept > 0 else None
        return n

    def take_stored(self, idx):
        idx = idx.astype(mx.int32)  # argsort gives uint32: row - tq must go negative
        tq = self.quantized
        if not tq:
            self.keys = mx.take_along_axis(self.keys, idx[..., None], axis=2)
            self.values = mx.take_along_axis(self.values, idx[..., None], axis=2)
        else:
            # The first n rows every head keeps from quantized storage stay there;
            # a head's later quantized rows go to the residual, dequantized.
            lead = mx.cumprod((idx < tq).astype(mx.int32), axis=-1).sum(-1)
            # over the heads of every rank, so every rank quantizes the same rows
            n = int(self.shards.all_heads(lead).min().item())
            rest = idx[..., n:]
            if rest.shape[-1]:
                old = self.store.clone()
                old.take(mx.minimum(rest, tq - 1))
                dk, dv = old.dequantize(self.keys.dtype)
                if self.keys.shape[2]:
                    is_q = (rest < tq)[..., None]
                    r = mx.maximum(rest - tq, 0)[..., None]
                    rk = mx.take_along_axis(self.keys, r, axis=2)
                    rv = mx.take_along_axis(self.values, r, axis=2)
                    dk, dv = mx.where(is_q, dk, rk), mx.where(is_q, dv, rv)
                self.keys, self.values = dk, dv  # (an empty residual: all moved)
            else:
                self.keys, self.values = self.keys[:, :, :0], self.values[:, :, :0]
            self.store.take(idx[..., :n])

    # ---- when rows are quantized --------------------------------------------------
    @property
    def _adaptive(self) -> bool:
        return self.options.kv_bits == "adaptive"

    def after_attend(self, q, new_rows):
        super().after_attend(q, new_rows)  # the algorithm evicts first
        if self._adaptive and self.store is None:
            w = q if self.window_q is None else mx.concatenate([self.window_q, q], 2)
            self.window_q = w[:, :, -ENTROPY_WINDOW:]
        self._flush()

    def end_prompt(self):
        if self._adaptive and self.store is None and self.window_q is not None:
            entropy = self.head_entropy()  # of the attention the prompt really had
            super().end_prompt()
            # the layer's heads share the bits, those of other ranks included
            total = layer_total(self.options.target_bits, len(entropy), self.layer)
            bits = allocate_bits(entropy, total)[self.shards.head_slice(len(entropy))]
            self.store = QuantizedStore(bits, self.options.kv_group)
            self.window_q = None
        else:
            super().end_prompt()
        self._flush()

    def head_entropy(self) -> list[float]:
        """Entropy of each KV head's attention (mean over the window's queries and
        the query heads of its group), for every KV head of the layer (of every
        rank, on a sharded model)."""
        keys, _ = self._view()
        L = self.window_q.shape[2]
        _, p = query_probs(
            self.window_q, keys, self.positions_view(), self.offset - L, self.scale
        )
        ent = -mx.where(p > 0, p * mx.log(p), 0.0).sum(-1)  # [B, Hkv, G, L]
        return self.shards.all_heads(ent.mean(axis=(0, 2, 3)), axis=0).tolist()

    def _flush(self) -> None:
        """Quantize the oldest whole groups beyond `kv_residual` rows."""
        o = self.options
        if self.store is None:
            if self._adaptive or self.keys is None:
                return  # adaptive: widths are chosen when the prompt ends
            self.store = QuantizedStore((o.kv_bits,) * self.keys.shape[1], o.kv_group)
        n = (self.keys.shape[2] - o.kv_residual) // o.kv_group * o.kv_group
        if n <= 0:
            return
        self.store.append(self.keys[:, :, :n], self.values[:, :, :n])
        self.keys, self.values = self.keys[:, :, n:], self.values[:, :, n:]

    def side_arrays(self):
        side = super().side_arrays() + [self.keys, self.values]
        side += [] if self.store is None else self.store.arrays()
        return side + ([] if self.window_q is None else [self.window_q])

    # ---- contract -----------------------------------------------------------------
    def held_arrays(self):
        store = [] if self.store is None else self.store.arrays()
        return super().held_arrays() + store

    def storage_arrays(self) -> dict:
        st = {"keys": self.keys, "values": self.values}  # the residual
        if self.positions is not None:
            st["positions"] = self.positions
        if self.store is not None:
            st.update(self.store.state())
        if self.window_q is not None:
            st["window_q"] = self.window_q
        return st

    def load_storage(self, st):
        self.store = QuantizedStore.from_state(st, self.options.kv_group)
        for k in [k for k in st if k == "q.bits" or k[:1] + k[2:3] == "q."]:
            st.pop(k)
        self.window_q = st.pop("window_q", None)
        super().load_storage(st)
        self.rows += self.quantized

    def clone(self):
        new = super().clone()
        new.store = None if self.store is None else self.store.clone()
        return new


@functools.cache
def quantized_variant(cls: type) -> type:
    """`cls` storing its rows quantized (eviction algorithms with `kv_bits`)."""
    doc = f"{cls.__name__} with KIVI-quantized rows (kv_bits)."
    return type(cls.__name__ + "KVBits", (QuantizedKV, cls), {"__doc__": doc})
