"""What every evicting algorithm shares: a budget, protected sinks and recent rows,
and the choice of which rows survive.

Eviction is deferred: a call attends over everything stored plus its new tokens,
then `after_attend` evicts. Rows stay in position order, so the fused attention's
"causal" mask is exact after eviction (queries see every kept past row and the
new rows up to themselves); an explicit per-head mask is built only when heads
hold different row counts (padding).

Algorithms override:
  - `scores(q)`: importance of each stored row [B, Hkv, T], higher is kept;
  - `compress_now(new_rows)`: whether to evict after this call (default: over budget);
  - `row_budget()`: rows to keep per head (default: `budget`).

`head_budget="adaptive"` (any algorithm here, as kvpress's AdaKVPress wraps any
scorer): Ada-KV's allocation (Feng et al., 2024) of the layer's rows among its KV
heads. Over the rows that are not protected, the layer-wide top H x P scores of
all heads (P = row budget - protected rows; on a sharded model the heads of every
rank, `sharding.py`) give c_h per head; head h keeps
round(c_h (1 - alpha) + alpha P) of them (largest remainders, summing to H x P)
plus its protected rows. Heads are stored padded to the largest head, padding
masked out and counted in nbytes: a head holds at most
protected + ceil((1 - alpha) H P + alpha P) rows (`head_bound`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import mlx.core as mx

from ..errors import OptionError
from .base import PAD_POSITION, VeloxCache
from .kv_bits import QuantizedKV, quantized_variant
from .kv_budget import budget_for_bytes, kv_dtype_size, parse_size
from .kv_quant import FIELDS, KVQuant, check_bindable, take_quant, upgrade_saved
from .options import CacheOptions, check_choice, check_int, check_number, option
from .storage import padded_to

HEAD_BUDGETS = ("uniform", "adaptive")
DEFAULT_ALPHA = 0.2  # Ada-KV's floor

QUANT_PREFIX = "kv_"  # kv_bits=4 on an evicting algorithm: KVQuant(bits=4)
PLACEHOLDER_BUDGET = 2**30  # max_kv_bytes: the budget until bound to a model


@dataclasses.dataclass
class EvictionOptions(CacheOptions):
    """`budget`: rows kept per layer and KV head, sinks and protected window
    included. `sinks`: first tokens always kept. `quant`: the kept rows stored
    quantized (`kv_quant.KVQuant`), built from the shorthand keywords
    `kv_bits`, `kv_key_bits`, `kv_group`, `kv_residual` (and research's
    `kv_recipe`); None: full precision. Its dense first rows are among
    `sinks`, raised to them, so they are never evicted.
    `head_budget`: "uniform" (every KV head keeps `budget` rows) or "adaptive"
    (Ada-KV: a layer's heads share budget x heads rows by their scores, each
    keeping at least the fraction `alpha`, default 0.2, of the uniform share;
    see the module docstring).
    `max_kv_bytes` (e.g. "48MB", or bytes):
    instead of `budget`, the largest budget whose bytes held while decoding,
    over every layer and KV head, stay within it (`kv_budget.py`)."""

    budget: int = option(256, check_int, 1)
    sinks: int = option(4, check_int, 0)
    quant: KVQuant | None = None
    head_budget: str = option("uniform", check_choice, HEAD_BUDGETS)
    alpha: float | None = None
    max_kv_bytes: int | str | None = None
    # kvzip, kvzap: rows shared among heads by their own model-wide choice
    own_head_budgets: ClassVar[bool] = False

    @classmethod
    def option_names(cls):
        return (
            [n for n in super().option_names() if n != "quant"]
            + [QUANT_PREFIX + k for k in FIELDS]
            + ["quant"]
        )

    @classmethod
    def fold(cls, options):
        options["quant"] = take_quant(options, QUANT_PREFIX, required=False)
        return options

    @classmethod
    def from_saved(cls, algo, options):
        try:
            options = upgrade_saved(dict(options), QUANT_PREFIX)
        except OptionError as e:
            raise OptionError(f"{algo}: {e}") from None
        return cls.create(algo, options)

    def as_dict(self):
        d = {k: v for k, v in super().as_dict().items() if k != "quant"}
        if self.quant is None:
            return {**d, QUANT_PREFIX + "bits": None}
        return {**d, **self.quant.flat(QUANT_PREFIX)}

    @classmethod
    def create(cls, algo, options):
        if options.get("max_kv_bytes") is None:
            return super().create(algo, options)
        if options.get("budget") is not None:
            raise OptionError(
                f"{algo}: give budget or max_kv_bytes, not both (max_kv_bytes "
                "sets the budget)"
            )
        # validated against a placeholder budget; bind prices the real one
        opts = super().create(algo, {**options, "budget": PLACEHOLDER_BUDGET})
        opts.given = (algo, dict(options))
        return opts

    def prompt_chunk(self) -> int | None:
        """Prompt tokens between compressions during the prompt, for the
        algorithms that otherwise compress when it ends (`compress="chunks"`)."""
        return None

    def recent_rows(self) -> int:
        """Newest rows never evicted (subclasses: their window or `recent`)."""
        return 0

    def protected(self) -> int:
        """Rows never evicted: the sinks and the recent rows."""
        return self.sinks + self.recent_rows()

    def __post_init__(self):
        super().__post_init__()
        if self.quant is not None and not isinstance(self.quant, KVQuant):
            raise OptionError(f"quant must be a veloxpatch.KVQuant, got {self.quant!r}")
        if self.quant is not None:
            self.sinks = max(self.sinks, self.quant.sinks)  # dense: never evicted
        if self.own_head_budgets and self.head_budget != "uniform":
            raise OptionError(
                "this algorithm shares rows among heads by its own model-wide "
                "choice; head_budget is not one of its options"
            )
        if self.head_budget == "adaptive":
            if self.alpha is None:
                self.alpha = DEFAULT_ALPHA
            check_number("alpha", self.alpha, 0, 1)
        elif self.alpha is not None:
            raise OptionError(
                f"alpha (the per-head floor) needs head_budget='adaptive', "
                f"got head_budget={self.head_budget!r}"
            )
        if self.max_kv_bytes is not None:
            parse_size(self.max_kv_bytes)
        if self.budget <= self.protected():
            raise OptionError(
                f"budget ({self.budget}) must exceed the protected rows "
                f"({self.protected()}: sinks and recent window)"
            )

    def bind(self, model, dims):
        if self.max_kv_bytes is not None:
            return self._priced(model, dims)
        if self.quant is not None:
            check_bindable(dims, self.quant, QUANT_PREFIX)
        return super().bind(model, dims)

    def _priced(self, model, dims):
        """These options with the budget `max_kv_bytes` buys on this model."""
        algo, given = getattr(self, "given", ("options", self.as_dict()))
        limit = parse_size(self.max_kv_bytes)
        budget, opts = _bought(type(self), algo, given, model, dims, limit)
        if isinstance(opts, OptionError):
            raise OptionError(
                f"max_kv_bytes={self.max_kv_bytes!r} buys {budget} rows per layer "
                f"and KV head on this model, too few: {opts}"
            )
        return opts.bind(model, dims)


def _bought(cls, algo, given: dict, model, dims, limit: int):
    """(the budget `limit` bytes buy with options `given`, held once the prompt
    is read, as for every algorithm whoever chose it; those options with it or
    the OptionError they raise)."""

    try:
        priced = cls.create(algo, given)
        size = kv_dtype_size(model)
        budget = budget_for_bytes(priced, dims, size, limit, decode=True)
    except OptionError as e:
        return 0, e
    try:
        return budget, cls.create(
            algo, {**given, "budget": budget, "max_kv_bytes": None}
        )
    except OptionError as e:
        return budget, e


def head_budgets(scores: mx.array, prefix: int, alpha: float) -> mx.array:
    """Ada-KV's rows per head [B, H] from scores [B, H, T] of the rows that
    compete (the others -inf): c_h of the layer-wide top H x prefix fall in head
    h, which gets round(c_h (1 - alpha) + alpha prefix), at most T; rows sum to
    H x prefix per batch item (largest remainders, ties to the lower head)."""
    B, H, T = scores.shape
    flat = scores.reshape(B, H * T)
    total = min(H * prefix, H * T)
    top = mx.argpartition(-flat, kth=total - 1, axis=-1)[:, :total] // T
    counts = (top[:, :, None] == mx.arange(H)[None, None, :]).sum(axis=1)
    exact = counts.astype(mx.float32) * (1 - alpha) + alpha * prefix
    exact = mx.minimum(exact, T)
    base = mx.floor(exact).astype(mx.int32)
    short = total - base.sum(axis=-1, keepdims=True)
    remainder = exact - base
    rank = mx.argsort(mx.argsort(-remainder, axis=-1), axis=-1)
    return base + (rank < short).astype(mx.int32)


@dataclasses.dataclass
class PromptCompressionOptions(EvictionOptions):
    """Options of the algorithms that score the prompt as it ends (SnapKV
    family, expected_attention). `compress`: "prompt_end" (the whole prompt held
    at full precision until it ends) or "chunks" (cut back to the budget every
    `chunk` prompt tokens, at multiples of `chunk` whatever the caller's prefill
    chunks, with what has been seen so far; the prompt's end compresses once
    more): at most budget + chunk rows are ever held."""

    compress: str = option("prompt_end", check_choice, ("prompt_end", "chunks"))
    chunk: int = option(512, check_int, 1)

    def prompt_chunk(self):
        return self.chunk if self.compress == "chunks" else None

    def holds_prompt(self) -> bool:
        return self.compress == "prompt_end"


@dataclasses.dataclass
class RecentOptions(EvictionOptions):
    """Options of the algorithms that protect the `recent` newest rows besides
    the sinks (h2o, keyformer, knorm): by default half of what the sinks leave,
    (budget - sinks) // 2 (scripts/results/knorm_recent.json: with recent 0
    perplexity is 17-33x full, at about half the budget 1.09-1.41x)."""

    recent: int | None = option(None, check_int, 0)

    def recent_rows(self):
        return self.recent

    def __post_init__(self):
        if self.recent is None:
            check_int("budget", self.budget, 1)
            check_int("sinks", self.sinks, 0)
            self.recent = max(0, (self.budget - self.sinks) // 2)
        super().__post_init__()


class EvictingCache(VeloxCache):
    Options = EvictionOptions

    @classmethod
    def holds(cls, options, heads, head_dim, dtype_size):
        # cutting as it reads (`compress="chunks"`): one chunk past the budget
        held = super().holds(options, heads, head_dim, dtype_size)
        return held._replace(reading_rows=options.prompt_chunk())

    @classmethod
    def for_options(cls, options):

        if options.quant is None or issubclass(cls, QuantizedKV):
            return cls  # (the variant itself, e.g. rebuilt from mlx-lm's file)
        return quantized_variant(cls)

    # ---- hooks ------------------------------------------------------------------
    def scores(self, q) -> mx.array:
        raise NotImplementedError

    def row_budget(self) -> int:
        return self.options.budget

    def row_bound(self) -> int:
        """Most rows held between calls once the prompt is over."""
        return self.head_bound(self.row_budget())

    @property
    def adaptive_heads(self) -> bool:
        return self.options.head_budget == "adaptive"

    def head_bound(self, n_keep: int) -> int:
        """Rows the largest head holds after `evict_to(n_keep, ...)`: n_keep, or
        with adaptive head budgets protected + ceil((1 - alpha) H P + alpha P)."""
        if not self.adaptive_heads or self.keys is None:
            return n_keep
        o = self.options
        heads = self.keys.shape[1] * self.shards.size  # of the whole layer
        prefix = n_keep - o.protected()
        share = (1 - o.alpha) * heads * prefix + o.alpha * prefix
        return o.protected() + min(heads * prefix, math.ceil(share - 1e-9))

    def compress_now(self, new_rows: int) -> bool:
        return self.rows > self.row_budget()

    def next_cut(self, start: int, end: int) -> int | None:
        # multiples of the chunk, skipping those where nothing is over budget:
        # a budget above the context then attends exactly as "prompt_end"
        chunk = self.options.prompt_chunk()
        if chunk is None:
            return None
        # rows + (g - start) > budget from position g = first on
        first = start + max(1, self.row_budget() - self.rows + 1)
        cut = -(-first // chunk) * chunk  # the first multiple of chunk from there
        return cut if cut <= end else None

    def chunk_done(self) -> None:
        # within the prompt, with the queries seen so far (snapkv: the chunk's
        # last `window`); the prompt's end compresses once more
        if self.rows > self.row_budget():
            self.compress()

    def compress(self) -> None:
        self.evict_to(self.row_budget(), self.scores(None))

    def after_attend(self, q, new_rows: int) -> None:
        if self.compress_now(new_rows):
            self.evict_to(self.row_budget(), self.scores(q))

    def cut_after_window(self, limit: int, n_keep: int, scores) -> bool:
        """Decode-time recompression of the algorithms that hold a compressed
        prompt plus `window` generated rows (snapkv, expected_attention,
        kvzip): once the rows exceed `limit` + window, keep `n_keep` by
        `scores()` (computed only then). Returns whether it cut."""
        if self.in_prompt or self.rows <= limit + self.options.window:
            return False
        self.evict_to(n_keep, scores())
        return True

    # ---- machinery ----------------------------------------------------------------
    def protected_mask(self, pos: mx.array) -> mx.array:
        """Rows never evicted: the sinks and the `recent` newest rows."""
        keep = pos < self.options.sinks
        recent = self.options.recent_rows()
        if recent:
            keep = keep | ((pos >= self.offset - recent) & (pos != PAD_POSITION))
        return keep

    def evict_to(self, n_keep: int, scores: mx.array, counts=None) -> None:
        """Keep, per (batch, KV head), the protected rows and the best-scored rest.

        With `counts` [B, Hkv] head h keeps only counts[b, h] <= n_keep rows and
        the rest of its n_keep slots are padding, masked out by position. With
        adaptive head budgets (and no `counts`) n_keep is the mean over the
        layer's heads and `head_counts` shares them out."""
        if self.rows <= n_keep and counts is None:
            return
        self.irreversible_at = self.offset
        if counts is None and self.adaptive_heads:
            counts, n_keep = self.head_counts(n_keep, scores)
        pos = self.positions_view()
        valid = pos != PAD_POSITION
        s = mx.where(valid, scores.astype(mx.float32), -mx.inf)
        s = mx.where(self.protected_mask(pos), mx.inf, s)
        n_keep = min(n_keep, self.rows)
        if counts is None:
            idx = mx.argpartition(-s, kth=n_keep - 1, axis=-1)[..., :n_keep]
            self.keep_rows(mx.sort(idx, axis=-1), pos)
            return
        ranked = mx.argsort(-s, axis=-1)[..., :n_keep]  # best first
        chosen = mx.take_along_axis(pos, ranked, axis=-1)
        pad = mx.arange(n_keep)[None, None, :] >= counts[..., None]
        chosen = mx.where(pad, PAD_POSITION, chosen)
        order = mx.argsort(chosen, axis=-1)  # position order, padding last
        self.keep_rows(mx.take_along_axis(ranked, order, axis=-1), pos)
        self.positions = mx.take_along_axis(chosen, order, axis=-1)
        self.padded = bool((counts < n_keep).any().item())

    def head_counts(self, n_keep: int, scores: mx.array) -> tuple[mx.array, int]:
        """Ada-KV: rows per head [B, Hkv] of this rank, n_keep on average over
        the layer's KV heads, and the layer's largest (every rank pads to it)."""
        o = self.options
        pos = self.positions_view()
        # Heads compete only for what is not protected: sinks and recent rows are
        # kept anyway.
        free = (pos != PAD_POSITION) & ~self.protected_mask(pos)
        competing = mx.where(free, scores.astype(mx.float32), -mx.inf)
        # every KV head of the layer competes, those of other ranks included
        competing = self.shards.all_heads(competing)
        counts = head_budgets(competing, n_keep - o.protected(), o.alpha)
        counts = counts + o.protected()
        return self.shards.my_heads(counts), int(counts.max().item())

    def keep_rows(self, idx: mx.array, pos: mx.array | None = None) -> None:
        """Keep rows `idx` [B, Hkv, K] (ascending) of every head, in that order."""
        if pos is None:
            pos = self.positions_view()
        for name in self.row_arrays:  # side state follows its rows
            a = getattr(self, name)
            if a is not None:
                a = padded_to(a, self.rows)
                setattr(self, name, mx.take_along_axis(a, idx, axis=-1))
        self.positions = mx.take_along_axis(pos, idx, axis=2)
        self.take_stored(idx)
        self.rows = idx.shape[-1]

    def take_stored(self, idx: mx.array) -> None:
        """Storage: keep rows `idx` of the keys and values (quantized storage
        overrides this, not `keep_rows`, which algorithms extend)."""
        keys, values = self._view()
        self.keys = mx.take_along_axis(keys, idx[..., None], axis=2)
        self.values = mx.take_along_axis(values, idx[..., None], axis=2)

    def _capacity(self, needed: int) -> int:
        # Spare capacity is memory held: never allocate past what will be kept,
        # and once rows are evicted grow exactly.
        if self.positions is not None:
            return needed
        return min(super()._capacity(needed), max(needed, self.row_budget()))
