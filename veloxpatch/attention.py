"""The one patched attention forward, shared by every adapter (DESIGN: "The
patched forward"). A patched layer called without a cache runs mlx-lm's code; one
given an mlx-lm cache raises (it would silently run uncompressed)."""

from __future__ import annotations

import mlx.core as mx

from . import mlx_flags
from .caches.base import VeloxCache
from .caches.batch import BatchCache
from .errors import PatchStateError


def patched_forward(site, wrapped, attn, args, kwargs, owner=None):
    target = site.target
    x, call = target.bind(args, kwargs)
    cache = call.get("cache")
    if cache is None:  # no cache at all (a scoring pass): nothing to compress
        return wrapped(*args, **kwargs)
    if not isinstance(cache, (VeloxCache, BatchCache)):
        # An mlx-lm cache here would run uncompressed without a word.
        raise PatchStateError(
            f"layer {site.index} of this patched model was given mlx-lm's "
            f"{type(cache).__name__}; use the patch's caches (model.make_cache(), "
            "make_prompt_cache, or no prompt_cache), or restore the patch to use "
            "mlx-lm's own caches"
        )
    layer = site.shards.layer_offset + site.index  # numbered in the whole model
    if cache.layer != layer:
        raise PatchStateError(
            f"layer {layer} was given the cache of layer {cache.layer} (a "
            "cache list from another model, or out of order)"
        )
    if not cache.flags_checked:  # once per cache: its first call here
        algo = getattr(owner, "algo", cache.name)
        if cache.name != algo:
            raise PatchStateError(
                f"this model is patched with {algo!r} but was given {cache.name!r} "
                "caches (a file saved under another patch?); apply that algorithm"
            )
        mlx_flags.check_kv_bits(mlx_flags.kv_bits_in_stack())  # mlx-lm's kv_bits
        cache.flags_checked = True
    if isinstance(call.get("mask"), mx.array):
        # Our caches never hand mlx-lm an array mask, so this is a padded batch or
        # a caller's own mask, which the cache cannot honour.
        raise PatchStateError(
            "padded batches and custom attention masks are not supported with "
            "veloxpatch caches; use batch size 1 or equal-length prompts"
        )
    # how the model is split across processes, for statistics over all heads
    # (a cache loaded from a file was built without a model)
    cache.shards = site.shards
    B, L, _ = x.shape
    q, k, v = target.project(attn, x)
    query_scale = None
    if target.query_scale is not None:
        query_scale = target.query_scale(attn, L, cache.offset, call)
    # the hidden state entering attention: KVzip+ weighs by ||x|| and W_o,
    # kvzap scores from x, a probe may watch it (cleared once attended)
    if cache.wants_layer_input or getattr(cache, "probe", None) is not None:
        cache.layer_input = (x, attn.o_proj)
    out = cache.attend(
        q, k, v, rope=attn.rope, scale=attn.scale, query_scale=query_scale
    )
    cache.layer_input = None
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
