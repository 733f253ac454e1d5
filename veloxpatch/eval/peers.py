"""Comparison arms, what a user would reach for instead of veloxpatch: mlx-lm's
own caches and the eviction caches of the cache-only library veloxquant-mlx
(optional, imported only when asked for), built for an UNPATCHED model and used
as `prompt_cache` (generate_step) or `model(x, cache=caches)`."""

from __future__ import annotations

import contextlib
import io
import math
from dataclasses import dataclass, fields
from functools import partial

import mlx_lm.models.cache as mlc

from .. import api
from ..caches.options import check_int
from ..errors import OptionError, PatchStateError
from ..pricing import full_bytes, parse_size


@dataclass(frozen=True)
class Peer:
    """A veloxquant method standing in for one of ours (same name): its options
    class, its field for our `budget` (rows kept per layer and KV head) and our
    other options -> its fields."""

    options_cls: str
    budget: str
    fields: dict


def _peer(options_cls, prefix, *same, budget="budget", **ours):
    ours = {"sinks": "n_sink", **{k: k for k in same}, **ours}
    return Peer(options_cls, prefix + budget, {k: prefix + v for k, v in ours.items()})


_KF = ("recent", "tau_init", "tau_end", "seed")
# Every peer scores with the incoming KEYS as stand-in queries (a cache never
# sees a query), stores fp16 (bf16 for bf16 models) and picks rows per KV head.
PEER_ALGOS: dict[str, Peer] = {
    # Last `window` keys score all keys (not causal, mean, no pooling); the
    # window is not kept as such, and decode rows are never evicted.
    "snapkv": _peer("SnapKVOptions", "snap_", window="obs_window"),
    # H2O scoring (not SnapKV's), a linear taper over layers (`pyramid_beta` is
    # not our beta); evicts BEFORE a chunk attends, so the chunk sees fewer rows.
    "pyramidkv": _peer("PyramidKVOptions", "pyramid_"),
    # `grace`: newest rows protected, like our `recent`; scores decay 0.98/step.
    "h2o": _peer("H2OOptions", "h2o_", recent="grace"),
    # The newest key's attention per KV head (ours: last query, mean over heads).
    "tova": _peer("TOVAOptions", "tova_"),
    # Gumbel noise frozen per position (ours is redrawn every call).
    "keyformer": _peer(
        "KeyformerOptions", "keyformer_", *_KF, tau_steps="anneal_steps"
    ),
    # Their window excludes the sinks, our budget includes them.
    "streaming_llm": _peer("StreamingLLMOptions", "stream_", budget="window_size"),
    "knorm": _peer("L2NormOptions", "knorm_", "recent"),
    # Their filter comes from the first 128 KEYS (no queries); our `window` is
    # their `recent` (default 0, ours 64: name it to compare like with like).
    "qfilters": _peer("QFiltersOptions", "qfilters_", window="recent"),
}
# Same name, another algorithm.
_NO_PEER = {"adakv": "theirs allocates quantization bits per head, evicts nothing"}


def _veloxquant():
    try:
        from veloxquant_mlx.cache import options
        from veloxquant_mlx.cache.base import KVCacheConfig
        from veloxquant_mlx.integration.mlx_lm_patch import patch_model_kv_cache
    except ImportError as e:
        msg = "veloxquant arms need the optional package veloxquant-mlx"
        raise ImportError(f"{msg} (pip install veloxquant-mlx): {e}") from e
    return options, KVCacheConfig, patch_model_kv_cache


def veloxquant_available() -> bool:
    try:
        return bool(_veloxquant())
    except ImportError:
        return False


def _unpatched(model) -> None:
    # A patched model calls cache.attend, which no peer cache has.
    if api.patch_of(model) is not None:
        raise PatchStateError("comparison arms need an unpatched model")


def _only(options: dict, allowed, what: str) -> None:
    if unknown := sorted(set(options) - set(allowed)):
        raise OptionError(
            f"unknown option(s) {', '.join(unknown)} for {what}; "
            f"valid: {', '.join(sorted(allowed)) or '(none)'}"
        )


_MLX_KINDS = {  # mlx-lm arms and their options
    "unpatched": (),
    "rotating": ("budget", "sinks", "max_kv_bytes"),
    "quantized": ("kv_bits", "group_size"),
}


def _mlx_factory(kind: str, options: dict):
    """Validate an mlx-lm arm; the cache class to put on full-attention layers
    (None: the model's own caches)."""
    if kind not in _MLX_KINDS:
        raise OptionError(
            f"unknown mlx-lm arm {kind!r}; available: {', '.join(_MLX_KINDS)}"
        )
    _only(options, _MLX_KINDS[kind], kind)
    if kind == "unpatched":
        return None
    if kind == "rotating":
        # Built here, not via max_kv_size: mlx-lm ignores that for models that
        # define make_cache (llama, qwen, mistral do).
        budget, sinks = options.get("budget"), options.get("sinks", 4)
        if options.get("max_kv_bytes") is not None:
            if budget is not None:
                raise OptionError("rotating: give budget or max_kv_bytes, not both")
            parse_size(options["max_kv_bytes"])
            budget = 2**30  # validated here; mlx_caches prices it on the model
        check_int("budget", budget, 1)
        check_int("sinks", sinks, 0)
        if sinks >= budget:
            raise OptionError(f"budget ({budget}) must exceed sinks ({sinks})")
        return partial(mlc.RotatingKVCache, max_size=budget, keep=sinks)
    # As mlx-lm's kv_bits with quantized_kv_start=0 (default 5000: nothing
    # below 5,000 tokens would be quantized).
    bits, group = options.get("kv_bits"), options.get("group_size", 64)
    if bits not in (2, 3, 4, 5, 6, 8):
        raise OptionError(f"kv_bits must be one of 2-6, 8, got {bits!r}")
    if group not in (32, 64, 128):
        raise OptionError(f"group_size must be 32, 64 or 128, got {group!r}")
    return partial(mlc.QuantizedKVCache, group_size=group, bits=bits)


def mlx_caches(model, kind: str, options: dict) -> list:
    """mlx-lm's caches: "unpatched" (the model's own), "rotating" (budget,
    sinks=4) on every full-attention layer (a sliding-window layer keeps the
    model's own RotatingKVCache), or "quantized", which starts as the model's
    own and is converted by `quantizer` after each prefill chunk."""
    if options.get("max_kv_bytes") is not None:
        options = rotating_options(model, options)
    make = _mlx_factory(kind, options)
    _unpatched(model)
    caches = mlc.make_prompt_cache(model)
    if make is None or kind == "quantized":
        return caches
    return [make() if type(c) is mlc.KVCache else c for c in caches]


def rotating_options(model, options: dict) -> dict:
    """`mlx.rotating` with `max_kv_bytes`: the rows (max_size) whose keys and
    values, in every full-attention layer and KV head, fit in it (a rotating
    cache holds no positions), rounded down."""
    per_row = full_bytes(model, 1)
    limit = options["max_kv_bytes"]
    budget = parse_size(limit) // per_row
    rest = {k: v for k, v in options.items() if k != "max_kv_bytes"}
    if budget <= rest.get("sinks", 4):
        raise OptionError(
            f"rotating: max_kv_bytes={limit!r} buys {budget} rows, not more than "
            f"the sinks ({rest.get('sinks', 4)})"
        )
    return {**rest, "budget": budget}


def quantizer(kind: str, options: dict):
    """For "quantized": what mlx-lm's kv_bits does with quantized_kv_start=0,
    run after every prefill chunk (the chunk itself attends unquantized, then
    every full-attention KVCache becomes a QuantizedKVCache). None otherwise."""
    if kind != "quantized":
        return None
    make = _mlx_factory(kind, options)
    bits, group = make.keywords["bits"], make.keywords["group_size"]

    def quantize(caches: list) -> None:
        for i, c in enumerate(caches):
            if type(c) is mlc.KVCache:  # mlx-lm has no quantized rotating cache
                caches[i] = c.to_quantized(group_size=group, bits=bits)

    return quantize


def generation_kwargs(kind: str, options: dict) -> dict:
    """generate_step arguments that make mlx-lm itself do what `quantizer` does."""
    if kind != "quantized":
        return {}
    make = _mlx_factory(kind, options)
    return {
        "kv_bits": make.keywords["bits"],
        "kv_group_size": make.keywords["group_size"],
        "quantized_kv_start": 0,
    }


def check(name: str, options: dict) -> str | None:
    """Validate a peer arm (`unpatched`, `mlx.KIND`, `veloxquant.ALGO`) before any
    model is loaded: OptionError when invalid, a reason when it cannot run here
    (its optional package is missing), None when it can."""
    if name == "unpatched" or name.startswith("mlx."):
        _mlx_factory(name.removeprefix("mlx."), options)
        return None
    algo = name.removeprefix("veloxquant.")
    _peer_of(algo)
    if not veloxquant_available():
        return "needs veloxquant-mlx (pip install 'veloxpatch[compare]')"
    _veloxquant_config(algo, options, rope_theta=None)
    return None


def _peer_of(algo: str) -> Peer:
    if algo not in PEER_ALGOS:
        why = _NO_PEER.get(algo, f"available: {', '.join(PEER_ALGOS)}")
        raise OptionError(f"no veloxquant equivalent of {algo!r}: {why}")
    return PEER_ALGOS[algo]


def _veloxquant_config(algo: str, options: dict, rope_theta):
    peer = _peer_of(algo)
    vq_options, KVCacheConfig, _ = _veloxquant()
    options_cls = getattr(vq_options, peer.options_cls)
    theirs = {f.name for f in fields(options_cls)}
    allowed = {"budget", *peer.fields, *theirs} - {peer.budget}  # budget is ours
    _only(options, allowed, f"veloxquant {algo}")
    budget = options.get("budget")
    check_int("budget", budget, 1)
    for k in {"sinks", "recent"} & set(options):
        check_int(k, options[k], 0)
    values = {peer.fields.get(k, k): v for k, v in options.items() if k != "budget"}
    # The docs ask for the model's RoPE base where a cache takes one.
    rope = f"{algo}_rope_base"
    if rope in theirs and rope not in values and rope_theta is not None:
        values[rope] = float(rope_theta)
    try:
        resolved = options_cls(**values)
        # h2o and tova check this only at their first update, mid-run.
        held = sorted(peer.fields[k] for k in ("sinks", "recent") if k in peer.fields)
        held = {f: getattr(resolved, f) for f in held}
        if sum(held.values()) >= budget:
            raise OptionError(
                f"veloxquant {algo}: budget ({budget}) must exceed the protected "
                f"rows ({', '.join(f'{f}={n}' for f, n in held.items())})"
            )
        sinks = getattr(resolved, peer.fields["sinks"])
        values[peer.budget] = budget - sinks if algo == "streaming_llm" else budget
        return KVCacheConfig(method=algo, options=options_cls(**values))
    except (TypeError, ValueError) as e:  # their config errors
        if isinstance(e, OptionError):
            raise
        raise OptionError(f"veloxquant {algo}: {e}") from e


def veloxquant_caches(model, algo: str, options: dict) -> list:
    """The caches veloxquant installs for our `algo` at `options["budget"]`.
    Our options with a counterpart are mapped (see PEER_ALGOS), veloxquant's own
    field names pass through as they are, the rest keep its defaults."""
    theta = getattr(getattr(model, "args", None), "rope_theta", None)
    config = _veloxquant_config(algo, options, theta)
    _unpatched(model)
    install = _veloxquant()[2]
    # The documented route: the installer sets model.make_cache, the caches
    # come from it; then the model is put back exactly as it was.
    prior = model.__dict__.get("make_cache")
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints "Wired ..."
            install(model, config)
        return model.make_cache()
    except ValueError as e:  # their config errors, incl. QuantizerConfigError
        raise OptionError(f"veloxquant {algo}: {e}") from e
    finally:
        if prior is None:
            model.__dict__.pop("make_cache", None)
        else:
            model.make_cache = prior


def held_rows(cache) -> int:
    """Rows KV head 0 of any arm's cache holds now (nbytes can count unused
    buffer, and several peers report the token position as offset/size())."""
    if type(cache).__name__ == "SnapKVKVCache":  # its tokens_kept sums B x H
        heads = 1 if cache.keys is None else math.prod(cache.keys.shape[:2])
        return cache.tokens_kept // heads
    if hasattr(cache, "tokens_kept"):
        return int(cache.tokens_kept)
    if isinstance(cache, mlc.RotatingKVCache):  # size() caps at max_size
        return 0 if cache.keys is None else min(cache.offset, cache.keys.shape[2])
    return cache.offset
