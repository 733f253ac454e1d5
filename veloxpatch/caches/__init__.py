"""Algorithm registry: one file per algorithm, one import line here. Every
cache class imported here is an algorithm, listed by name (`full` first)."""

from .a2ats import A2ATSCache
from .adakv import AdaKVCache
from .base import CacheOptions, VeloxCache
from .expected_attention import ExpectedAttentionCache
from .full import FullCache
from .h2o import H2OCache
from .keyformer import KeyformerCache
from .kivi import KIVICache
from .knorm import KNormCache
from .kvzap import KVzapCache
from .kvzip import KVzipCache
from .pyramidkv import PyramidKVCache
from .qfilters import QFiltersCache
from .snapkv import SnapKVCache
from .streaming_llm import StreamingLLMCache
from .tova import TOVACache


def _registered() -> dict[str, type[VeloxCache]]:
    found = [
        v
        for v in globals().values()
        if isinstance(v, type) and issubclass(v, VeloxCache) and v is not VeloxCache
    ]
    return {c.name: c for c in sorted(found, key=lambda c: (c.name != "full", c.name))}


ALGORITHMS: dict[str, type[VeloxCache]] = _registered()

__all__ = ["ALGORITHMS", "CacheOptions", "VeloxCache"]
