"""mlx-lm's memory flags on a patched model: `max_kv_size` and `kv_bits`.

mlx-lm's `make_prompt_cache(model, max_kv_size)` calls `model.make_cache()`
without passing `max_kv_size` on (a model with its own caches ignores it), and
`generate_step(kv_bits=...)` converts caches with `to_quantized` only once
`quantized_kv_start` tokens were seen, after text has been streamed. On a
patched model either would be a silent bypass, so `Patch.make_cache` reads both
from its callers' frames when mlx-lm's own functions call it (the reads are
mlx_lm_internals', where those functions are pinned): `max_kv_size` becomes
the algorithm's budget, and `kv_bits` is refused before the first token.
"""

from __future__ import annotations

import sys

from . import mlx_lm_internals
from .errors import KV_BITS_ERROR, UnsupportedCacheOperation


def requested(depth: int = 2) -> tuple[int | None, int | None]:
    """(max_kv_size, kv_bits) mlx-lm asked for, when `model.make_cache` was
    called by mlx-lm's make_prompt_cache (`depth` frames up), else (None, None)."""
    found = mlx_lm_internals.prompt_cache_request(sys._getframe(depth))
    return found if found is not None else (None, None)


def prompt_length(depth: int = 2) -> int | None:
    """The prompt's tokens, when `model.make_cache` was called by mlx-lm's
    make_prompt_cache inside generate_step (`depth` frames up), else None."""
    return mlx_lm_internals.prompt_cache_prompt(sys._getframe(depth))


def kv_bits_in_stack(limit: int = 32):
    """`kv_bits` of an mlx-lm generate_step up the stack (a caller that passed
    its own prompt_cache): checked once per cache, on its first call."""
    return mlx_lm_internals.step_kv_bits(sys._getframe(1), limit)


def check_kv_bits(kv_bits) -> None:
    if kv_bits is not None:
        raise UnsupportedCacheOperation(KV_BITS_ERROR)


def budget_options(cache_cls, options: dict, max_kv_size: int) -> dict:
    """The options that make `max_kv_size` the budget of `cache_cls`'s
    algorithm, or a clear error."""
    algo = cache_cls.name
    if "budget" not in cache_cls.Options.option_names():
        raise UnsupportedCacheOperation(
            f"max_kv_size={max_kv_size}: {algo!r} has no budget (it keeps every "
            "token); patch with an evicting algorithm (its budget is max_kv_size) "
            "or drop max_kv_size"
        )
    if options.get("max_kv_bytes") is not None:
        raise UnsupportedCacheOperation(
            f"max_kv_size={max_kv_size} and max_kv_bytes="
            f"{options['max_kv_bytes']!r} both set {algo!r}'s budget; drop one"
        )
    return {**options, "budget": max_kv_size}
