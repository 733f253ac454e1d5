"""`streaming_llm` (Xiao et al., 2023): attention sinks plus the most recent tokens.

Kept rows keep their original rotation and positions (never renumbered).
"""

from .eviction import EvictingCache


class StreamingLLMCache(EvictingCache):
    name = "streaming_llm"
    batchable = True  # one cache per sequence (caches/batch.py)
    summary = "sinks + most recent tokens (no queries needed); budget = rows kept"

    def scores(self, q):
        return self.positions_view()  # newer is better; sinks are protected
