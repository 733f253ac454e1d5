"""`kvzip` (Kim et al., 2025): score every stored pair by the attention it gets
while the model reconstructs the context, then keep the best pairs of the whole
model under one threshold.

The reconstruction pass (`veloxpatch.context.prefill`, which has the context's
tokens): after the context prefill, "Repeat the previous context exactly." and
the context itself are fed, teacher-forced, in chunks (later chunks start "...
starting with" the previous chunk's last 8 tokens), attending to the cached
context. Each repeat query's softmax is taken over the sinks, the context chunk
it repeats and the repeat tokens before it; a pair's score is the maximum
probability over the chunk's queries and its GQA group. The repeat rows are
trimmed off after each chunk.

Without that pass (a prompt ended inside mlx-lm's generate: the patch never sees
token ids), the same maximum is taken over the prompt's own queries.

At the prompt end the kept set is chosen globally over every (layer, KV head,
position) of the prompt cache: sinks always, each head's best `floor` x budget
pairs, then one threshold over the whole model (`layerwise=True`: per layer).
Heads are stored padded to the layer's largest, so every head of a layer keeps
as many rows as its largest head needs (its next best fill what would be
padding), and the threshold is the lowest whose layers hold at most budget x
layers x KV heads rows: `budget` counts rows held, like every algorithm's.
Only the first prompt is compressed: a later prompt (a question asked on the
compressed context) is kept whole, and generated tokens slide through the newest
`window` rows, so memory stays bounded while decoding.
"""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import numpy as np

from ..errors import OptionError
from .attention_probs import query_probs
from .base import PAD_POSITION
from .eviction import EvictingCache, EvictionOptions
from .options import check_int, check_number

REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the previous chunk a later chunk starts from


@dataclasses.dataclass
class KVzipOptions(EvictionOptions):
    """`budget`: mean rows per layer and KV head (sinks included). `floor`:
    fraction of the budget every head keeps at least. `window`: newest rows kept
    on top of the compressed context while decoding. `chunk`: tokens of context
    per reconstruction chunk. `layerwise`: one threshold per layer instead of
    one for the model."""

    floor: float = 0.1
    window: int = 32
    chunk: int = 2048
    layerwise: bool = False

    def __post_init__(self):
        check_number("floor", self.floor, 0, 1)
        check_int("window", self.window, 0)
        check_int("chunk", self.chunk, OVERLAP + 1)
        if self.head_budget != "uniform":
            raise ValueError(
                "kvzip allocates rows over the whole model itself; "
                "head_budget is not one of its options"
            )
        if not isinstance(self.layerwise, bool):
            raise ValueError(f"layerwise must be true or false, got {self.layerwise!r}")
        super().__post_init__()

    def bind(self, model, dims):
        shards = getattr(dims, "shards", None)
        if shards is not None and shards.num_layers is not None and not self.layerwise:
            raise OptionError(
                "kvzip's one threshold over all layers needs every layer in this "
                "process; on a pipeline-split model use layerwise=True"
            )
        return super().bind(model, dims)


class KVzipCache(EvictingCache):
    name = "kvzip"
    batchable = True  # one cache per sequence (caches/batch.py)
    summary = "attention each pair gets while the model repeats the context; global"
    note = (
        "compress a context with patch.prefill(tokens, tokenizer) or `veloxpatch "
        "compress` to score by context reconstruction; a prompt ended inside "
        "mlx_lm.generate is scored by its own queries (no token ids to repeat)."
    )
    Options = KVzipOptions

    def __init__(self, options=None, layer=0, num_layers=1):
        super().__init__(options, layer, num_layers)
        self.zscore = None  # [B, Hkv, rows] max attention probability, float32
        self.repeat = None  # (start, end) of the context chunk being repeated
        self.score_prompt = True  # score with the prompt's own queries
        self.context_rows = None  # rows kept by the compression, per head max
        self.context_end = None  # positions below it are the compressed context
        self.compressed_ends = -1  # the prompt end the compression served

    # ---- scoring ------------------------------------------------------------------
    def attention(self, q, keys, values, mask, scale):
        out = super().attention(q, keys, values, mask, scale)
        if self.repeat is not None:
            self._score_repeat(q, keys, scale)
        elif self.in_prompt and self.score_prompt and self.context_rows is None:
            _, probs = query_probs(q, keys, self.positions_view(), self.offset, scale)
            self._raise_scores(probs.max(axis=(2, 3)), 0)
        return out

    def _score_repeat(self, q, keys, scale):
        """Repeat queries over the sinks, their context chunk and the repeat
        rows before them (KVzip's softmax), max into the chunk's scores."""
        start, end = self.repeat
        L, T = q.shape[2], keys.shape[2]
        sink = min(self.options.sinks, start)
        pick = list(range(sink)) + list(range(start, end)) + list(range(T - L, T))
        idx = mx.array(pick, dtype=mx.int32)
        sub = keys[:, :, idx]
        pos = mx.concatenate(
            [mx.zeros((sink + end - start,), mx.int32), mx.arange(L, dtype=mx.int32)]
        )
        pos = mx.broadcast_to(pos, (*sub.shape[:2], pos.shape[0]))
        _, probs = query_probs(q, sub, pos, 0, scale)  # causal among repeat rows
        chunk = probs[..., sink : sink + end - start].max(axis=(2, 3))
        self._raise_scores(chunk, start)

    def _raise_scores(self, new: mx.array, start: int) -> None:
        B, H, n = new.shape
        if self.zscore is None or self.zscore.shape[-1] < start + n:
            width = max(start + n, 0 if self.zscore is None else self.zscore.shape[-1])
            grown = mx.zeros((B, H, width), mx.float32)
            if self.zscore is not None:
                grown[..., : self.zscore.shape[-1]] = self.zscore
            self.zscore = grown
        old = self.zscore[..., start : start + n]
        self.zscore[..., start : start + n] = mx.maximum(old, new.astype(mx.float32))
        mx.eval(self.zscore)

    # ---- compression --------------------------------------------------------------
    def end_prompt(self):
        if self.context_rows is not None:  # a later prompt (a question) is kept
            self.context_rows, self.context_end = self.rows, self.offset
            return
        if self.compressed_ends == self.phase.ends or self.zscore is None:
            return
        members = [c for c in self.phase_members() if c.zscore is not None]
        compress_together(members or [self])

    def phase_members(self) -> list:
        refs = getattr(self.phase, "members", None) or []
        caches = [r() for r in refs]
        return [c for c in caches if isinstance(c, KVzipCache)]

    def keep_counted(self, scores: mx.array, n_keep: int) -> None:
        """Keep each head's best `n_keep` rows (from the model-wide choice)."""
        self.evict_to(n_keep, scores)
        self.context_rows, self.context_end = self.rows, self.offset
        self.compressed_ends = self.phase.ends
        self.zscore = None

    # ---- decode: the compressed context plus a sliding window ---------------------
    def compress_now(self, new_rows):
        if self.context_rows is None or self.in_prompt:
            return False
        return self.rows > self.context_rows + self.options.window

    def after_attend(self, q, new_rows):
        if self.compress_now(new_rows):
            pos = self.positions_view()
            counts = (pos < self.context_end).sum(-1) + self.options.window
            scores = pos.astype(mx.float32)  # context and window are protected
            self.evict_to(int(counts.max().item()), scores, counts)

    def row_bound(self) -> int:
        if self.context_rows is None:
            return max(self.rows, self.options.budget)
        return self.context_rows + self.options.window

    def protected_mask(self, pos):
        if self.context_rows is None:
            return super().protected_mask(pos)
        # after compression: the kept context and the newest window rows stay
        recent = (pos >= self.offset - self.options.window) & (pos != PAD_POSITION)
        return (pos < self.context_end) | recent

    def side_arrays(self):
        return super().side_arrays() + ([] if self.zscore is None else [self.zscore])

    def extra_state(self):
        return {} if self.zscore is None else {"zscore": self.zscore}

    def load_extra_state(self, st):
        self.zscore = st.get("zscore")

    def extra_meta(self):
        return {
            "context_rows": self.context_rows,
            "context_end": self.context_end,
            "compressed_ends": self.compressed_ends,
        }

    def load_extra_meta(self, m):
        self.context_rows = m.get("context_rows")
        self.context_end = m.get("context_end")
        self.compressed_ends = int(m.get("compressed_ends", -1))


def compress_together(caches: list[KVzipCache]) -> None:
    """One threshold over every (layer, KV head, position) of `caches` (or one
    per layer with `layerwise`), sinks and each head's best `floor` x budget rows
    kept first. Heads are stored padded to their layer's largest, so a head
    below it fills the padding with its next best rows: each layer keeps the
    rows its largest head needs, in every head, and the budget counts rows held:
    the lowest threshold whose layers hold at most budget x layers x KV heads."""
    o = caches[0].options
    scores = []
    for c in caches:
        s = c.shards.all_heads(c.zscore[..., : c.rows])  # [B, H, T] every head
        pos = c.shards.all_heads(c.positions_view())
        s = mx.where(pos < o.sinks, mx.inf, s)
        floor = min(s.shape[-1], math.ceil(o.floor * o.budget))
        if floor:
            kth = mx.sort(s, axis=-1)[..., -floor][..., None]
            s = mx.where(s >= kth, mx.inf, s)  # each head's best `floor`
        scores.append(s)
    groups = [[i] for i in range(len(caches))] if o.layerwise else [range(len(caches))]
    for group in groups:
        part = [scores[i] for i in group]
        rows = layer_rows(part, o.budget * sum(s.shape[1] for s in part))
        for i, n in zip(group, rows):
            caches[i].keep_counted(caches[i].shards.my_heads(scores[i]), n)


def layer_rows(scores: list, total: int) -> list[int]:
    """Rows per layer (the same in each head) for the lowest threshold t whose
    cost, sum over layers of heads x the largest head's count of scores >= t,
    stays within `total` (batch item 0 decides: B is 1 or equal rows)."""
    per = [np.array(s[0].astype(mx.float32)) for s in scores]  # [H, T] each
    ranked = [-np.sort(-p, axis=-1) for p in per]  # best first, per head

    def rows_at(t):
        return [int((r >= t).sum(-1).max()) for r in ranked]

    def cost(t):
        return sum(n * r.shape[0] for n, r in zip(rows_at(t), ranked))

    cands = np.unique(np.concatenate([r.reshape(-1) for r in ranked]))[::-1]
    lo, hi = 0, len(cands) - 1  # the largest index still within total
    if cost(cands[0]) > total:
        hi = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(cands[mid]) <= total:
            lo = mid
        else:
            hi = mid - 1
    return [max(1, n) for n in rows_at(cands[lo])]
