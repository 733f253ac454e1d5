"""Per-head row storage of a veloxpatch cache, and the mask over it.

Keys/values [B, Hkv, T, D] live in a step-grown buffer (mlx-lm's growth, so the
dense path matches its KVCache bit for bit) and, once anything was evicted, the
absolute position of every row [B, Hkv, T]. Heads that keep fewer rows than the
buffer holds are padded with rows at PAD_POSITION, which the causal mask hides.
"""

from __future__ import annotations

import mlx.core as mx

# Larger than any query position, so the causal mask hides a padding row.
PAD_POSITION = 2**31 - 1


def padded_to(a: mx.array, rows: int) -> mx.array:
    """Per-row side state [B, H, n <= rows] with zeros for the rows past n
    (rows never given a value)."""
    B, H, n = a.shape
    if n >= rows:
        return a
    return mx.concatenate([a, mx.zeros((B, H, rows - n), a.dtype)], axis=-1)


class RowStorage:
    step = 256  # mlx-lm's growth step

    def _init_storage(self) -> None:
        self.keys = None  # [B, Hkv, capacity, D]
        self.values = None
        self.positions = None  # None while dense: row t holds position t
        self.rows = 0  # rows in use (the same for every head; short heads pad)
        self.padded = False  # some heads hold padding rows (PAD_POSITION)

    def _append(self, k, v, offset):
        prev, L = self.rows, k.shape[2]
        if self.keys is None or prev + L > self.keys.shape[2]:
            self._grow(k, v, prev + L)
        self.keys[..., prev : prev + L, :] = k
        self.values[..., prev : prev + L, :] = v
        if self.positions is not None:
            B, H = k.shape[:2]
            new = mx.arange(offset, offset + L, dtype=mx.int32)
            self.positions[..., prev : prev + L] = mx.broadcast_to(new, (B, H, L))
        self.rows = prev + L
        return self._view()

    def _capacity(self, needed: int) -> int:
        """Rows to allocate when `needed` no longer fit (mlx-lm's step growth)."""
        return (needed + self.step - 1) // self.step * self.step

    def _grow(self, k, v, needed):
        B, H, _, Dk = k.shape
        cap = self._capacity(needed)
        if self.keys is None:
            self.keys = mx.zeros((B, H, cap, Dk), k.dtype)
            self.values = mx.zeros((B, H, cap, v.shape[3]), v.dtype)
            return
        extra = cap - self.keys.shape[2]
        k_pad = mx.zeros((B, H, extra, Dk), self.keys.dtype)
        v_pad = mx.zeros((B, H, extra, self.values.shape[3]), self.values.dtype)
        self.keys = mx.concatenate([self.keys, k_pad], axis=2)
        self.values = mx.concatenate([self.values, v_pad], axis=2)
        if self.positions is not None:
            p_pad = mx.full((B, H, extra), PAD_POSITION, mx.int32)
            self.positions = mx.concatenate([self.positions, p_pad], axis=2)

    def _view(self):
        if self.rows == self.keys.shape[2]:
            return self.keys, self.values
        return self.keys[..., : self.rows, :], self.values[..., : self.rows, :]

    def newest_keys(self, n: int) -> mx.array:
        """Keys of the last `n` rows, dense (the rows the last call added)."""
        return self._view()[0][:, :, self.rows - n : self.rows]

    def storage_arrays(self) -> dict:
        """The stored rows by name (what `state` holds besides extra_state)."""
        k, v = self._view()
        st = {"keys": k, "values": v}
        if self.positions is not None:
            st["positions"] = self.positions[..., : self.rows]
        return st

    def load_storage(self, st: dict) -> None:
        """The inverse of `storage_arrays` (pops what it reads)."""
        self.keys, self.values = st.pop("keys", None), st.pop("values", None)
        self.positions = st.pop("positions", None)
        self.rows = 0 if self.keys is None else self.keys.shape[2]

    def held_arrays(self) -> list:
        """Every array held between calls, allocated capacity included (nbytes)."""
        return [a for a in (self.keys, self.values, self.positions) if a is not None]

    def _mask(self, L: int, offset: int, n_q_heads: int):
        """mlx-lm's own choice ("causal" or none) unless heads are padded; then
        causal on the true positions, per KV head, expanded to the query heads."""
        if not self.padded:
            # Rows are in position order and all in the past of the new ones, so
            # the fused causal mask is exact, before and after eviction.
            return "causal" if L > 1 else None
        pos = self.positions[..., : self.rows]  # [B, Hkv, T]
        qpos = mx.arange(offset, offset + L, dtype=mx.int32)
        mask = pos[:, :, None, :] <= qpos[None, None, :, None]  # [B, Hkv, L, T]
        n_rep = n_q_heads // pos.shape[1]
        return mx.repeat(mask, n_rep, axis=1) if n_rep > 1 else mask

    def fit_buffer(self) -> None:
        """Free the capacity past `rows` (a gather copies the rows in use)."""
        if self.keys is None or self.keys.shape[2] == self.rows:
            return
        used = mx.arange(self.rows)
        self.keys = mx.take(self.keys, used, axis=2)
        self.values = mx.take(self.values, used, axis=2)
        if self.positions is not None:
            self.positions = mx.take(self.positions, used, axis=2)

    def truncate_rows(self, n: int) -> None:
        """Keep the first `n` stored rows of every head (the buffer stays)."""
        self.rows = n

    def forget_after(self, position: int) -> None:
        """Drop every row at `position` or later. Rows are in position order per
        head (padding last), so each head loses a suffix; heads left shorter
        than the longest are padded."""
        if self.positions is None:  # dense: row t holds position t
            self.truncate_rows(min(self.rows, position))
            return
        # the whole buffer: rows past `rows` hold padding or later positions
        self.positions = mx.where(
            self.positions < position, self.positions, PAD_POSITION
        )
        kept = self.positions[..., : self.rows] != PAD_POSITION
        n_keep = int(kept.sum(-1).max().item())
        self.truncate_rows(n_keep)
        self.padded = bool((self.positions[..., :n_keep] == PAD_POSITION).any().item())

    def positions_view(self) -> mx.array:
        """Absolute position of every stored row, [B, Hkv, T] int32."""
        if self.positions is not None:
            return self.positions[..., : self.rows]
        B, H = self.keys.shape[:2]
        # Nothing evicted yet: row t holds the token at position t.
        return mx.broadcast_to(mx.arange(self.rows, dtype=mx.int32), (B, H, self.rows))

    @property
    def evicted(self) -> bool:
        return self.positions is not None
