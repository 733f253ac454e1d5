"""`save_cache` / `load_cache`: round-trip a list of caches through safetensors.

mlx-lm's `load_prompt_cache` only rebuilds classes it defines, so veloxpatch
writes its own index: per layer, the algorithm (or mlx-lm class, for sliding
layers) and its meta state, as JSON in the file's metadata.

The file is written at exactly the path given (no `.safetensors` appended) and
read from exactly the path given, whatever its suffix; it carries a checksum of
its arrays and metadata (`checked_io`). `extra` arrays (the server's kept
logits) travel beside the caches under `extra/NAME`, covered by the checksum.
A missing, truncated, damaged or foreign file, or an index that does not
describe caches, raises `CacheFileError`.
"""

from __future__ import annotations

import json

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache

from ..checked_io import load_checked, save_checked, verify
from ..errors import CacheFileError, VeloxpatchError
from ..mlx_lm_internals import make_loadable
from . import ALGORITHMS
from .base import VeloxCache
from .eviction import EvictingCache
from .kv_bits import quantized_variant

FORMAT = 2  # 2: checksummed, written at the exact path
INDEX_KEY = "veloxpatch"
EXTRA = "extra/"  # arrays that belong to no layer


def register_with_mlx_lm() -> None:
    """Let mlx-lm's load_prompt_cache rebuild veloxpatch caches: it looks class
    names up in `mlx_lm.models.cache`'s globals (mlx_lm_internals.make_loadable).
    Adds names, replaces none; run by `apply` and `load_cache` (importing
    veloxpatch changes nothing)."""
    for cls in ALGORITHMS.values():
        variants = [cls]
        if issubclass(cls, EvictingCache):
            variants.append(quantized_variant(cls))
        for c in variants:
            make_loadable(c)


def save_cache(
    path, caches, metadata: dict | None = None, extra: dict | None = None
) -> None:
    arrays = {f"{EXTRA}{k}": v for k, v in (extra or {}).items()}
    index = []
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
    info = {"format": FORMAT, "caches": index, "metadata": metadata or {}}
    save_checked(path, arrays, {INDEX_KEY: json.dumps(info)}, CacheFileError)


def load_cache(path, return_metadata: bool = False, return_extra: bool = False):
    """The caches of `path` (then its metadata, then its `extra` arrays, as
    asked)."""
    register_with_mlx_lm()
    arrays, meta = load_checked(path, CacheFileError, "cache")
    if INDEX_KEY not in meta:
        raise CacheFileError(f"{path} is not a veloxpatch cache file")
    verify(path, arrays, meta, CacheFileError, "cache")
    entries, metadata = _index(path, meta)
    caches = [_rebuild(path, i, entry, arrays) for i, entry in enumerate(entries)]
    out = [caches] + [metadata] * return_metadata
    if return_extra:
        n = len(EXTRA)
        out.append({k[n:]: v for k, v in arrays.items() if k.startswith(EXTRA)})
    return tuple(out) if len(out) > 1 else caches


def _index(path, meta) -> tuple[list, dict]:
    """(per-layer entries, user metadata) of the index, checked for types."""
    try:
        info = json.loads(meta[INDEX_KEY])
    except ValueError:
        raise CacheFileError(f"{path}: damaged cache index (not JSON)") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        found = info.get("format") if isinstance(info, dict) else None
        raise CacheFileError(
            f"{path}: cache file format {found!r}, this veloxpatch reads {FORMAT}"
        )
    entries, metadata = info.get("caches"), info.get("metadata")
    if not isinstance(entries, list) or not isinstance(metadata, dict):
        raise CacheFileError(f"{path}: damaged cache index (no cache list)")
    for i, e in enumerate(entries):
        ok = (
            isinstance(e, dict)
            and e.get("kind") in ("veloxpatch", "mlx_lm")
            and isinstance(e.get("arrays"), list)
            and all(isinstance(k, str) for k in e["arrays"])
            and isinstance(e.get("scalars"), dict)
        )
        if not ok:
            raise CacheFileError(f"{path}: damaged cache index (layer {i})")
    return entries, metadata


def _cache_class(path, i, entry):

    if entry["kind"] == "veloxpatch":
        cls, name, meta_type = ALGORITHMS.get(entry.get("algo")), "algorithm", dict
    else:
        cls = getattr(mlx_cache, str(entry.get("class")), None)
        if not _is_mlx_lm_cache(cls):
            cls = None
        name, meta_type = "mlx-lm cache", (list, type(None))
    if cls is None:
        found = entry.get("algo", entry.get("class"))
        raise CacheFileError(f"{path}: layer {i} has unknown {name} {found!r}")
    if not isinstance(entry.get("meta"), meta_type):
        raise CacheFileError(f"{path}: damaged cache index (layer {i} meta state)")
    return cls


def _is_mlx_lm_cache(cls) -> bool:
    """One of mlx-lm's own cache classes: defined in its cache module (not one
    of ours that `register_with_mlx_lm` added there), with a `from_state`."""
    return (
        isinstance(cls, type)
        and cls.__module__ == mlx_cache.__name__
        and callable(getattr(cls, "from_state", None))
    )


def _rebuild(path, i, entry, arrays):
    cls = _cache_class(path, i, entry)
    missing = [k for k in entry["arrays"] if f"{i}/{k}" not in arrays]
    if missing:
        raise CacheFileError(f"{path}: layer {i} lacks arrays {missing}")
    flat = [(k, arrays[f"{i}/{k}"]) for k in entry["arrays"]]
    flat += list(entry["scalars"].items())
    try:
        if entry["kind"] == "veloxpatch":
            return cls.from_state(dict(flat), entry["meta"])
        state = tree_unflatten(flat) if flat and flat[0][0].isdigit() else flat
        c = cls.from_state(state)
        if entry["meta"] is not None:
            c.meta_state = tuple(entry["meta"])
        return c
    except Exception as e:  # the state was written by another version, or edited
        raise CacheFileError(
            f"{path}: layer {i} ({cls.__name__}) does not load from its saved "
            f"state: {type(e).__name__}: {e}"
        ) from None
