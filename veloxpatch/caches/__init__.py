"""Algorithm registry: one file per algorithm, one line here."""

from .base import CacheOptions, VeloxCache
from .full import FullCache

ALGORITHMS: dict[str, type[VeloxCache]] = {
    FullCache.name: FullCache,
}

__all__ = ["ALGORITHMS", "CacheOptions", "VeloxCache"]
