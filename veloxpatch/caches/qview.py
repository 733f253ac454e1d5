"""Attention over quantized rows without dequantizing them.

A quantized cache holds its rows in slots: first the quantized store's, then
the full-precision residual's. Eviction only forgets which slot a row was in
(the slot becomes a hole, masked), so a row's slot is given by `slot` [B, H,
rows] (None: row r is slot r). `QuantizedView` is what the cache hands to
attention and to scoring in place of dense keys and values:

- `attend(q, scale)`: softmax(q . K^T * scale) . V over every slot, q.K^T and
  p.V on mlx's quantized kernels (`quantized.py`) for the store and dense
  matmuls for the residual. GQA never repeats keys: the query heads that share
  a KV head are stacked as rows, q [B, Hkv, rep * L, D]. Holes and padding rows
  (position PAD) and future positions are masked. A call of many queries
  (`reads_dense`: a prefill chunk) instead dequantizes the rows once (holes
  dropped, so "causal" is exact unless heads hold padding) and runs the fused
  kernel (in tiles on the CPU, `attention_math.fused_attention`): its L x slots
  scores would cost more time and memory than one dense copy of the rows.
- `logits(q)`: q . K^T for q [B, Hkv, M, D], per row (what scoring reads); on
  the CPU, many query rows read the dense copy too.

A view is read within one call: its dense copy is made once for all of them.
"""

from __future__ import annotations

import mlx.core as mx

from .attention_math import fused_attention

DENSE_QUERIES = 32  # off the CPU: a call of this many queries reads a dense copy
# On the CPU mlx's quantized matmul is linear in query rows, about 0.6 ms a row
# per KV head over 4,096 keys: from this many rows dequantizing once is faster
# (docs/results.md, "Quantized kernels on the CPU")
CPU_DENSE_ROWS = 8


class QuantizedView:
    def __init__(
        self,
        store,
        keys,
        values,
        slot,
        rows,
        qstart=0,
        slot_pos=None,
        padded=False,
    ):
        self.store, self.keys, self.values = store, keys, values
        self.slot, self.rows = slot, rows
        self.qstart = qstart  # position of the call's first query
        self.slot_pos = slot_pos  # [B, H, S]: None when nothing needs masking
        self.padded = padded  # some heads hold padding rows (PAD)
        self._rows_dense = None

    @property
    def shape(self) -> tuple:
        B, H, _, D = self.keys.shape
        return (B, H, self.rows, D)

    @property
    def dtype(self):
        return self.keys.dtype

    def slot_logits(self, q: mx.array) -> mx.array:
        """q [B, H, M, D] . K^T over every slot -> [B, H, M, S]."""
        parts = []
        if self.store is not None and self.store.rows:
            parts.append(self.store.logits(q))
        if self.keys.shape[2]:
            parts.append(q @ self.keys.swapaxes(-1, -2))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    def logits(self, q: mx.array) -> mx.array:
        """q . K^T per row [B, H, M, rows] (rows in the cache's row order)."""
        if reads_dense(q.shape[2], 0):
            return q @ self.rows_dense()[0].swapaxes(-1, -2)
        s = self.slot_logits(q)
        if self.slot is None:
            return s
        return mx.take_along_axis(s, self.slot[:, :, None, :], axis=-1)

    def weighted(self, p: mx.array) -> mx.array:
        """p [B, H, M, S] (over slots) . V -> [B, H, M, D]."""
        tq = 0 if self.store is None else self.store.rows
        out = None
        if tq:
            out = self.store.weighted(p[..., :tq])
        if self.values.shape[2]:
            r = p[..., tq:] @ self.values
            out = r if out is None else out + r
        return out

    def dense(self) -> tuple[mx.array, mx.array]:
        """Keys and values of every slot [B, H, S, D], dequantized (a copy)."""
        if self.store is None or not self.store.rows:
            return self.keys, self.values
        dk, dv = self.store.dequantize(self.keys.dtype)
        keys = mx.concatenate([dk, self.keys], axis=2)
        return keys, mx.concatenate([dv, self.values], axis=2)

    def rows_dense(self) -> tuple[mx.array, mx.array]:
        """Keys and values per row [B, H, rows, D] in the cache's row order,
        dequantized (a copy, made once: for scorers that need the vectors)."""
        if self._rows_dense is None:
            keys, values = self.dense()
            if self.slot is None:
                keys, values = keys[:, :, : self.rows], values[:, :, : self.rows]
            else:
                idx = self.slot[..., None]
                keys = mx.take_along_axis(keys, idx, 2)
                values = mx.take_along_axis(values, idx, 2)
            self._rows_dense = keys, values
        return self._rows_dense

    def _attend_dense(self, q: mx.array, scale: float) -> mx.array:
        if not self.padded:
            # every earlier row precedes the call's first query and the call's
            # rows come last: over the rows (holes dropped) "causal" is exact
            keys, values = self.rows_dense()
            held_until_read(q, keys)
            return fused_attention(q, keys, values, scale, "causal")
        keys, values = self.dense()
        held_until_read(q, keys)
        rep = q.shape[1] // keys.shape[1]

        def mask(first: int, stop: int) -> mx.array:  # queries first..stop by position
            qpos = mx.arange(self.qstart + first, self.qstart + stop, dtype=mx.int32)
            visible = self.slot_pos[:, :, None, :] <= qpos[:, None]
            return mx.repeat(visible, rep, axis=1) if rep > 1 else visible

        return fused_attention(q, keys, values, scale, mask)

    def attend(self, q: mx.array, scale: float) -> mx.array:
        B, Hq, L, D = q.shape
        H = self.keys.shape[1]
        rep = Hq // H
        if reads_dense(rep * L, L):
            return self._attend_dense(q, scale)
        qg = (q * scale).reshape(B, H, rep * L, D)
        s = self.slot_logits(qg)
        if self.slot_pos is not None:
            S = s.shape[-1]
            qpos = mx.arange(self.qstart, self.qstart + L, dtype=mx.int32)
            visible = self.slot_pos[:, :, None, None, :] <= qpos[:, None]
            low = mx.finfo(s.dtype).min
            s = mx.where(visible, s.reshape(B, H, rep, L, S), low)
            s = s.reshape(B, H, rep * L, S)
        p = mx.softmax(s, axis=-1, precise=True)
        return self.weighted(p.astype(q.dtype)).reshape(B, Hq, L, D)


def held_until_read(*arrays) -> None:
    """On the CPU, evaluate the queries and a dense copy's keys before the tiles
    read them: left lazy, each layer's copy (and what made it) stays alive until
    the whole chunk is evaluated, a copy per layer at the peak (the values,
    evaluated with them, raised it again: docs/results.md)."""
    if mx.default_device() == mx.cpu:
        mx.eval(*arrays)


def reads_dense(rows: int, queries: int) -> bool:
    """Whether `rows` query rows per KV head (of `queries` positions; 0: a
    scorer's) read a dense copy of the rows instead of the quantized kernels."""
    if mx.default_device() == mx.cpu:
        return rows >= CPU_DENSE_ROWS
    return queries >= DENSE_QUERIES
