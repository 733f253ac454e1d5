"""Public API: apply / patched / unpatch / algos, and the Patch handle.

`apply` validates everything first (architecture, algorithm, options, not already
patched), then mutates; a failure midway rolls back, so a model is never left
half-patched. Restoring puts back the very same objects.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from model_adapters import adapter_for

from . import auto, mlx_flags, mlx_lm_internals, patcher
from .caches import VeloxCache
from .caches.io import register_with_mlx_lm
from .caches.options import files_of
from .caches.phase import PromptPhase
from .context import prefill
from .errors import OptionError, PatchStateError, UnsupportedModelError
from .loading.models import tokenizer_of
from .pricing import held_rows, parse_size, split_share, target_bytes
from .registry import algorithm, algos, make_options  # noqa: F401 (api's names)

_MISSING = object()
_PATCHES: dict[int, weakref.ref] = {}  # id(model) -> Patch


def patch_of(model) -> Patch | None:
    ref = _PATCHES.get(id(model))
    patch = ref() if ref is not None else None
    return patch if patch is not None and patch.model is model else None


class Patch:
    """A patched model. `restore()` undoes everything; a second call does nothing."""

    def __init__(
        self, model, adapter, sites, cache_cls, options, requested=None, tokenizer=None
    ):
        self.model = model
        self.tokenizer = tokenizer  # kvzip's reconstruction phrases its instruction
        self.keep_snapshots = False  # the server's prompt cache (serve/prompt_cache.py)
        self.requested = dict(requested or {})  # the options as the caller gave them
        self.adapter = adapter
        self.sites = sites  # every layer; sliding ones are not registered
        self.algo = cache_cls.name
        self.cache_cls = cache_cls
        self.options = options
        self._make = cache_cls.for_options(options)
        self._by_budget: dict = {}  # max_kv_size -> (class, options)
        self.auto = None  # auto.Choice, where algo="auto" chose this algorithm
        self.share = None  # pricing.Target: a named algorithm's max_kv_bytes="20%"
        self._by_tokens: dict = {}  # a share: prompt tokens -> (options, auto line)
        self.active = False
        self._prior_make_cache = _MISSING
        self._last_caches: list = []

    # -- caches ------------------------------------------------------------------
    def make_cache(
        self, probe=None, max_kv_size=None, *, options=None, n_tokens=None
    ) -> list:
        """One cache per layer: the algorithm's cache on patched layers, mlx-lm's
        own type (e.g. RotatingKVCache) on sliding-window layers. The layers of
        one prompt cache share one prompt phase. `probe`: fn(caches.base.Seen),
        called with what every patched attention call sees. `max_kv_size` (also
        read from mlx-lm's make_prompt_cache): the budget of these caches.
        `options`: bound options of this algorithm to make them with instead
        (`options_for_bytes`). `n_tokens`: the prompt's length, which sets the
        rows of a share target (`algo="auto", max_kv_bytes="20%"`); mlx-lm's
        generate functions give it without asking."""
        asked, kv_bits = mlx_flags.requested()
        if options is None and self.rows_by_prompt():
            n = n_tokens if n_tokens is not None else mlx_flags.prompt_length()
            options = self.options_for_tokens(n)
        mlx_flags.check_kv_bits(kv_bits)
        self._check_still_split_as_applied()
        make, options = (
            (self._make, self.options)
            if options is None
            else (self.cache_cls.for_options(options), options)
        )
        if max_kv_size is not None or asked is not None:
            make, options = self._for_budget(max_kv_size or asked)
        base = self._original_caches()
        phase = PromptPhase()
        caches = []
        for s in self.sites:
            if s.sliding:
                caches.append(base[s.index])
                continue
            # layers are numbered in the whole model (pipeline stages hold a run)
            shards = s.shards
            n = shards.num_layers or len(self.sites)
            cache = make(options, shards.layer_offset + s.index, n)
            cache.phase, cache.probe, cache.shards = phase, probe, shards
            phase.members.append(weakref.ref(cache))
            caches.append(cache)
        phase.size = len(caches)
        phase.keep_snapshot = (
            self.keep_snapshots and self.cache_cls.policy_for(options) == "prompt"
        )
        self._last_caches = [weakref.ref(c) for c in caches]
        return caches

    def rows_by_prompt(self) -> bool:
        """Whether each prompt's length sets its caches' rows (a share target,
        `options_for_tokens`); a choice made for one prompt (the CLI's) has
        that prompt's rows."""
        if self.share is not None:
            return True
        auto = self.auto
        return (
            auto is not None and auto.target.ratio is not None and auto.measured_length
        )

    def options_for_tokens(self, n_tokens):
        """This patch's options with the rows its share target buys for a
        prompt of `n_tokens` (max_kv_bytes="20%": auto's rows, or a named
        algorithm's max_kv_bytes in bytes, priced as it prices any size)."""
        target = self.share if self.share is not None else self.auto.target
        if n_tokens is None:
            raise OptionError(
                f"max_kv_bytes={target} sets the rows by each prompt's "
                "length, and these caches were made with no prompt; use "
                "patch.prefill(tokens), patch.make_cache(n_tokens=...), mlx-lm's "
                "generate functions, or a size like '24MB'"
            )
        if n_tokens not in self._by_tokens:
            read, given = None, self.given()
            if self.share is not None:
                size, _ = target_bytes(self.model, self.algo, target, n_tokens, given)
                bound = self.options_for_bytes(size)
            else:
                opts, fewest = held_rows(self.model, self.algo, target, n_tokens, given)
                bound = make_options(self.cache_cls, opts, self.model)[1]
                read = self.auto.for_prompt(n_tokens, opts, fewest)
            self._by_tokens[n_tokens] = (bound, read)
            while len(self._by_tokens) > 16:  # a few prompt lengths kept
                self._by_tokens.pop(next(iter(self._by_tokens)))
        bound, read = self._by_tokens[n_tokens]
        if read is not None:  # auto's line says the rows of the prompt last read
            self.auto = read
        return bound

    def _for_budget(self, max_kv_size: int):
        if max_kv_size not in self._by_budget:
            opts = mlx_flags.budget_options(self.cache_cls, self.requested, max_kv_size)
            opts = files_of(self.options) | opts  # the files already found
            cls, bound = make_options(self.cache_cls, opts, self.model)
            self._by_budget[max_kv_size] = (cls.for_options(bound), bound)
        return self._by_budget[max_kv_size]

    def options_for_bytes(self, max_kv_bytes):
        """This patch's options with the budget `max_kv_bytes` buys in place of
        the one applied (`pricing.py`, as everywhere), bound to the model, for
        `make_cache(options=...)`; OptionError where the algorithm has no
        budget or the size buys too few rows."""
        limit = parse_size(max_kv_bytes)
        if "max_kv_bytes" not in self.cache_cls.Options.option_names():
            raise OptionError(
                f"{self.algo!r} has no budget (it keeps every token), so no "
                "max_kv_bytes"
            )
        opts = self.given() | {"max_kv_bytes": limit}
        return make_options(self.cache_cls, opts, self.model)[1]

    def given(self) -> dict:
        """The options as applied but the rows (budget, max_kv_bytes), with the
        calibration files already found: what a new size or share is priced
        with."""
        drop = ("budget", "max_kv_bytes")
        rest = {k: v for k, v in self.requested.items() if k not in drop}
        return files_of(self.options) | rest

    def _check_still_split_as_applied(self) -> None:
        """`model.shard()` or a pipeline split after `apply` would leave the caches
        reducing over a part of the heads, or numbering layers locally."""
        was = self.sites[0].shards.layout
        now = self.adapter.shards(self.model).layout
        if was != now or len(self.model.layers) != len(self.sites):
            raise PatchStateError(
                "the model was sharded after veloxpatch.apply; restore the patch, "
                "shard the model (model.shard / pipeline), then apply again"
            )

    def _original_caches(self) -> list:
        prior = self._prior_make_cache
        if prior is not _MISSING:
            return prior()
        cls_make = getattr(type(self.model), "make_cache", None)
        if cls_make is not None:
            return cls_make(self.model)
        return [KVCache() for _ in self.sites]

    def prefill(self, tokens, *, tokenizer=None, chunk: int = 2048, context_start=0):
        """The compressed prompt cache of a context, with no question: see
        `veloxpatch.context.prefill`."""
        return prefill(
            self, tokens, tokenizer=tokenizer, chunk=chunk, context_start=context_start
        )

    def _model_forward(self, wrapped, model, args, kwargs):
        if mlx_lm_internals.in_speculative_step(sys._getframe(1), 6):
            return self._speculative_call(wrapped, model, args, kwargs)
        return self.cache_cls.model_call(self, wrapped, model, args, kwargs)

    def _speculative_call(self, wrapped, model, args, kwargs):
        """A model call of mlx-lm's speculative decoding: generated tokens. The
        target's first verify call leads with the prompt's last token, which
        goes first and alone, as generate_step sends it: the prompt then ends
        (compresses) before the drafts attend, as in plain decoding."""
        ids, rest = args[0], args[1:]

        def forward(ids):
            return self.cache_cls.model_call(self, wrapped, model, (ids, *rest), kwargs)

        cache = kwargs.get("cache", rest[0] if rest else None)
        ours = [c for c in cache or () if isinstance(c, VeloxCache)]
        if not ours or ids.ndim != 2 or ids.shape[1] == 1:
            return forward(ids)
        phase = ours[0].phase
        first = None
        if phase.in_prompt:
            first, ids = forward(ids[:, :1]), ids[:, 1:]
        with phase.decoding():
            out = forward(ids)
        return out if first is None else mx.concatenate([first, out], axis=1)

    def end_prompt(self, caches=None) -> None:
        """Tell the caches the prompt is over (for callers that drive
        `model(x, cache=...)` themselves). Defaults to the last `make_cache()`."""
        if caches is None:
            caches = [r() for r in self._last_caches]
        for c in caches:
            if isinstance(c, VeloxCache):
                c.close_prompt()

    # -- lifecycle ----------------------------------------------------------------
    def _install(self) -> None:
        model = self.model
        active = [s for s in self.sites if not s.sliding]
        self._prior_make_cache = model.__dict__.get("make_cache", _MISSING)
        _PATCHES[id(model)] = weakref.ref(self)
        try:
            patcher.register(active, owner=self)  # all or nothing
        except BaseException:
            del _PATCHES[id(model)]
            raise
        try:
            # every call of the whole model: kvzip's ids, speculative decoding
            patcher.register_model(model, self._model_forward)
            model.make_cache = self.make_cache
        except BaseException:
            self._uninstall()
            raise
        self.active = True

    def _uninstall(self) -> None:
        model = self.model
        patcher.unregister([s for s in self.sites if not s.sliding])
        patcher.unregister_model(model)
        if self._prior_make_cache is _MISSING:
            model.__dict__.pop("make_cache", None)
        else:
            model.make_cache = self._prior_make_cache
        ref = _PATCHES.get(id(model))
        if ref is not None and ref() is self:
            del _PATCHES[id(model)]

    def restore(self) -> None:
        if not self.active:
            return
        self._uninstall()
        self.active = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()
        return False

    def __repr__(self):
        state = "active" if self.active else "restored"
        chose = f" (auto, {self.auto.target})" if self.auto is not None else ""
        return f"<veloxpatch.Patch {self.algo}{chose} {self.options} ({state})>"


def apply(
    model, algo: str = "full", *, tokenizer=None, auto_path="apply", **options
) -> Patch:
    """Patch `model`'s attention and install `algo`'s caches as `model.make_cache`.
    `tokenizer` (default: the one `veloxpatch.load` returned with the model):
    lets kvzip run its reconstruction pass inside mlx-lm's generate functions.
    `algo="auto"` with `max_kv_bytes="20%"` or `"24MB"` (and optionally
    `max_peak_bytes`): the best measured configuration (`veloxpatch.auto`),
    logged in one line and kept as `patch.auto`; `auto_path`: the protocols
    whose worst case counts (`auto.PATHS`; "apply": all three)."""
    choice = None
    if algo != "auto" and auto_path != "apply":
        raise OptionError(f"auto_path is algo='auto''s; {algo!r} takes none")
    if algo == "auto":
        choice = auto.resolve(model, options, auto_path)
        algo, options = choice.algo, choice.options
    options, share = split_share(algo, options)  # rows set by each prompt
    mlx_lm_internals.check()  # once per process: what we rely on is unchanged
    adapter = adapter_for(model)
    cache_cls, opts = make_options(algo, options, model)
    if patch_of(model) is not None:
        raise PatchStateError(
            "model is already patched; call restore() (or veloxpatch.unpatch) first"
        )
    sites = adapter.sites(model)
    if any(patcher.is_registered(s.attention) for s in sites):
        raise PatchStateError(
            "this model's attention is already patched, by the patch of a model "
            "that holds it (or that it holds); restore that patch first"
        )
    for target in {s.target for s in sites}:
        patcher.check_target(target)
    if all(s.sliding for s in sites):
        raise UnsupportedModelError("every layer uses sliding-window attention")
    if tokenizer is None:
        tokenizer = tokenizer_of(model)
    patch = Patch(model, adapter, sites, cache_cls, opts, options, tokenizer)
    patch.auto, patch.share = choice, share
    patch._install()
    if choice is not None:
        logging.getLogger("veloxpatch.auto").info("%s", choice.line())
    register_with_mlx_lm()  # so mlx-lm's load_prompt_cache finds our classes
    return patch


@contextlib.contextmanager
def patched(model, algo: str = "full", **options):
    """`with patched(model, algo=...) as patch:` restores on exit, even on error."""
    patch = apply(model, algo, **options)
    try:
        yield patch
    finally:
        patch.restore()


def unpatch(model) -> bool:
    """Restore `model` if it is patched. Returns whether anything was undone."""
    patch = patch_of(model)
    if patch is None:
        return False
    patch.restore()
    return True
