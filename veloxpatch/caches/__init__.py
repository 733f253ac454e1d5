"""Algorithm registry: one file per algorithm, one line here."""

from .a2ats import A2ATSCache
from .adakv import AdaKVCache
from .base import CacheOptions, VeloxCache
from .expected_attention import ExpectedAttentionCache
from .full import FullCache
from .h2o import H2OCache
from .keyformer import KeyformerCache
from .kivi import KIVICache
from .knorm import KNormCache
from .kvzip import KVzipCache
from .pyramidkv import PyramidKVCache
from .qfilters import QFiltersCache
from .snapkv import SnapKVCache
from .streaming_llm import StreamingLLMCache
from .tova import TOVACache

ALGORITHMS: dict[str, type[VeloxCache]] = {
    cls.name: cls
    for cls in (
        FullCache,
        StreamingLLMCache,
        KNormCache,
        SnapKVCache,
        PyramidKVCache,
        AdaKVCache,
        H2OCache,
        TOVACache,
        KeyformerCache,
        QFiltersCache,
        ExpectedAttentionCache,
        KIVICache,
        A2ATSCache,
        KVzipCache,
    )
}

__all__ = ["ALGORITHMS", "CacheOptions", "VeloxCache"]
