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
trimmed off after each chunk. On the CPU that softmax runs in numpy (mlx's CPU
exp is scalar), once per pair for the output and the score alike.
With `kv_bits` the prompt is held as read (as the unpatched model holds it) until
the kept rows are chosen, then they are quantized: the pass reads dense rows.

The pass runs in every path that has the token ids: `patch.prefill` and
`veloxpatch compress`, and, when the patch knows the tokenizer (`apply(...,
tokenizer=)`, or a model from `veloxpatch.load`), every prompt that mlx-lm's
generate functions or the server send one sequence at a time (the patch records
the prompt's ids and reconstructs before the call that ends it,
`context.model_forward`). Where no ids reach it (batched generation, no
tokenizer, a cache loaded from a file), the same maximum is taken over the
prompt's own queries.

A later prompt on a compressed cache (a question, a second turn) is kept whole
while the rows held stay within budget + window; past that its new positions
are reconstructed too and the whole cache is chosen again under the budget
(every kept row keeps its score, `zscore`, for that).

At the prompt end the kept set is chosen globally over every (layer, KV head,
position) of the prompt cache: sinks and the context's `recent` newest rows
always, each head's best `floor` x budget pairs, then one threshold over the
whole model (`layerwise=True`: per layer). A pair's score is also raised to its
probability under the context's last `tail` queries: a continuation reads what
they read, which the reconstruction's scores leave to few heads. The defaults
(floor 0.5, tail 32, recent 0) were measured (docs/results.md).
Heads are stored padded to the layer's largest, so every head of a layer keeps
as many rows as its largest head needs (its next best fill what would be
padding), and the threshold is the lowest whose layers hold at most budget x
layers x KV heads rows: `budget` counts rows held, like every algorithm's.
Only the first prompt is compressed: a later prompt (a question asked on the
compressed context) is kept whole. While decoding, once `window` tokens have
been generated, every row but the sinks and those newest tokens competes by
SnapKV's score under the last `window` queries, and each layer is cut back to
`budget` rows (the global choice gave layers unequal shares, which a long
generation needs evenly), then again every `window` tokens, as SnapKV decodes
(keeping the compressed context untouched instead lost: continuation KL 0.191
against 0.070, docs/results.md).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np

from ..attention_math import newest_queries, query_probs, query_tiles
from ..base import PAD_POSITION
from ..eviction import EvictingCache
from ..options import check_bool, check_int, option
from ..snapkv import (
    DEFAULT_KERNEL,
    newest_queries_score,
    newest_query_probs,
    window_score,
)
from ..storage import padded_to
from .choice import ModelWideOptions, compress_together, model_wide_holds
from .plus import output_gram, plus_scores
from .reconstruct import OVERLAP, model_forward, reconstruct


@dataclasses.dataclass
class KVzipOptions(ModelWideOptions):
    """`budget`: mean rows per layer and KV head (sinks included). `floor`,
    `window`, `tail`, `layerwise`: `ModelWideOptions`. `repeat_chunk`: tokens of
    context per reconstruction chunk. `plus`: KVzip+ (Jegou et al. 2026,
    KVzap), each probability times ||W_o v|| of its query head over ||x|| of
    the repeat query's attention input: what the pair adds to the residual
    stream. `recent`: the context's newest rows every head keeps, like the
    sinks. (`repeat_chunk`, not `chunk`: elsewhere `chunk` is the prompt tokens
    between cuts.)"""

    recent: int = option(0, check_int, 0)
    repeat_chunk: int = option(2048, check_int, OVERLAP + 1)
    plus: bool = option(False, check_bool)

    def recent_rows(self):
        return self.recent

    def holds_prompt(self) -> bool:
        # the reconstruction scores every row of the prompt: held as read (as
        # the unpatched model holds it) and quantized once the kept rows are
        # chosen, so the pass reads dense rows at a prefill's cost and peak
        return True


class KVzipCache(EvictingCache):
    name = "kvzip"
    prompt_cache_policy = "prompt"
    batchable = True  # one cache per sequence (caches/batch.py)
    summary = "attention each pair gets while the model repeats the context; global"
    note = (
        "reconstructs each prompt (1.4x an unpatched prefill in all at 2,000 "
        "tokens, scripts/results/bench_compress.md) wherever the ids reach "
        "it: patch.prefill, veloxpatch compress, and mlx_lm.generate, "
        "batch_generate or the server when the patch knows the tokenizer."
    )
    Options = KVzipOptions

    @classmethod
    def holds(cls, options, heads, head_dim, dtype_size):
        held = super().holds(options, heads, head_dim, dtype_size)
        return model_wide_holds(held, options, heads, head_dim, dtype_size)

    wants_token_ids = True  # the patch records prompt ids (reconstruct.py)
    row_arrays = ("zscore",)  # each kept row keeps its score (a later prompt)

    def __init__(self, options=None, layer=0, num_layers=1):
        super().__init__(options, layer, num_layers)
        self.zscore = None  # [B, Hkv, <= rows] each row's score, float32
        self.repeat = None  # (start, end) of the context chunk being repeated
        self.score_prompt = True  # score with the prompt's own queries
        self.context_rows = None  # rows kept by the compression, per head max
        self.context_end = None  # positions below it are the compressed context
        self.compressed_ends = -1  # the prompt end the compression served
        self.decode_queries = None  # last `window` decode queries [B, Hq, n, D]
        self.decode_rows = None  # rows kept at each decode recompression
        self.tail_queries = None  # the context's last `tail` queries [B, Hq, n, D]
        self._loaded_ids = None  # a loaded file's token ids, until its meta

    @property
    def wants_layer_input(self) -> bool:
        return self.options.plus and self.repeat is not None

    # ---- the reconstruction pass (reconstruct.py) -----------------------------------
    @classmethod
    def finish_context(cls, model, caches, context, tokenizer, reuse=None):
        """Reconstruct `context`; returns each layer's scores (`reuse`: set
        them instead, the reconstruction of the same context)."""
        zipped = [c for c in caches if isinstance(c, cls)]
        if not zipped:
            return None
        if reuse is None:
            with zipped[0].phase.suspend():
                reconstruct(model, caches, zipped, context, tokenizer)
            return [mx.array(c.zscore) for c in zipped]
        for c, z in zip(zipped, reuse):
            c.score_prompt, c.zscore = False, mx.array(z)
        return reuse

    @classmethod
    def model_call(cls, patch, wrapped, model, args, kwargs):
        return model_forward(cls, patch, wrapped, model, args, kwargs)

    # ---- scoring ------------------------------------------------------------------
    def attention(self, q, keys, values, mask, scale):
        if self.repeat is not None and not hasattr(keys, "attend"):
            return self._attend_repeat(q, keys, values, scale)
        out = super().attention(q, keys, values, mask, scale)
        if self.repeat is not None:  # quantized rows: the kernel, then scores
            self._score_repeat(q, keys, values, scale)
        elif self.in_prompt:
            n = max(self.options.tail, self.options.window)
            self.tail_queries = newest_queries(self.tail_queries, q, n)
        return out

    def raise_tail_scores(self) -> None:
        """Raise the scores by the attention of the context's last `tail`
        queries (max over them and the group): what a continuation reads.
        With no reconstruction (no token ids), the prompt's last
        max(tail, window) queries alone score, SnapKV's window score."""
        q, self.tail_queries = self.tail_queries, None
        if q is None:
            return
        probs = newest_query_probs(self, q)
        if self.score_prompt:
            self.zscore = window_score(probs, DEFAULT_KERNEL)
            return
        if self.zscore is None or not self.options.tail:
            return
        n = self.options.tail
        self._raise_scores(probs[..., -n:, :].max(axis=(2, 3)), 0)

    def _subset(self, T: int, L: int) -> list[tuple[int, int]]:
        """Row ranges of KVzip's softmax for a repeat of L rows after T - L:
        the sinks, the context chunk being repeated, the repeat rows."""
        start, end = self.repeat
        sink = min(self.options.sinks, start)
        return [(0, sink), (start, end), (T - L, T)]

    def _attend_repeat(self, q, keys, values, scale):
        # KVzip+ weighs each probability, and a GPU's exp is not the CPU's
        # bottleneck: the general path (mlx)
        if self.options.plus or mx.default_device() != mx.cpu:
            return self._attend_repeat_weighed(q, keys, values, scale)
        return self._attend_repeat_fast(q, keys, values, scale)

    def _attend_repeat_fast(self, q, keys, values, scale):
        """`_attend_repeat_weighed` without KVzip+'s weights, in numpy (mlx's
        CPU exp is scalar): exponentials once, unnormalised, the output
        normalised after its matmul, the causal mask only on the columns some
        query of a tile cannot see, and a pair's score e / (its subset's sum of
        e), which is its probability under KVzip's softmax."""
        B, Hq, L, D = q.shape
        Hkv, T = keys.shape[1], keys.shape[2]
        G = Hq // Hkv
        (_, sink), (start, end), (rep, _) = self._subset(T, L)
        whole = sink == start and end == rep
        qg = np.array((q * scale).astype(mx.float32).reshape(B, Hkv, G, L, D))
        kt = np.array(keys.astype(mx.float32)).swapaxes(-1, -2)
        v = np.array(values.astype(mx.float32))
        pos = np.array(self.positions_view())  # [B, Hkv, T]
        out = np.empty((B, Hkv, G, L, D), np.float32)
        best = np.zeros((B, Hkv, end - start), np.float32)
        for a, b in query_tiles(0, L, B * Hq * T):
            first = self.offset + a  # position of the tile's first query
            hidden = np.flatnonzero((pos > first).any(axis=(0, 1)))
            e = qg[:, :, :, a:b] @ kt[:, :, None]  # [B, Hkv, G, l, T]
            if hidden.size:  # rows after some query of the tile, or padding
                c0 = hidden[0]
                qpos = np.arange(first, self.offset + b)[:, None]
                vis = pos[:, :, None, None, c0:] <= qpos
                np.copyto(e[..., c0:], -np.inf, where=~vis)
            e -= e.max(axis=-1, keepdims=True)
            np.exp(e, out=e)
            total = e.sum(axis=-1, keepdims=True)
            out[:, :, :, a:b] = (e @ v[:, :, None]) / total
            share = (
                total
                if whole
                else (
                    e[..., :sink].sum(-1, keepdims=True)
                    + e[..., start:end].sum(-1, keepdims=True)
                    + e[..., rep:].sum(-1, keepdims=True)
                )
            )
            chunk = e[..., start:end]
            chunk *= 1 / share
            np.maximum(best, chunk.max(axis=(2, 3)), out=best)
        self._raise_scores(mx.array(best), start)
        self.layer_input = None
        return mx.array(out.reshape(B, Hq, L, D)).astype(q.dtype)

    def _attend_repeat_weighed(self, q, keys, values, scale):
        """One softmax gives both the repeat's attention output and its scores:
        a pair's probability under KVzip's softmax (over `_subset`) is its
        probability over every row divided by the subset's share. In tiles of
        queries, each evaluated before the next: the whole context's
        probabilities for a whole repeat chunk are never held at once."""
        B, Hq, L, D = q.shape
        Hkv, T = keys.shape[1], keys.shape[2]
        (_, sink), (start, end), _ = ranges = self._subset(T, L)
        pos, dense = self.positions_view(), values.astype(mx.float32)
        outs = []
        for a, b in query_tiles(0, L, B * Hq * T):
            _, probs = query_probs(q[:, :, a:b], keys, pos, self.offset + a, scale)
            outs.append((probs.reshape(B, Hkv, -1, T) @ dense).reshape(B, Hq, b - a, D))
            chunk = probs[..., start:end]
            if sink != start or end != T - L:  # the subset is not every row
                share = sum(probs[..., i:j].sum(-1, keepdims=True) for i, j in ranges)
                chunk = chunk / share
            weights = self._weigh(chunk, values[:, :, start:end], slice(a, b))
            self._raise_scores(weights, start)  # evaluated: the tile is done
            mx.eval(outs[-1])
        self.layer_input = None
        return mx.concatenate(outs, axis=2).astype(q.dtype)

    def _score_repeat(self, q, keys, values, scale):
        """KVzip's softmax over `_subset` alone (rows the kernel read in place)."""
        if hasattr(keys, "rows_dense"):  # quantized rows: a dense copy to gather
            keys, values = keys.rows_dense()
        L, T = q.shape[2], keys.shape[2]
        ranges = self._subset(T, L)
        idx = mx.concatenate([mx.arange(a, b, dtype=mx.int32) for a, b in ranges])
        sub = keys[:, :, idx]
        n_ctx = idx.shape[0] - L
        pos = mx.concatenate(
            [mx.zeros((n_ctx,), mx.int32), mx.arange(L, dtype=mx.int32)]
        )
        pos = mx.broadcast_to(pos, (*sub.shape[:2], pos.shape[0]))
        _, probs = query_probs(q, sub, pos, 0, scale)  # causal among repeat rows
        (_, sink), (start, end), _ = ranges
        chunk = probs[..., sink : sink + end - start]
        self._raise_scores(self._weigh(chunk, values[:, :, start:end]), start)
        self.layer_input = None

    def _weigh(self, probs, values, queries=slice(None)):
        """[B, Hkv, C] scores of C context rows from their probabilities
        [B, Hkv, G, l, C] under the repeat queries `queries` of the call: the
        maximum over them and the GQA group, KVzip+'s weights first with `plus`
        (a maximum too, so a call's tiles combine by `_raise_scores`)."""
        if not self.options.plus:
            return probs.max(axis=(2, 3))
        x, o_proj = self.layer_input
        gram = output_gram(o_proj, probs.shape[1] * probs.shape[2])
        return plus_scores(probs, values, x[:, queries], gram)

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
        if self.compressed_ends == self.phase.ends:
            return  # another layer's end_prompt compressed every layer
        # decided once for every layer, by the first to see the prompt's end
        members = self.phase_members() or [self]
        if self.context_rows is not None and not self.needs_scores():
            for c in members:  # a later prompt within the window (a question)
                c.keep_whole()
            return
        if self.zscore is None and self.tail_queries is None:
            return
        if self.score_prompt:  # no reconstruction ran: the window scores
            for c in members:
                c.raise_tail_scores()
        compress_together([c for c in members if c.zscore is not None] or [self])
        for c in members:  # the next prompt is scored anew
            c.score_prompt = True

    def snapshot_first(self) -> bool:
        # reconstructed: the compressed cache is question-agnostic, keep it;
        # scored by the prompt's window (the question's queries): the whole
        return self.score_prompt

    def keep_whole(self) -> None:
        """A later prompt stays whole on top of the compressed context."""
        self.context_rows, self.context_end = self.rows, self.offset
        self.decode_queries = None  # their positions no longer end at offset
        self.decode_rows = None  # the question stays until the next cut
        self.tail_queries = None
        self.compressed_ends = self.phase.ends

    def keep_counted(self, scores: mx.array, n_keep: int) -> None:
        """Keep each head's best `n_keep` rows (from the model-wide choice)."""
        self.evict_to(n_keep, scores)
        self.fit_buffer()  # a layer keeping all still had room for the repeat
        self.context_rows, self.context_end = self.rows, self.offset
        self.compressed_ends = self.phase.ends
        self.decode_queries, self.decode_rows = None, None

    # ---- what the reconstruction of a later segment needs --------------------------
    def needs_scores(self) -> bool:
        """Whether the prompt now ending is compressed and would evict anything
        (else its reconstruction would be wasted): a first prompt over the
        budget, a later one that takes the layers past budget + window rows
        on average."""
        o, members = self.options, self.phase_members() or [self]
        if self.context_rows is None:
            return any(c.rows > o.budget for c in members)
        rows = sum(c.rows for c in members)
        return rows > (o.budget + o.window) * len(members)

    def segment_start(self) -> int:
        """The first position no compression has chosen among yet."""
        return 0 if self.context_end is None else self.context_end

    def run(self) -> int:
        """How many newest rows hold the newest positions, unbroken, in every head."""
        if self.positions is None:
            return self.rows
        pos = self.positions_view()
        want = mx.arange(self.offset - self.rows, self.offset, dtype=mx.int32)
        whole = (pos == want).all(axis=(0, 1))[::-1].astype(mx.int32)
        return int(mx.cumprod(whole).sum().item())

    def rows_of(self, span: tuple[int, int]) -> tuple[int, int]:
        """Row range of positions [a, b) among the newest `run()` rows."""
        a, b = span
        return self.rows - (self.offset - a), self.rows - (self.offset - b)

    def begin_reconstruction(self, start: int) -> None:
        """Positions from `start` on are scored by the reconstruction alone."""
        self.score_prompt = False
        if self.zscore is not None:
            self.zscore = self.zscore[..., : self.rows_of((start, start))[0]]

    def row_scores(self) -> mx.array:
        """[B, Hkv, rows] every row's score, 0 for rows never scored."""
        return padded_to(self.zscore, self.rows)[..., : self.rows]

    def held_arrays(self):
        held = (self.decode_queries, self.tail_queries)  # (zscore: a row array)
        return super().held_arrays() + [a for a in held if a is not None]

    # ---- decode: the compressed size plus `window` generated rows ------------------
    def after_attend(self, q, new_rows):
        if self.context_rows is None or self.in_prompt:
            return
        # the newest queries (at least this call's) score rows
        w = self.options.window
        self.decode_queries = newest_queries(self.decode_queries, q, max(w, 1))
        budget = self.options.budget
        if self.cut_after_window(self._decode_limit(), budget, self.decode_scores):
            self.decode_rows = budget

    def _decode_limit(self) -> int:
        return self.context_rows if self.decode_rows is None else self.decode_rows

    def decode_scores(self) -> mx.array:
        """[B, Hkv, T] SnapKV's score under the buffered decode queries: their
        summed probabilities, max-pooled over 7 positions, mean over the group."""
        return newest_queries_score(self, self.decode_queries)

    def trim(self, n):
        n = super().trim(n)
        if n:
            self.decode_queries = None  # they may include trimmed tokens
        return n

    def row_bound(self) -> int:
        if self.context_rows is None:
            return max(self.rows, self.options.budget)
        return self._decode_limit() + self.options.window

    def protected_mask(self, pos):
        if self.context_rows is None:
            return super().protected_mask(pos)
        # after compression: the sinks and the newest window rows stay
        recent = (pos >= self.offset - self.options.window) & (pos != PAD_POSITION)
        return (pos < self.options.sinks) | recent

    def side_arrays(self):
        held = (self.decode_queries, self.tail_queries)
        return super().side_arrays() + [a for a in held if a is not None]

    def extra_state(self):
        # the ids the patch recorded: a cache saved mid-prompt (mlx_lm.cache_prompt)
        # reconstructs its prompt when the question ends it, as the original does
        named = {
            "decode_queries": self.decode_queries,
            "tail_queries": self.tail_queries,
            "token_ids": self.phase.token_array(),
        }
        return super().extra_state() | {k: v for k, v in named.items() if v is not None}

    def load_extra_state(self, st):
        super().load_extra_state(st)
        self.decode_queries = st.get("decode_queries")
        self.tail_queries = st.get("tail_queries")
        self._loaded_ids = st.get("token_ids")  # the phase comes with the meta

    def extra_meta(self):
        return {
            "context_rows": self.context_rows,
            "context_end": self.context_end,
            "compressed_ends": self.compressed_ends,
            "decode_rows": self.decode_rows,
            "token_ids_start": self.phase.tokens_start,
        }

    def load_extra_meta(self, m):
        self.context_rows = m.get("context_rows")
        self.context_end = m.get("context_end")
        self.compressed_ends = int(m.get("compressed_ends", -1))
        self.decode_rows = m.get("decode_rows")
        ids = self._loaded_ids
        if ids is not None:  # every layer saved the same ids (one phase)
            self.phase.restore_tokens(ids.tolist(), int(m.get("token_ids_start", 0)))
        self._loaded_ids = None
