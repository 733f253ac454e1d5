"""`kvzap` (Jegou et al., 2026): every pair is scored as it enters the cache by a
small surrogate of its layer, which maps the hidden state entering attention to
the predicted log KVzip+ score of the token's pair in each KV head. The
surrogates are fitted on the model's own KVzip+ scores of calibration text
(`veloxpatch calibrate --algo kvzap`, given here as `scorer=FILE`), so kvzap
needs neither the context's token ids nor kvzip's second pass: it compresses
inside every forward, prompt chunks and decode alike, at the cost of one small
matmul per layer and call.

Two modes, as kvpress:
- `threshold=T` (DMS-style): a row whose score is under T is dropped once it
  leaves the `window` newest rows (sinks always kept); how much is kept then
  follows the text (`kept_fraction()`; the CLI prints it). `budget` or
  `max_kv_bytes` may cap it on top.
- `budget=N` (default 256): the best scores kept under one threshold over every
  (layer, KV head) of the model, as kvzip chooses (`kvzip/choice.py`: sinks and
  the window always, each head's best `floor` x budget first), at the end of
  every prompt call once every layer has seen it; in between each layer is cut
  to its share every `chunk` prompt tokens, so at most its share + chunk rows
  are ever held. Such a cut is made before the other layers have seen those
  rows, so it cannot share the budget over the model: `chunk` defaults to
  mlx-lm's prefill step (2,048), so that inside mlx-lm's generate functions
  every cut is the model-wide one (measured: docs/results.md). While decoding
  each layer keeps its share plus `window` rows, cut back to its share every
  `window` tokens by SnapKV's score under the last `window` decode queries, as
  kvzip decodes: a continuation reads what they read (cutting by the predicted
  scores instead lost: continuation KL 0.153 against 0.089, docs/results.md).
  `layerwise=True`: each layer keeps `budget`.

`tail=N` (budget mode, as kvzip's): each model-wide choice during the prompt
also ranks a row by its KVzip+ weight under the prompt's newest N queries (the
maximum of that and its predicted score): what a continuation reads first, and
the question's needle when the question ends the prompt. Only the choice reads
it; a row's stored score stays its prediction. A scorer fitted to KVzip's own
scores (`calibrate --target kvzip`) is met by the plain maximum probability.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from ..errors import CacheFileError, OptionError, PatchStateError
from .attention_math import newest_queries
from .base import PAD_POSITION
from .calibration_files import (
    SCORER_TARGETS,
    find,
    home_path,
    load_scorer,
    missing,
)
from .eviction import PLACEHOLDER_BUDGET, EvictingCache
from .kvzip.choice import ModelWideOptions, compress_together, model_wide_holds
from .kvzip.plus import output_gram, plus_scores
from .options import check_int, check_number, check_path, option
from .snapkv import newest_queries_score, newest_query_probs
from .storage import padded_to

DEFAULT_BUDGET = 256


def surrogate_scores(weights: dict, x: mx.array) -> mx.array:
    """[B, Hkv, L] predicted log KVzip+ scores of the L tokens whose attention
    input is x [B, L, hidden]: x w1 + b1 (linear), or GELU(x w1 + b1) w2 + b2
    (a 2-layer MLP), in float32."""
    y = x.astype(mx.float32) @ weights["w1"] + weights["b1"]
    if "w2" in weights:
        y = nn.gelu(y) @ weights["w2"] + weights["b2"]
    return y.transpose(0, 2, 1)


@dataclasses.dataclass
class KVzapOptions(ModelWideOptions):
    """`scorer`: the calibration file (required to patch a model; omitted, the
    one `veloxpatch calibrate --algo kvzap` wrote for this model is used, else
    the one the package ships for it: the embedded SmolLM2's).
    `threshold`: drop rows scoring under it (None: keep the best `budget`).
    `budget`: mean rows per layer and KV head (default 256 without a
    threshold; with one, a cap if given). `window` (also always kept),
    `floor`, `tail`, `layerwise`: `ModelWideOptions`. `chunk`: prompt tokens
    between cuts within a call."""

    budget: int | None = option(None, check_int, 1)
    scorer: str | None = option(None, check_path)
    threshold: float | None = option(None, check_number, -1e6, 1e6)
    chunk: int = option(2048, check_int, 1)

    def recent_rows(self):
        return self.window

    def prompt_chunk(self):
        return self.chunk

    def chooses_over_layers(self):
        return self.threshold is None and not self.layerwise  # budget mode

    split_hint = "use layerwise=True or a threshold"

    @property
    def capped(self) -> bool:
        return self.budget < PLACEHOLDER_BUDGET

    def __post_init__(self):
        # scorer: required, but only once bound to a model
        if self.budget is None:
            threshold = self.threshold is not None
            self.budget = PLACEHOLDER_BUDGET if threshold else DEFAULT_BUDGET
        super().__post_init__()
        self.loaded = None  # per layer {w1, b1[, w2, b2]}, once bound to a model
        self.hidden = None  # the width of the hidden state, once bound

    def load(self, model, dims):
        """Load and check the scorer file against `model` (before patching);
        none named, find this model's in the calibration cache."""
        self.hidden = hidden_size(model)
        if self.scorer is None:  # this model's file in the calibration cache
            found = find("kvzap", dims, lambda p: load_scorer(p, dims, self.hidden))
            if found is None:
                where = home_path("kvzap", dims.fingerprint).parent
                raise OptionError(missing("kvzap", "scorer", where))
            self.scorer, self.loaded = found
            return
        self.loaded = load_scorer(self.scorer, dims, self.hidden)


def hidden_size(model) -> int | None:
    """The width of the hidden state entering attention, where the model says."""
    args = getattr(model, "args", None)
    size = getattr(args, "hidden_size", None)
    return size if isinstance(size, int) else None


class KVzapCache(EvictingCache):
    name = "kvzap"
    batchable = True  # one cache per sequence (caches/batch.py)
    summary = "surrogate of KVzip+ scores from the hidden state, inside every forward"
    note = (
        "scorer=FILE from veloxpatch calibrate --algo kvzap (fitted on this "
        "model's own KVzip+ scores); threshold=T keeps what scores over T, so "
        "compression follows the text; budget=N keeps the best N per layer and "
        "KV head on average, chosen over the whole model."
    )
    Options = KVzapOptions

    @classmethod
    def holds(cls, options, heads, head_dim, dtype_size):
        held = super().holds(options, heads, head_dim, dtype_size)
        held = model_wide_holds(held, options, heads, head_dim, dtype_size)
        if options.threshold is not None:
            return held
        # budget mode, while reading: the prompt's newest `tail` queries and inputs
        hidden = options.hidden or heads * head_dim
        tail = options.tail * (heads * head_dim + hidden) * dtype_size
        return held._replace(prompt_side=tail)

    wants_layer_input = True  # the hidden state entering attention scores
    row_arrays = ("zscore",)

    @classmethod
    def policy_for(cls, options) -> str:
        # its cuts during the prompt read no query; budget mode's decode cuts
        # read the answer's: the server keeps the state the prompt's end left
        return "prompt" if options.threshold is None else "as_is"

    def snapshot_first(self) -> bool:
        return False  # the prompt's compression is question-agnostic: keep it

    def __init__(self, options=None, layer=0, num_layers=1):
        super().__init__(options, layer, num_layers)
        self.zscore = None  # [B, Hkv, rows] each row's predicted log score
        self.scorer = None  # this layer's surrogate {w1, b1[, w2, b2]}
        if self.options.loaded is not None:
            self.scorer = self.options.loaded[layer]
        self.pending = None  # [B, Hkv, n] scores of the call's rows not yet held
        self.share = None  # rows this layer keeps (budget mode, the global choice)
        self.unjudged = 0  # newest rows no cut has looked at yet
        self.entered = 0  # pairs that entered, per head (the kept fraction)
        self.decode_queries = None  # budget mode: the last `window` decode queries
        # budget mode: the prompt's newest `tail` queries and their attention inputs
        self.tail_queries = self.tail_x = None
        self.o_proj = None  # the layer's output projection (KVzip+ weights)
        # the scores the surrogate predicts, which the tail's must match
        self.target = getattr(self.options.loaded, "target", "kvzip+")
        self.tail_scores = None  # [B, Hkv, rows] during a model-wide choice

    # ---- scoring as rows enter -------------------------------------------------
    def attend(self, q, k, v, *, rope, scale, query_scale=None):
        if self.scorer is None:
            raise PatchStateError(
                "kvzap: no scorer loaded for this cache (options made without "
                "veloxpatch.apply, or a cache saved without its scorer)"
            )
        if self.layer_input is None:
            raise PatchStateError(
                "kvzap scores from the hidden state entering attention; this call "
                "did not come through a patched attention layer"
            )
        x, o_proj = self.layer_input
        self.pending = surrogate_scores(self.scorer, x)
        self.o_proj = o_proj
        return super().attend(q, k, v, rope=rope, scale=scale, query_scale=query_scale)

    def after_attend(self, q, new_rows):
        new, self.pending = self.pending[..., :new_rows], self.pending[..., new_rows:]
        held = self.rows - new_rows
        old = (
            padded_to(self.zscore, held)[..., :held]
            if self.zscore is not None
            else None
        )
        self.zscore = new if old is None else mx.concatenate([old, new], axis=-1)
        self.entered += new_rows
        self.unjudged += new_rows
        if self.options.threshold is not None:
            if self.in_prompt or self.unjudged >= max(1, self.options.window):
                self.drop_below()
        elif self.in_prompt:
            if self.options.tail:  # the piece's queries and their attention inputs
                n, x = self.options.tail, self.layer_input[0]
                start = self.offset - new_rows - self.call_offset
                x = x[:, start : start + new_rows]
                xs = x if self.tail_x is None else mx.concatenate([self.tail_x, x], 1)
                self.tail_x = mx.contiguous(xs[:, -n:])  # not the whole call's inputs
                self.tail_queries = newest_queries(self.tail_queries, q, n)
            if self.is_last_member() and self.pending.shape[-1] == 0:
                self.choose_together()
        else:
            w = max(self.options.window, 1)
            self.decode_queries = newest_queries(self.decode_queries, q, w)
            budget = self.row_budget()
            if self.cut_after_window(budget, budget, self.decode_scores):
                self.unjudged = 0

    def decode_scores(self) -> mx.array:
        """[B, Hkv, rows] SnapKV's score under the last `window` decode queries."""
        return newest_queries_score(self, self.decode_queries)

    def trim(self, n):
        n = super().trim(n)
        if n:  # they may include trimmed tokens
            self.decode_queries = self.tail_queries = self.tail_x = None
            self.entered = max(0, self.entered - n)
        return n

    def end_prompt(self):
        # a later prompt gathers its own tail; every layer's goes now, as the
        # server's snapshot copies the layers that have not seen the end yet
        for c in self.phase_members() or [self]:
            c.tail_queries = c.tail_x = None
        if self.options.threshold is None:
            self.compress()

    # ---- threshold mode ----------------------------------------------------------
    def drop_below(self) -> None:
        """Drop every row under the threshold that is neither a sink nor among
        the `window` newest (a budget, if given, caps each head on top)."""
        self.unjudged = 0
        pos = self.positions_view()
        s = self.row_scores()
        keep = (s >= self.options.threshold) | self.protected_mask(pos)
        keep = keep & (pos != PAD_POSITION)
        counts = keep.sum(-1).astype(mx.int32)  # [B, Hkv]
        if self.options.capped:
            counts = mx.minimum(counts, self.row_budget())
        if int(counts.min().item()) == self.rows:
            return  # every head keeps every row
        self.evict_to(int(counts.max().item()), s, counts)

    # ---- budget mode ---------------------------------------------------------------
    def row_budget(self) -> int:
        return self.options.budget if self.share is None else self.share

    def row_bound(self) -> int:
        if self.options.threshold is not None and not self.options.capped:
            return max(self.rows, 1)
        return self.row_budget() + self.options.window

    def next_cut(self, start, end):
        if self.options.threshold is None:
            cut = super().next_cut(start, end)
            # a cut at the call's end is the model-wide choice's, after it
            return cut if cut is not None and cut < end else None
        cut = -(-(start + 1) // self.options.chunk) * self.options.chunk
        return cut if cut < end else None

    def scores(self, q=None) -> mx.array:
        # the base's cuts (within a call, at the prompt end) read the stored scores;
        # threshold mode's pieces were judged as they were held (after_attend)
        return self.row_scores()

    def is_last_member(self) -> bool:
        return (self.phase_members() or [self])[-1] is self

    def choose_together(self) -> None:
        """Every layer has seen the call: one choice over the whole model."""
        members = self.phase_members() or [self]
        if any(c.rows > c.row_budget() for c in members):
            compress_together([c for c in members if c.zscore is not None])

    # what kvzip's model-wide choice (`compress_together`) asks of a cache
    def raise_tail_scores(self) -> None:
        """The log KVzip+ weight (KVzip's score for a `kvzip` target) of each
        held row under the tail queries, for this choice only (`row_scores`
        ranks by the larger)."""
        q = self.tail_queries
        if q is None or self.zscore is None:
            return
        n = q.shape[2]
        probs = newest_query_probs(self, q)  # [B, Hkv, G, n, rows]
        if self.target == "kvzip":
            w = probs.max(axis=(2, 3))
        else:
            _, values = self._view()
            if hasattr(values, "rows_dense"):  # quantized rows
                _, values = values.rows_dense()
            gram = output_gram(self.o_proj, probs.shape[2] * probs.shape[1])
            w = plus_scores(probs, values, self.tail_x[:, -n:], gram)
        self.tail_scores = mx.log(mx.maximum(w, 1e-30))

    def row_scores(self) -> mx.array:
        """[B, Hkv, rows] every row's predicted score (during a model-wide
        choice, raised to its weight under the tail queries)."""
        z = padded_to(self.zscore, self.rows)[..., : self.rows]
        return z if self.tail_scores is None else mx.maximum(z, self.tail_scores)

    def keep_counted(self, scores: mx.array, n_keep: int) -> None:
        self.tail_scores = None
        self.evict_to(n_keep, scores)
        self.share = n_keep

    # ---- what the kept fraction and a saved cache need -----------------------------
    def kept_fraction(self) -> float:
        """Rows held over pairs that entered, mean over heads (1.0 before any)."""
        if not self.entered:
            return 1.0
        held = (self.positions_view() != PAD_POSITION).sum(-1).astype(mx.float32)
        return held.mean().item() / self.entered

    def held_arrays(self):
        held = (self.decode_queries, self.tail_queries, self.tail_x)
        return super().held_arrays() + [a for a in held if a is not None]

    def side_arrays(self):
        held = (self.decode_queries, self.tail_queries, self.tail_x)
        return super().side_arrays() + [a for a in held if a is not None]

    def arrays(self):
        return super().arrays() or self.extra_state()  # empty: still its scorer

    def extra_state(self):
        named = {f"scorer_{k}": v for k, v in (self.scorer or {}).items()}
        queries = {
            "decode_queries": self.decode_queries,
            "tail_queries": self.tail_queries,
            "tail_x": self.tail_x,
        }
        queries = {k: v for k, v in queries.items() if v is not None}
        return super().extra_state() | named | queries

    def load_extra_state(self, st):
        super().load_extra_state(st)
        scorer = {
            k[len("scorer_") :]: v for k, v in st.items() if k.startswith("scorer_")
        }
        self.scorer = scorer or None
        self.decode_queries = st.get("decode_queries")
        self.tail_queries, self.tail_x = st.get("tail_queries"), st.get("tail_x")

    def extra_meta(self):
        return {
            "share": self.share,
            "entered": self.entered,
            "unjudged": self.unjudged,
            "target": self.target,
        }

    def load_extra_meta(self, m):
        self.target = m.get("target", "kvzip+")  # saved before targets: KVzip+'s
        if self.target not in SCORER_TARGETS:
            raise CacheFileError(f"kvzap: unknown surrogate target {self.target!r}")
        self.share = m.get("share")
        self.entered = int(m.get("entered", 0))
        self.unjudged = int(m.get("unjudged", 0))
