"""Quantized storage for any cache: `kivi`, and `kv_bits=` on eviction algorithms.

Rows live in slots: first the quantized store's (`quantized.py`, mlx's kernel
layout), then a residual in the model's dtype. New rows enter the residual;
after each call (after the algorithm has evicted) the oldest whole groups beyond
`residual` slots are quantized. Attention and scoring read the slots through
`qview.QuantizedView`: nothing is dequantized on the decode path.

Eviction on quantized rows: the algorithm keeps any rows per head, as before
(its side arrays follow its rows); the storage only forgets the evicted rows'
slots (`slot`: row -> slot), which become holes that attention masks. Nothing
is moved or requantized until the holes exceed max(group, rows / HOLE_SHARE);
then `_compact` lays every head's rows out again: values (stored a row per
token) move as they are, keys keep the groups whose rows all survived
(gathered per head, exact) and the survivors of the other groups are
requantized together in new groups (a second rounding of keys quantized once:
the price of evicting from a group), the newest rows stay in the residual, and
the holes are gone. Until anything is quantized, eviction gathers the dense
rows exactly. The spec (`options.quant`) is `kv_quant.KVQuant`.
"""

from __future__ import annotations

import contextlib
import functools

import mlx.core as mx

from .kv_quant import BITS
from .quantized import (
    QuantizedStore,
    future_moment,
    rotation_signs,
    sinks_then_groups,
)
from .qview import QuantizedView
from .storage import PAD_POSITION

HOLE_SHARE = 4  # compact once holes exceed rows / HOLE_SHARE (and a group)


class QuantizedKV:
    """Mixin over a VeloxCache: the storage described above, as
    `options.quant` (a KVQuant) specifies it."""

    def __init__(self, options=None, layer=0, num_layers=1):
        super().__init__(options, layer, num_layers)
        # self.keys / self.values: the residual [B, Hkv, slots - quantized, D]
        self.store: QuantizedStore | None = None
        self.slot = None  # row -> slot [B, Hkv, rows] int32; None: row r = slot r
        # the "query" recipe: sum of squared queries [B, Hkv, D] and their count,
        # until the first group is quantized (quantized.key_scales)
        self.query_power = None
        self.query_count = 0
        # and the sum of pre-RoPE query
        # outer products [B, Hkv, D, D] and their count, until the first group
        # is quantized; the layer's rope
        self.query_m2 = None
        self.query_m2_count = 0
        self.query_rope = None

    # ---- slots --------------------------------------------------------------------
    @property
    def quantized(self) -> int:
        """Slots in quantized storage (holes included)."""
        return 0 if self.store is None else self.store.rows

    @property
    def slots(self) -> int:
        return self.quantized + (0 if self.keys is None else self.keys.shape[2])

    @property
    def holes(self) -> int:
        return self.slots - self.rows

    def _dense(self) -> bool:
        """Nothing quantized and row r in slot r: plain dense rows."""
        return self.quantized == 0 and self.slot is None

    def _slot_map(self) -> mx.array:
        if self.slot is not None:
            return self.slot
        B, H = self.keys.shape[:2]
        return mx.broadcast_to(mx.arange(self.rows, dtype=mx.int32), (B, H, self.rows))

    def slot_positions(self) -> mx.array:
        """Position of every slot [B, Hkv, slots]; holes at PAD_POSITION."""
        pos = self.positions_view()
        if self.slot is None:
            return pos
        B, H = pos.shape[:2]
        base = mx.full((B, H, self.slots), PAD_POSITION, mx.int32)
        return mx.put_along_axis(base, self.slot, pos, axis=-1)

    # ---- storage ------------------------------------------------------------------
    def _append(self, k, v, offset):
        B, H, L = k.shape[:3]
        first = self.slots
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = mx.concatenate([self.keys, k], axis=2)
            self.values = mx.concatenate([self.values, v], axis=2)
        if self.positions is not None:
            new = mx.arange(offset, offset + L, dtype=mx.int32)
            self.positions = mx.concatenate(
                [self.positions, mx.broadcast_to(new, (B, H, L))], axis=2
            )
        if self.slot is not None:
            new = mx.arange(first, first + L, dtype=mx.int32)
            self.slot = mx.concatenate(
                [self.slot, mx.broadcast_to(new, (B, H, L))], axis=2
            )
        self.rows += L
        return self._view(offset, L)

    def _view(self, qstart=None, L=0):
        """Dense keys and values while nothing is quantized, else a
        QuantizedView standing for both (masked when holes, padding or several
        new queries need it)."""
        if self._dense():
            return self.keys, self.values
        masked = L > 1 or self.holes > 0 or self.padded
        view = QuantizedView(
            self.store,
            self.keys,
            self.values,
            self.slot,
            self.rows,
            self.offset if qstart is None else qstart,
            self.slot_positions() if masked else None,
            self.padded,
        )
        return view, view

    def newest_keys(self, n: int) -> mx.array:
        return self.keys[:, :, self.keys.shape[2] - n :]

    def take_stored(self, idx):
        idx = idx.astype(mx.int32)
        if self._dense():
            self.keys = mx.take_along_axis(self.keys, idx[..., None], axis=2)
            self.values = mx.take_along_axis(self.values, idx[..., None], axis=2)
        else:  # the evicted rows' slots become holes
            self.slot = mx.take_along_axis(self._slot_map(), idx, axis=-1)

    def fit_buffer(self):
        pass  # slots grow exactly: there is no spare capacity

    def truncate_rows(self, n):
        if self.positions is not None:  # held exactly, not in a grown buffer
            self.positions = self.positions[..., :n]
        tq = self.quantized
        # the kept rows' grid read the trimmed ones, or they were quantized only
        # because the trimmed ones came (the n rows alone stay full precision)
        if self._cuts_a_group(n) or self._quantized_past_fresh(n):
            self.irreversible_at = max(self.irreversible_at or 0, self.offset)
        sinks = 0 if self.store is None else self.store.sink_rows
        if self.slot is not None and n >= sinks:  # (the sinks are rows 0..s-1)
            self.slot = self.slot[..., :n]
        elif self.slot is None and n >= tq:
            self.keys, self.values = (
                self.keys[:, :, : n - tq],
                self.values[:, :, : n - tq],
            )
        else:  # whole groups (or sinks) stay; the rest of the last one is holes
            B, H = self.keys.shape[:2]
            self.store.truncate(self.store.kept_rows(n))
            self.keys, self.values = self.keys[:, :, :0], self.values[:, :, :0]
            self.slot = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (B, H, n))
        self.rows = n
        self.truncate_row_arrays(n)  # (the dense storage's truncate is not ours)

    def _cuts_a_group(self, n: int) -> bool:
        """Whether keeping the first n rows keeps a quantized group some of
        whose rows go: its scales and biases were set by them too."""
        if self.slot is None:
            return n < self.quantized and self.store.kept_rows(n) != n
        gone = self.slot[..., n:]
        return gone.size > 0 and bool((gone < self.quantized).any().item())

    def _quantized_past_fresh(self, n: int) -> bool:
        """Whether the first n rows hold more quantized rows than a cache that
        saw only them would (the sinks, then whole groups past the residual)."""
        if self.store is None:
            return False
        o = self.options.quant
        fresh = sinks_then_groups(max(0, n - o.residual), self._sinks, o.group)
        if self.slot is None:
            return min(n, self.quantized) > fresh
        held = (self.slot[..., :n] < self.quantized).sum(-1)
        return int(held.max().item()) > fresh

    @property
    def trim_keeps_queries(self) -> bool:
        # the "query" recipe sums the queries until the first group is quantized
        pending = self.query_power is not None or self.query_m2 is not None
        return pending or super().trim_keeps_queries

    def _compact(self) -> None:
        """Lay every head's rows out again with no holes (see the module doc).
        kivi's dense sinks (rows and slots 0..s-1, never evicted or holed) stay
        as they are; the rows after them are regrouped."""
        g, s = self.options.quant.group, self.store.sink_rows
        K, tq, S = self.rows - s, self.quantized - s, self.slots - s
        B, H = self.keys.shape[:2]
        slot = self._slot_map()[..., s:] - s
        order = mx.broadcast_to(mx.arange(K, dtype=mx.int32), (B, H, K))
        n_intact = mx.zeros((B, H), mx.int32)
        if tq:
            live = mx.zeros((B, H, S), mx.int32)
            live = mx.put_along_axis(live, slot, mx.array(1, mx.int32), axis=-1)
            intact = live[..., :tq].reshape(B, H, tq // g, g).sum(-1) == g
            group = mx.minimum(slot // g, tq // g - 1)
            whole = (slot < tq) & mx.take_along_axis(intact, group, axis=-1)
            # rows of intact groups first, in slot order (so group by group)
            order = mx.argsort(mx.where(whole, slot, S + order), axis=-1)
            n_intact = whole.sum(-1) // g
        src = mx.take_along_axis(slot, order, axis=-1)  # old slot of each new one
        keys, values = self.keys, self.values
        if tq:
            dk, dv = self.store.dequantize(keys.dtype)
            keys = mx.concatenate([dk[:, :, s:], keys], axis=2)
            values = mx.concatenate([dv[:, :, s:], values], axis=2)
        keys = mx.take_along_axis(keys, src[..., None], axis=2)
        values = mx.take_along_axis(values, src[..., None], axis=2)
        new_tq = max(0, (K - self.options.quant.residual) // g) * g
        firsts = mx.arange(0, new_tq, g, dtype=mx.int32)
        exact = firsts // g < n_intact[..., None]
        gid = mx.take_along_axis(src, mx.broadcast_to(firsts, (B, H, new_tq // g)), -1)
        new_k, new_v = keys[:, :, :new_tq], values[:, :, :new_tq]
        with self._first_scales():  # the first group may be formed here
            self.store.rebuild(new_k, new_v, exact, gid // g, src[..., :new_tq])
        # copied out: a slice would keep every row's dequantized copy alive
        self.keys = mx.contiguous(keys[:, :, new_tq:])
        self.values = mx.contiguous(values[:, :, new_tq:])
        self.slot = None
        if tq:
            rest = mx.argsort(order, axis=-1).astype(mx.int32) + s
            sinks = mx.broadcast_to(mx.arange(s, dtype=mx.int32), (B, H, s))
            self.slot = mx.concatenate([sinks, rest], axis=-1) if s else rest

    # ---- when rows are quantized --------------------------------------------------
    def rotate(self, q, k, rope, offset, query_scale):
        if self.options.quant.rounds and not self._moment_used:
            self.query_rope = rope
            self._add_query_m2(
                q if query_scale is None else q * query_scale, k.shape[1]
            )
        return super().rotate(q, k, rope, offset, query_scale)

    @property
    def _moment_used(self) -> bool:
        """The rounding factor (what the queries' moment sets) is set."""
        return self.store is not None and self.store.key_factor is not None

    def _add_query_m2(self, q, H: int) -> None:
        """Add a call's pre-RoPE queries [B, Hq, L, D] to the sums of outer
        products per KV head (H of them)."""
        B, Hq, L, D = q.shape
        qg = q.astype(mx.float32).reshape(B, H, Hq // H * L, D)
        m2 = qg.swapaxes(-1, -2) @ qg
        self.query_m2 = m2 if self.query_m2 is None else self.query_m2 + m2
        self.query_m2_count += Hq // H * L

    def after_attend(self, q, new_rows):
        super().after_attend(q, new_rows)  # the algorithm evicts first
        if self.options.quant.rotated and not self._scaled:
            self._add_query_power(q)
        self._settle()

    @property
    def _scaled(self) -> bool:
        return self.store is not None and self.store.key_scale is not None

    def _add_query_power(self, q) -> None:
        """Add a call's queries [B, Hq, L, D] to the squared sums per KV head."""
        B, Hq, L, D = q.shape
        H = self.keys.shape[1]
        qg = q.astype(mx.float32).reshape(B, H, Hq // H * L, D)
        power = (qg * qg).sum(2)
        if self.query_power is not None:
            power = power + self.query_power
        self.query_power = power
        self.query_count += Hq // H * L

    def end_prompt(self):
        super().end_prompt()
        self._settle()

    def _settle(self) -> None:
        """Compact if the holes are too many, then quantize the oldest whole
        groups beyond `residual` slots."""
        o = self.options.quant
        if self.store is not None and self.holes > max(
            o.group, self.rows // HOLE_SHARE
        ):
            self._compact()
            self.evaluate_rewrite()
        if self.store is None:
            if self.keys is None:
                return
            self.store = self._new_store()
        if self.in_prompt and self.options.holds_prompt():
            # held at full precision until it ends (the SnapKV family and
            # expected_attention): the caller's prefill chunks change nothing
            return
        n = self.store.to_fill(self.keys.shape[2] - o.residual)
        if n > 0:
            with self._first_scales():
                self.store.append(self.keys[:, :, :n], self.values[:, :, :n])
            # copied out: the residual's slice would hold the call's dense rows
            self.keys = mx.contiguous(self.keys[:, :, n:])
            self.values = mx.contiguous(self.values[:, :, n:])

    @contextlib.contextmanager
    def _first_scales(self):
        """Rows quantized inside: the "query" recipe's first group sets the key
        scales from the query sums so far, and its rounding factor from the
        queries' second moment moved to the next positions (the store gets
        them only for this call: a sink alone sets none, and a later group
        must read newer sums)."""
        if self.query_power is not None:
            self.store.query_power = self.query_power / self.query_count
        # (a loaded cache settled before any call knows no rope: nearest rounding)
        if self.query_m2 is not None and self.query_rope is not None:
            m2 = self.query_m2 / self.query_m2_count
            self.store.query_moment = future_moment(self.query_rope, self.offset, m2)
        try:
            yield
        finally:  # never left for a later group to read
            self.store.query_power = self.store.query_moment = None
        if self._scaled and self.query_count:  # the scales were set just now
            # from every query so far: a trim cannot take those back
            self.irreversible_at = max(self.irreversible_at or 0, self.offset)
            self.query_power, self.query_count = None, 0
        if self._moment_used and self.query_m2_count:  # likewise
            self.irreversible_at = max(self.irreversible_at or 0, self.offset)
            self.query_m2, self.query_m2_count = None, 0

    def _new_store(self) -> QuantizedStore:
        """An empty store as the spec says: with a rotation, the signs of every
        KV head of the layer are drawn, so a sharded model's ranks rotate their
        heads as unsharded."""
        o = self.options.quant
        signs = None
        if o.rotated:
            H, D = self.keys.shape[1], self.keys.shape[3]
            every = rotation_signs(H * self.shards.size, D, self.layer)
            signs = self.shards.my_heads(every, axis=0)
        return QuantizedStore(
            o.bits, o.group, signs, self._sinks, o.key_bits, o.rotated, o.rounds
        )

    @property
    def _sinks(self) -> int:
        """Rows held dense ahead of the quantized ones (on an evicting
        algorithm, among its `sinks`, so never evicted or holed)."""
        return self.options.quant.sinks

    def side_arrays(self):
        side = super().side_arrays() + [self.keys, self.values]
        side += [] if self.store is None else self.store.arrays()
        side += [] if self.slot is None else [self.slot]
        side += [] if self.query_power is None else [self.query_power]
        return side + ([] if self.query_m2 is None else [self.query_m2])

    # ---- contract -----------------------------------------------------------------
    def held_arrays(self):
        store = [] if self.store is None else self.store.arrays()
        slot = [] if self.slot is None else [self.slot]
        return super().held_arrays() + store + slot

    def storage_arrays(self) -> dict:
        st = {"keys": self.keys, "values": self.values}  # the residual
        if self.positions is not None:
            st["positions"] = self.positions
        if self.slot is not None:
            st["slot"] = self.slot
        if self.store is not None:
            st.update(self.store.state())
        if self.query_power is not None:
            st["query_power"] = self.query_power
            st["query_count"] = mx.array([self.query_count], dtype=mx.int32)
        if self.query_m2 is not None:
            st["query_m2"] = self.query_m2
            st["query_m2_count"] = mx.array([self.query_m2_count], dtype=mx.int32)
        return st

    def load_storage(self, st):
        o = self.options.quant
        if "window_q" in st:  # kv_bits="adaptive" before its widths were set
            raise ValueError("saved with kv_bits='adaptive', which is retired")
        self.store = QuantizedStore.from_state(
            st, o.group, self._sinks, o.rotated, o.rounds
        )
        for k in [k for k in st if k.split(".")[0] in ("q", *self._part_names())]:
            st.pop(k)
        self.slot = st.pop("slot", None)
        self.query_power = st.pop("query_power", None)
        count = st.pop("query_count", None)
        self.query_count = 0 if count is None else int(count.item())
        self.query_m2 = st.pop("query_m2", None)
        count = st.pop("query_m2_count", None)
        self.query_m2_count = 0 if count is None else int(count.item())
        super().load_storage(st)
        self.rows = self.slots if self.slot is None else self.slot.shape[-1]

    @staticmethod
    def _part_names():
        return tuple(f"q{w}" for w in BITS)

    def clone(self):
        new = super().clone()
        new.store = None if self.store is None else self.store.clone()
        return new


@functools.cache
def quantized_variant(cls: type) -> type:
    """`cls` storing its rows quantized (eviction algorithms with `kv_bits`)."""
    doc = f"{cls.__name__} with quantized rows (kv_bits)."
    return type(cls.__name__ + "KVBits", (QuantizedKV, cls), {"__doc__": doc})
