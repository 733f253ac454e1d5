"""`kivi` (Liu et al., 2024): keys quantized per channel, values per token, the
most recent tokens kept in full precision.

Quantization is asymmetric min/max, as in the paper: one scale and one zero
point per group (stored in fp16), integer codes packed as bit planes
(`quantized.py`). Keys are grouped along tokens: each channel of each run of
`group` tokens shares a scale, so the outlier channels of keys stay resolved.
Values are grouped along channels, per token. New tokens enter the
full-precision residual; once it holds more than `residual` tokens the oldest
whole groups of `group` tokens are quantized, so the residual holds between
`residual` and `residual + group - 1` tokens. Attention dequantizes on the fly:
quantized tokens never have a full-precision copy between calls. The same
storage serves `kv_bits=` on the eviction algorithms (`kv_bits.py`).
"""

from __future__ import annotations

import dataclasses

from .base import VeloxCache
from .kv_bits import (
    QuantizedKV,
    check_grid,
    check_group_divides,
    check_key_bits,
    check_qjl,
    check_quant,
    check_rotatable,
    check_rotate,
    check_round,
    dense_sinks,
    logit_debias,
)
from .options import CacheOptions


@dataclasses.dataclass
class KIVIOptions(CacheOptions):
    """`bits`: code width (2, 3, 4, 8), or "adaptive": 2 to 4 per KV head with a
    mean of `target_bits`. `key_bits`: the keys' width when not `bits` (values
    keep `bits`). `group`: tokens per key group and channels per value group.
    `residual`: newest tokens always kept in full precision.
    `kv_rotate="hadamard"`: quantized rows stored rotated by a random Hadamard
    transform per head (TurboQuant, `quantized.py`); `kv_rotate="query"`: the
    same after scaling key channels by the prompt's own queries, so rounding
    error lands where queries look least (`quantized.py`);
    `kv_rotate="query_basis"`: keys mapped by A, queries by A^-1 first, A
    balancing the keys' spread and the queries' moment in their joint basis,
    the least logit error of any linear map (`quantized.py`). `kv_keys="token"`:
    keys quantized per token, along channels, as values (KIVI's are per channel).
    `kv_grid`: "minmax" (the paper's), "mlx" (mx.quantize), "gaussian"
    (TurboQuant's scalar quantizer) or "mxfp4" (`quantized.py`). `kv_scales=
    "float16"`: each group's scale and bias in fp16 (default: the model's).
    `kv_dense="float16"`: the rows not quantized (residual, sinks) in fp16.
    `kv_qjl=True`: TurboQuant's 1-bit residual on keys (`kv_keys="token"`).
    `kv_sinks`: the first rows held dense, never quantized (`quantized.py`);
    default 1 with a rotation (our TurboQuant-style path, its defaults chosen by
    measurement: docs/results.md), 0 without (KIVI's definition).
    `kv_debias=True`: each quantized key's logit less half its expected
    rounding variance, so exp(logit) is unbiased (`quantized.py`).
    `kv_round="query"`: keys rounded channel by channel with each rounding
    error fed forward to the key's later channels (GPTQ's rule), weighed by
    the second moment of the queries to come: the prompt's own, moved by RoPE
    to the next positions (`quantized.py`)."""

    bits: int | str = 2
    key_bits: int | None = None
    group: int = 32
    residual: int = 128
    target_bits: float | None = None
    kv_rotate: str | None = None
    kv_keys: str = "channel"
    kv_grid: str = "minmax"
    kv_scales: str = "model"
    kv_dense: str = "model"
    kv_qjl: bool = False
    kv_sinks: int | None = None
    kv_debias: bool | None = None
    kv_round: str = "nearest"

    def __post_init__(self):
        super().__post_init__()
        check_quant(self.bits, self.group, self.residual, self.target_bits)
        check_rotate(self.kv_rotate, self.kv_keys, self.bits)
        check_grid(
            self.kv_grid, self.bits, self.group, "", self.kv_scales, self.kv_dense
        )
        check_qjl(self.kv_qjl, self.bits, self.kv_keys, self.kv_grid)
        check_round(
            self.kv_round, self.bits, self.kv_keys, self.kv_grid, self.kv_debias
        )
        check_key_bits(self.key_bits, self.bits, self.kv_qjl, self.kv_grid)
        self.kv_sinks = dense_sinks(self.kv_sinks, self.kv_rotate, self.bits)
        self.kv_debias = logit_debias(
            self.kv_debias, self.bits, self.kv_grid, self.kv_qjl
        )

    def bind(self, model, dims):
        check_group_divides(dims, self.group)
        check_rotatable(dims, self.kv_rotate)
        return super().bind(model, dims)

    # the names the quantized storage reads
    kv_bits = property(lambda self: self.bits)
    kv_key_bits = property(lambda self: self.key_bits)
    kv_group = property(lambda self: self.group)
    kv_residual = property(lambda self: self.residual)


class KIVICache(QuantizedKV, VeloxCache):
    name = "kivi"
    batchable = True  # one cache per sequence (caches/batch.py)
    summary = "keys per channel, values per token, min/max quantized; recent in fp"
    note = (
        "bits='adaptive' keeps the prompt in full precision until it ends, then "
        "chooses each head's width from its attention and quantizes."
    )
    Options = KIVIOptions
