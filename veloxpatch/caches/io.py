"""`save_cache` / `load_cache`: round-trip a list of caches through safetensors.

mlx-lm's `load_prompt_cache` only rebuilds classes it defines, so veloxpatch
writes its own index: per layer, the algorithm (or mlx-lm class, for sliding
layers) and its meta state, as JSON in the file's metadata.
"""

from __future__ import annotations

import json

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache

from ..errors import VeloxpatchError
from .base import VeloxCache

FORMAT = 1


def register_with_mlx_lm() -> None:
    """Let mlx-lm's load_prompt_cache rebuild veloxpatch caches: it looks class
    names up in `mlx_lm.models.cache`'s globals. Adds names, replaces none; run
    by `apply` and `load_cache` (importing veloxpatch changes nothing)."""
    from . import ALGORITHMS
    from .eviction import EvictingCache
    from .kv_bits import quantized_variant

    for cls in ALGORITHMS.values():
        variants = [cls]
        if issubclass(cls, EvictingCache):
            variants.append(quantized_variant(cls))
        for c in variants:
            if getattr(mlx_cache, c.__name__, c) is c:
                setattr(mlx_cache, c.__name__, c)


def save_cache(path: str, caches, metadata: dict | None = None) -> None:
    arrays, index = {}, []
    for i, c in enumerate(caches):
        if isinstance(c, VeloxCache):
            entry = {"kind": "veloxpatch", "algo": c.name, "meta": c.meta_state}
            flat = list(c.arrays().items())
        else:
            if getattr(mlx_cache, type(c).__name__, None) is not type(c):
                raise VeloxpatchError(f"cannot save cache of type {type(c).__name__}")
            meta = getattr(c, "meta_state", None)  # not every mlx-lm cache has one
            entry = {
                "kind": "mlx_lm",
                "class": type(c).__name__,
                "meta": list(meta) if meta is not None else None,
            }
            flat = tree_flatten(c.state)
        entry["scalars"] = {}
        for key, value in flat:
            if isinstance(value, mx.array):
                arrays[f"{i}/{key}"] = value
            else:
                entry["scalars"][key] = value
        entry["arrays"] = [k for k, v in flat if isinstance(v, mx.array)]
        index.append(entry)
    meta = {
        "veloxpatch": json.dumps(
            {"format": FORMAT, "caches": index, "metadata": metadata or {}}
        )
    }
    mx.save_safetensors(str(path), arrays, meta)


def load_cache(path: str, return_metadata: bool = False):
    from . import ALGORITHMS

    register_with_mlx_lm()
    arrays, meta = mx.load(str(path), return_metadata=True)
    try:
        info = json.loads(meta["veloxpatch"])
        assert info["format"] == FORMAT
    except (KeyError, ValueError, AssertionError):
        raise VeloxpatchError(f"{path} is not a veloxpatch cache file") from None
    caches = []
    for i, entry in enumerate(info["caches"]):
        flat = [(k, arrays[f"{i}/{k}"]) for k in entry["arrays"]]
        flat += list(entry["scalars"].items())
        if entry["kind"] == "veloxpatch":
            cls = ALGORITHMS[entry["algo"]]
            caches.append(cls.from_state(dict(flat), entry["meta"]))
        else:
            cls = getattr(mlx_cache, entry["class"])
            state = tree_unflatten(flat) if flat and flat[0][0].isdigit() else flat
            c = cls.from_state(state)
            if entry["meta"] is not None:
                c.meta_state = tuple(entry["meta"])
            caches.append(c)
    return (caches, info["metadata"]) if return_metadata else caches
