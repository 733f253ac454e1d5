"""Algorithm registry: one file per algorithm, one line here."""

from .base import CacheOptions, VeloxCache
from .full import FullCache
from .knorm import KNormCache
from .streaming_llm import StreamingLLMCache

ALGORITHMS: dict[str, type[VeloxCache]] = {
    cls.name: cls for cls in (FullCache, StreamingLLMCache, KNormCache)
}

__all__ = ["ALGORITHMS", "CacheOptions", "VeloxCache"]
