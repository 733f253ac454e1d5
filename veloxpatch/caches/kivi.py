"""`kivi` (Liu et al., 2024): keys quantized per channel, values per token, the
most recent tokens kept in full precision.

Quantization is asymmetric min/max, as in the paper: one scale and one zero
point per group (stored in fp16), integer codes packed as bit planes. Keys are grouped
along tokens: each channel of each run of `group` tokens shares a scale, so the
outlier channels of keys stay resolved. Values are grouped along channels, per
token. New tokens enter the full-precision residual; once it holds more than
`residual` tokens the oldest whole groups of `group` tokens are flushed to
quantized storage, so the residual holds between `residual` and
`residual + group - 1` tokens. Attention dequantizes on the fly: quantized
tokens never have a full-precision copy between calls.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ..errors import OptionError
from .base import CacheOptions, VeloxCache
from .eviction import _check_int

BITS = (2, 3, 4, 8)
GROUPS = (32, 64, 128)  # multiples of the 32 codes a packed word holds


@dataclasses.dataclass
class KIVIOptions(CacheOptions):
    """`bits`: code width. `group`: tokens per key group and channels per value
    group. `residual`: newest tokens always kept in full precision."""

    bits: int = 2
    group: int = 32
    residual: int = 128

    def __post_init__(self):
        if self.bits not in BITS:
            raise OptionError(f"bits must be one of {BITS}, got {self.bits!r}")
        if self.group not in GROUPS:
            raise OptionError(f"group must be one of {GROUPS}, got {self.group!r}")
        _check_int("residual", self.residual, 0)

    def bind(self, model):
        from model_adapters.base import head_dim

        dims = {head_dim(layer.self_attn) for layer in model.layers}
        if any(d % self.group for d in dims):
            raise OptionError(
                f"group ({self.group}) must divide the head dim {sorted(dims)}: "
                "values are quantized per token in groups of channels"
            )
        return self


_SHIFTS = mx.arange(32, dtype=mx.uint32)


def quantize(x: mx.array, group: int, bits: int) -> tuple:
    """(codes, scales, zeros) of x along its last axis in groups of `group`:
    scale = (max - min) / (2^bits - 1), zero = min, code = round((x - zero) /
    scale). Codes are packed as bit planes, `bits` uint32 words per 32 values;
    scales and zero points are stored in fp16."""
    *lead, n = x.shape
    g = x.astype(mx.float32).reshape(*lead, n // group, group)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    zeros, scales = (
        lo.astype(mx.float16),
        ((hi - lo) / (2**bits - 1)).astype(mx.float16),
    )
    s = mx.maximum(scales.astype(mx.float32), 1e-8)  # constant groups: code 0
    codes = mx.clip(mx.round((g - zeros.astype(mx.float32)) / s), 0, 2**bits - 1)
    codes = codes.astype(mx.uint32).reshape(*lead, n // 32, 32)
    planes = [((codes >> j) & 1) << _SHIFTS for j in range(bits)]
    packed = mx.stack([p.sum(-1).astype(mx.uint32) for p in planes], axis=-1)
    return packed.reshape(*lead, n // 32 * bits), scales[..., 0], zeros[..., 0]


def dequantize(q: tuple, group: int, bits: int, dtype) -> mx.array:
    packed, scales, zeros = q
    *lead, words = packed.shape
    planes = packed.reshape(*lead, words // bits, bits)
    codes = sum(
        ((planes[..., j : j + 1] >> _SHIFTS) & 1) << j for j in range(bits)
    )  # [..., n / 32, 32]
    n = words // bits * 32
    g = codes.reshape(*lead, n // group, group).astype(mx.float32)
    out = g * scales.astype(mx.float32)[..., None] + zeros.astype(mx.float32)[..., None]
    return out.reshape(*lead, n).astype(dtype)


def _cat(a: tuple | None, b: tuple, axis: int) -> tuple:
    return b if a is None else tuple(mx.concatenate(p, axis=axis) for p in zip(a, b))


class KIVICache(VeloxCache):
    name = "kivi"
    summary = "keys per channel, values per token, min/max quantized; recent in fp"
    Options = KIVIOptions

    def __init__(self, options=None, layer=0, num_layers=1):
        super().__init__(options, layer, num_layers)
        # self.keys / self.values: the full-precision residual [B, Hkv, Tr, D]
        self.qkeys = None  # keys transposed [B, Hkv, D, Tq], quantized along Tq
        self.qvalues = None  # values [B, Hkv, Tq, D], quantized along D
        self.quantized = 0  # Tq: tokens in quantized storage

    # ---- storage ------------------------------------------------------------------
    def _append(self, k, v, offset):
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = mx.concatenate([self.keys, k], axis=2)
            self.values = mx.concatenate([self.values, v], axis=2)
        self.rows = self.quantized + self.keys.shape[2]
        return self._view()

    def _view(self):
        if not self.quantized:
            return self.keys, self.values
        o = self.options
        keys = dequantize(self.qkeys, o.group, o.bits, self.keys.dtype)
        values = dequantize(self.qvalues, o.group, o.bits, self.values.dtype)
        keys = mx.concatenate([keys.swapaxes(2, 3), self.keys], axis=2)
        return keys, mx.concatenate([values, self.values], axis=2)

    def after_attend(self, q, new_rows):
        """Flush the oldest whole groups beyond `residual` to quantized storage."""
        o = self.options
        n = (self.keys.shape[2] - o.residual) // o.group * o.group
        if n <= 0:
            return
        k, v = self.keys[:, :, :n], self.values[:, :, :n]
        self.qkeys = _cat(self.qkeys, quantize(k.swapaxes(2, 3), o.group, o.bits), 3)
        self.qvalues = _cat(self.qvalues, quantize(v, o.group, o.bits), 2)
        self.keys, self.values = self.keys[:, :, n:], self.values[:, :, n:]
        self.quantized += n

    def side_arrays(self):
        side = [self.keys, self.values]
        for q in (self.qkeys, self.qvalues):
            side += list(q) if q is not None else []
        return side

    # ---- contract -----------------------------------------------------------------
    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        total = self.keys.nbytes + self.values.nbytes
        for q in (self.qkeys, self.qvalues):
            total += sum(a.nbytes for a in q) if q is not None else 0
        return total

    def arrays(self) -> dict:
        if self.keys is None:
            return {}
        st = {"keys": self.keys, "values": self.values}
        for name, q in (("qkeys", self.qkeys), ("qvalues", self.qvalues)):
            if q is not None:
                st.update({f"{name}.{i}": a for i, a in enumerate(q)})
        return st

    @VeloxCache.state.setter
    def state(self, st):
        st = dict(st or {})
        self.keys, self.values = st.get("keys"), st.get("values")
        for name in ("qkeys", "qvalues"):
            parts = [st.get(f"{name}.{i}") for i in range(3)]
            setattr(self, name, tuple(parts) if parts[0] is not None else None)
        self.quantized = 0 if self.qvalues is None else self.qvalues[1].shape[2]
        self.rows = 0 if self.keys is None else self.quantized + self.keys.shape[2]
