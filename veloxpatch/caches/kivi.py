"""`kivi` (Liu et al., 2024): keys quantized per channel, values per token, the
most recent tokens kept in full precision.

Quantization is asymmetric min/max, as in the paper: one scale and one zero
point per group, integer codes in mlx's packed layout (`quantized.py`). Keys
are grouped along tokens: each channel of each run of `group` tokens shares a
scale, so the outlier channels of keys stay resolved. Values are grouped along
channels, per token. New tokens enter the full-precision residual; once it
holds more than `residual` tokens the oldest whole groups of `group` tokens
are quantized, so the residual holds between `residual` and `residual + group
- 1` tokens. Attention reads the codes on mlx's quantized kernels: quantized
tokens never have a full-precision copy between calls. The spec is
`kv_quant.KVQuant`, as `kv_bits=` on the eviction algorithms (`kv_bits.py`).
"""

from __future__ import annotations

import dataclasses

from ..errors import OptionError
from .base import VeloxCache
from .kv_bits import QuantizedKV
from .kv_quant import FIELDS, KVQuant, check_bindable, take_quant, upgrade_saved
from .options import CacheOptions


@dataclasses.dataclass
class KIVIOptions(CacheOptions):
    """`quant`: the rows' quantization (`kv_quant.KVQuant`), built from the
    shorthand keywords `bits` (default 2), `key_bits`, `group`, `residual`
    (and research's `recipe`)."""

    quant: KVQuant = dataclasses.field(default_factory=KVQuant)

    @classmethod
    def option_names(cls):
        return [*FIELDS, "quant"]

    @classmethod
    def fold(cls, options):
        return {"quant": take_quant(options, "", required=True), **options}

    @classmethod
    def from_saved(cls, algo, options):
        try:
            options = upgrade_saved(dict(options), "")
        except OptionError as e:
            raise OptionError(f"{algo}: {e}") from None
        return cls.create(algo, options)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.quant, KVQuant):
            raise OptionError(f"quant must be a veloxpatch.KVQuant, got {self.quant!r}")

    def bind(self, model, dims):
        check_bindable(dims, self.quant)
        return super().bind(model, dims)

    def as_dict(self):
        return self.quant.flat("")


class KIVICache(QuantizedKV, VeloxCache):
    name = "kivi"
    batchable = True  # one cache per sequence (caches/batch.py)
    summary = "keys per channel, values per token, min/max quantized; recent in fp"
    Options = KIVIOptions
