"""Errors a user can cause. The CLI prints them as one line and exits 2."""


class VeloxpatchError(ValueError):
    """Base class for every user-facing veloxpatch error."""


class UnsupportedModelError(VeloxpatchError):
    """The model's architecture has no adapter, or the adapter does not fit it."""


class MlxLmChangedError(UnsupportedModelError):
    """The installed mlx-lm differs from the one veloxpatch was checked against,
    in something veloxpatch relies on (an adapter's attention class, or an
    internal listed in mlx_lm_internals)."""


class OptionError(VeloxpatchError):
    """An unknown algorithm, an unknown option, or an invalid option value."""


class PatchStateError(VeloxpatchError):
    """Patching a patched model, or using a cache outside a patched model."""


class UnsupportedCacheOperation(VeloxpatchError):
    """An mlx-lm feature that would silently bypass a veloxpatch cache."""


class CalibrationError(VeloxpatchError):
    """A calibration file that does not fit the model, or cannot be read."""


class FileFormatError(VeloxpatchError):
    """A GGUF or safetensors file that is damaged or that mlx cannot read."""


class CacheFileError(FileFormatError):
    """A saved cache file that is missing, damaged or not a veloxpatch cache."""


# raised wherever mlx-lm's kv_bits would reach a veloxpatch cache
KV_BITS_ERROR = (
    "mlx-lm's kv_bits quantization is not supported with veloxpatch caches "
    "(it would silently swap them for a plain quantized cache); drop kv_bits and "
    "pass it to veloxpatch.apply instead (any evicting algorithm, or "
    "algo='kivi'), or restore the patch to use mlx-lm's QuantizedKVCache"
)
