"""Algorithm registry: one file per algorithm, one line here."""

from .adakv import AdaKVCache
from .base import CacheOptions, VeloxCache
from .full import FullCache
from .knorm import KNormCache
from .pyramidkv import PyramidKVCache
from .snapkv import SnapKVCache
from .streaming_llm import StreamingLLMCache

ALGORITHMS: dict[str, type[VeloxCache]] = {
    cls.name: cls
    for cls in (
        FullCache,
        StreamingLLMCache,
        KNormCache,
        SnapKVCache,
        PyramidKVCache,
        AdaKVCache,
    )
}

__all__ = ["ALGORITHMS", "CacheOptions", "VeloxCache"]
