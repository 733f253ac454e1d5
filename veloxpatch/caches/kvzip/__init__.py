"""`kvzip` (Kim et al., 2025): every stored pair scored by the attention it gets
while the model reconstructs the context, the best pairs of the whole model
kept under one threshold. `cache.py` is the cache, `reconstruct.py` the pass,
`choice.py` the model-wide choice, `plus.py` KVzip+'s weights."""

from .cache import KVzipCache, KVzipOptions
from .reconstruct import OVERLAP, REPEAT_FIRST, REPEAT_NEXT, repeat_inputs

__all__ = [
    "OVERLAP",
    "REPEAT_FIRST",
    "REPEAT_NEXT",
    "KVzipCache",
    "KVzipOptions",
    "repeat_inputs",
]
