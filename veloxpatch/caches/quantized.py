"""Quantized rows on mlx's kernels: the storage behind `kivi` and `kv_bits=`.

Keys are stored transposed, K^T [B, H, D, T], and quantized along T in groups
of `group` tokens: one scale and bias per channel and group of tokens, KIVI's
per-channel keys. Values [B, H, T, D] are quantized along D in groups of
`group` channels, per token. Both are mlx's packed affine layout (codes as a
little-endian bit stream in uint32 words, scales and biases in the model's
dtype) on the paper's min/max grid (scale (max - min) / (2^bits - 1), zero
point min), so attention never dequantizes:

    q . K^T = quantized_matmul(q, Kt_w, Kt_s, Kt_b, transpose=False)
    p . V   = quantized_matmul(p, V_w, V_s, V_b, transpose=False)

Rows are added in whole groups; a group of keys shares its scales, so rows are
never taken out one by one: whole groups are gathered per head
(`take_groups`), anything else is requantized (`rebuild`). `key_bits`: keys at
another width than values, as llama.cpp's separate key and value cache types.

The "query" recipe (`kv_quant.py`) adds three things, each fixed when the first
group is quantized, saved with the state and counted in the bytes held:
- Rotation: each head's keys and values are stored as x M, M = diag(signs) H /
  sqrt(D) (random signs per head and channel, H the Hadamard matrix;
  TurboQuant / QuaRot), an orthogonal map that spreads outlier channels over
  every coordinate. q . k = (q M) . (k M) and p . (V M) M^T is the output, so
  the store still never dequantizes; everything outside it sees unrotated rows.
- Query-aware scaling: keys are scaled per channel by s before the rotation and
  queries by 1 / s, s_c = (E[q_c^2] / var_c)^(1/4) (var_c the channel's spread
  within its key groups), which minimises E[(q . (k - k_hat))^2] over such
  scalings; E[q_c^2] from the queries seen before the first group (the
  prompt's own, `key_scales`).
- Rounding for the queries: each key is rounded channel by channel on its
  group's grid and each error fed forward to its later channels by GPTQ's rule
  (Frantar et al., 2023; U the upper Cholesky factor of H^-1), H = E[q q^T] of
  the queries to come: the prompt's pre-RoPE queries moved by the layer's rope
  to the next `FUTURE_QUERIES` positions (`future_moment`). U's strict upper
  triangle is held on 8 bits (`pack_factor`).
- Sinks: the store's first row (where attention sinks its surplus) is held
  dense and unrotated ahead of the quantized groups: its key is an outlier that
  takes a group's scale, and every query reads it.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np


def pack(codes: mx.array, bits: int) -> mx.array:
    """uint32 codes [..., n] (n a multiple of 32) -> mlx's packed words
    [..., n / 32 * bits]: code i at bits i*bits .. i*bits + bits - 1 of the
    little-endian bit stream (what mx.quantize writes, for every width)."""
    *lead, n = codes.shape
    if 32 % bits == 0:  # whole codes per word: shift and add
        per = 32 // bits
        shifts = mx.arange(per, dtype=mx.uint32) * bits
        words = codes.reshape(*lead, n // per, per) << shifts
        return words.sum(-1).astype(mx.uint32)
    c = codes.reshape(*lead, n // 32, 32).astype(mx.uint64)
    start = mx.arange(32, dtype=mx.uint64) * bits
    shifted = c << (start % 32)  # within its first word; may spill into the next
    word = (start // 32).astype(mx.int32)[:, None]
    lo = (word == mx.arange(bits)[None]).astype(mx.uint64)  # [32, bits]
    hi = (word + 1 == mx.arange(bits)[None]).astype(mx.uint64)
    low = (shifted & 0xFFFFFFFF)[..., None] * lo
    words = low.sum(-2) + ((shifted >> 32)[..., None] * hi).sum(-2)
    return words.astype(mx.uint32).reshape(*lead, n // 32 * bits)


def _groups(x: mx.array, group: int) -> mx.array:
    """x [..., n] as float32 groups [..., n / group, group]."""
    *lead, n = x.shape
    return x.astype(mx.float32).reshape(*lead, n // group, group)


def _encode(x: mx.array, g: mx.array, scales, biases, bits: int):
    """x's codes on the affine grid `scales` x code + `biases` of its groups g,
    packed: (words, scales, biases) in mlx's layout. A group of scale 0 is its
    bias whatever its codes."""
    s = mx.maximum(scales.astype(mx.float32), 1e-12)
    codes = mx.round((g - biases.astype(mx.float32)) / s)
    codes = mx.clip(codes, 0, 2**bits - 1).astype(mx.uint32).reshape(x.shape)
    return pack(codes, bits), scales[..., 0], biases[..., 0]


def minmax_grid(g: mx.array, bits: int, dtype):
    """The paper's grid of groups g [..., group]: (scales, biases) [..., 1] in
    `dtype`, scale (max - min) / (2^bits - 1), bias min."""
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    return ((hi - lo) / (2**bits - 1)).astype(dtype), lo.astype(dtype)


def minmax_quantize(x: mx.array, group: int, bits: int, dtype=None):
    """The paper's grid in mlx's layout: (words, scales, biases) along the last
    axis, scales and biases in `dtype` (default x's)."""
    g = _groups(x, group)
    return _encode(x, g, *minmax_grid(g, bits, dtype or x.dtype), bits)


def feedback_quantize(k: mx.array, group: int, bits: int, factor):
    """Keys k [B, H, T, D] quantized per channel (K^T along T, as `quantize`
    lays them out) with rounding error fed forward along each key's channels
    (GPTQ's rule, Frantar et al. 2023): channel j is rounded on its group's
    grid, then the later channels of the same key move by -e_j U[j] / U[j, j],
    `factor` U [B, H, D, D] the upper Cholesky factor of H^-1, so that the
    error lands where q^T H q (the expected queries) is small (module doc).
    The grid is the unmoved keys'."""
    g = _groups(k.swapaxes(-1, -2), group)  # [B, H, D, T/group, group]
    scales, biases = minmax_grid(g, bits, k.dtype)

    def per_key(a):  # [B, H, D, T/group, 1] -> each key's, [B, H, T, D]
        return mx.repeat(a.astype(mx.float32)[..., 0], group, -1).swapaxes(-1, -2)

    step = per_key(mx.maximum(scales.astype(mx.float32), 1e-12))
    rows = factor / mx.diagonal(factor, axis1=-2, axis2=-1)[..., None]
    codes = _fed_forward(2**bits - 1)(k.astype(mx.float32), per_key(biases), step, rows)
    return pack(codes.astype(mx.uint32), bits), scales[..., 0], biases[..., 0]


@functools.cache
def _fed_forward(top: int):
    """The rounding loop of `feedback_quantize`, compiled (one graph of D
    steps, not D x 8 ops a flush): codes [B, H, D, T] of keys w [B, H, T, D]
    on grids (zero, step) [B, H, T, D], `rows` U[j] / U[j, j] [B, H, D, D]."""

    @mx.compile
    def rounding(w, zero, step, rows):
        codes = []
        for j in range(w.shape[-1]):
            c = mx.clip(mx.round((w[..., j] - zero[..., j]) / step[..., j]), 0, top)
            err = w[..., j] - zero[..., j] - c * step[..., j]
            w = w - err[..., None] * rows[:, :, None, j, :]
            codes.append(c)
        return mx.stack(codes, axis=2)

    return rounding


def rotate(x: mx.array, signs: mx.array) -> mx.array:
    """x [B, H, n, D] -> x M per head (signs [H, D] of +-1)."""
    y = mx.hadamard_transform(x.astype(mx.float32) * signs[None, :, None, :])
    return y.astype(x.dtype)


def unrotate(y: mx.array, signs: mx.array) -> mx.array:
    """y [B, H, n, D] -> y M^T: H is symmetric, its scale 1/sqrt(D) included."""
    x = mx.hadamard_transform(y.astype(mx.float32)) * signs[None, :, None, :]
    return x.astype(y.dtype)


def rotation_signs(heads: int, dim: int, layer: int) -> mx.array:
    """The +-1 signs [heads, dim] of a layer's rotation, seeded by the layer (a
    cache's state stores them, so a loaded cache never draws again)."""
    key = mx.random.key(0x5EED + layer)
    draw = mx.random.bernoulli(0.5, (heads, dim), key=key)
    return mx.where(draw, 1.0, -1.0).astype(mx.float32)


def key_scales(query_power: mx.array | None, k: mx.array, group: int) -> mx.array:
    """Per-channel key scales [B, H, D] (module doc, query-aware scaling) from
    the mean squared query per KV head and channel, query_power [B, H, D]
    (None: no queries seen, scales 1), and unrotated keys k [B, H, n, D], n a
    multiple of `group`: var_c is the channel's variance within each group of
    rows, averaged. Floors keep a silent channel finite; the scales' geometric
    mean is 1 per head (the grid ignores a common factor)."""
    B, H, n, D = k.shape
    if query_power is None:
        return mx.ones((B, H, D), dtype=mx.float32)
    g = k.astype(mx.float32).reshape(B, H, n // group, group, D)
    var = ((g - g.mean(3, keepdims=True)) ** 2).mean(axis=(2, 3))
    power = query_power.astype(mx.float32)
    var = var + 1e-6 * var.mean(-1, keepdims=True) + 1e-30
    power = power + 1e-6 * power.mean(-1, keepdims=True) + 1e-30
    log_s = 0.25 * (mx.log(power) - mx.log(var))
    return mx.exp(log_s - log_s.mean(-1, keepdims=True))


def _damped(h: mx.array) -> mx.array:
    """h [..., D, D] plus `ROUNDING_DAMP` of its mean diagonal (and a floor)."""
    D = h.shape[-1]
    diag = mx.diagonal(h, axis1=-2, axis2=-1).mean(-1)[..., None, None]
    return h + (ROUNDING_DAMP * diag + 1e-12) * mx.eye(D)


FUTURE_QUERIES = 512  # positions after the prompt whose queries the rounding weighs
ROUNDING_DAMP = 0.01  # of H's mean diagonal, added before inverting (as GPTQ)


def rotation_at(rope, position: int, dim: int) -> mx.array:
    """The linear map [dim, dim] `rope` applies at `position` (column j: the
    rotated e_j)."""
    basis = mx.eye(dim, dtype=mx.float32)[:, None, None, :]  # [dim, 1, 1, dim]
    return rope(basis, offset=position)[:, 0, 0].astype(mx.float32).T


def future_moment(rope, start: int, m2: mx.array, n: int = FUTURE_QUERIES):
    """The mean over positions t in [start, start + n) of R_t m2 R_t^T (n a
    power of two): the second moment [B, H, D, D] of post-RoPE queries at those
    positions, from their pre-RoPE one m2. Summed by doubling, R_(t+m) = R_m
    R_t, each R_m normed to a rotation (a scaled rope, YaRN's, scales every
    position alike: R_start carries it)."""
    D = m2.shape[-1]
    r = rotation_at(rope, start, D)
    total = r @ m2.astype(mx.float32) @ r.T
    span = 1
    while span < n:
        r = rotation_at(rope, span, D)
        r = r / mx.linalg.norm(r[:, 0])
        total = total + r @ total @ r.T
        span *= 2
    return total / span


def rounding_factor(h: mx.array) -> mx.array:
    """GPTQ's U [B, H, D, D] for a second moment h of the queries (as stored):
    the upper Cholesky factor of (h + damp)^-1, damp `ROUNDING_DAMP` of h's
    mean diagonal (and a floor) so that a silent direction stays finite."""
    inv = mx.linalg.inv(_damped(h), stream=mx.cpu)
    inv = (inv + inv.swapaxes(-1, -2)) / 2
    return mx.linalg.cholesky(inv, upper=True, stream=mx.cpu)


@functools.cache
def _strict_upper(dim: int) -> mx.array:
    """Flat indices of a dim x dim matrix's strict upper triangle."""
    i, j = np.triu_indices(dim, 1)
    return mx.array(i * dim + j)


def pack_factor(u: mx.array) -> tuple[mx.array, mx.array]:
    """U [B, H, D, D] as the store holds it: its rows over their diagonal (all
    the feedback reads), the strict upper triangle on 8 bits, codes int8
    [B, H, D(D-1)/2] and one fp32 step a head [B, H, 1] (the feedback's
    weights, not the keys: a step of 1/254 of the largest is far below the
    rounding it steers)."""
    B, H, D, _ = u.shape
    rows = u / mx.diagonal(u, axis1=-2, axis2=-1)[..., None]
    flat = rows.reshape(B, H, D * D)[..., _strict_upper(D)].astype(mx.float32)
    step = mx.maximum(mx.abs(flat).max(-1, keepdims=True) / 127, 1e-12)
    return mx.round(flat / step).astype(mx.int8), step


def unpack_factor(packed: mx.array, step: mx.array | None, dim: int) -> mx.array:
    """`pack_factor`'s rows back as a unit upper triangular [B, H, D, D] (step
    None: a triangle saved in fp16, as files before the 8-bit one)."""
    B, H, _ = packed.shape
    values = packed.astype(mx.float32)
    if step is not None:
        values = values * step
    flat = mx.zeros((B, H, dim * dim), dtype=mx.float32)
    flat[..., _strict_upper(dim)] = values
    return flat.reshape(B, H, dim, dim) + mx.eye(dim)


def _cat(old, new, axis):
    return new if old is None else mx.concatenate([old, new], axis=axis)


class QuantizedRows:
    """Quantized rows of every head, [B, H, ...]: keys per channel (KIVI), `kw`
    [B, H, D, T/32*key_bits], `ks`, `kb` [B, H, D, T/group]; values `vw` [B,
    H, T, D/32*bits], `vs`, `vb` [B, H, T, D/group]. `key_bits`: the keys'
    width, when not `bits`."""

    NAMES = ("kw", "ks", "kb", "vw", "vs", "vb")
    PER_TOKEN = ("vw", "vs", "vb")  # stored a row per token: [B, H, T, ...]

    def __init__(self, bits: int, group: int, key_bits: int | None = None):
        self.bits, self.group = bits, group
        self.key_bits = key_bits or bits
        self._empty()

    def _empty(self) -> None:
        for name in self.NAMES:
            setattr(self, name, None)

    @property
    def rows(self) -> int:
        return 0 if self.vw is None else self.vw.shape[2]

    def _qmm(self, x, w, s, b, bits):
        return mx.quantized_matmul(
            x, w, s, b, transpose=False, group_size=self.group, bits=bits
        )

    def _dq(self, w, s, b, bits):
        return mx.dequantize(w, s, b, group_size=self.group, bits=bits)

    def append(self, k: mx.array, v: mx.array, factor=None) -> None:
        """Quantize and add rows [B, H, n, D]; n is a multiple of `group`.
        `factor`: keys rounded with error feedback by this U [B, H, D, D]
        (`feedback_quantize`)."""
        g, kb_ = self.group, self.key_bits
        if factor is not None:
            kw, ks, kb = feedback_quantize(k, g, kb_, factor)
        else:
            kw, ks, kb = minmax_quantize(k.swapaxes(-1, -2), g, kb_)
        vw, vs, vb = minmax_quantize(v, g, self.bits)
        new = dict(kw=kw, ks=ks, kb=kb, vw=vw, vs=vs, vb=vb)
        for name in self.NAMES:
            a = _cat(
                getattr(self, name), new[name], 2 if name in self.PER_TOKEN else -1
            )
            setattr(self, name, a)

    def logits(self, q: mx.array) -> mx.array:
        """q [B, H, M, D] . K^T -> [B, H, M, T]."""
        return self._qmm(q, self.kw, self.ks, self.kb, self.key_bits)

    def weighted(self, p: mx.array) -> mx.array:
        """p [B, H, M, T] . V -> [B, H, M, D]."""
        return self._qmm(p, self.vw, self.vs, self.vb, self.bits)

    def dequantize(self, dtype) -> tuple[mx.array, mx.array]:
        """Keys and values [B, H, T, D] in `dtype` (computed, never stored)."""
        keys = self._dq(self.kw, self.ks, self.kb, self.key_bits).swapaxes(-1, -2)
        values = self._dq(self.vw, self.vs, self.vb, self.bits)
        return keys.astype(dtype), values.astype(dtype)

    def _by_group(self):
        """Every array with its groups of rows on one axis: name -> (array
        reshaped [B, H, ..., G, per-group], axis of G)."""
        B, H, T = *self.vw.shape[:2], self.rows
        G = T // self.group
        out = {}
        for name in self.NAMES:
            a = getattr(self, name)
            if name in self.PER_TOKEN:  # [B, H, T, x] -> [B, H, G, group*x]
                out[name] = (a.reshape(B, H, G, -1), 2)
            else:  # [B, H, D, T*] -> [B, H, D, G, T*/G]
                out[name] = (a.reshape(B, H, a.shape[2], G, a.shape[3] // G), 3)
        return out

    def _from_groups(self, grouped: dict) -> None:
        for name, (a, axis) in grouped.items():
            if axis == 3:
                setattr(self, name, a.reshape(*a.shape[:3], -1))
            else:
                B, H, G, _ = a.shape
                setattr(self, name, a.reshape(B, H, G * self.group, -1))

    def take_groups(self, gid: mx.array) -> None:
        """Keep groups gid [B, H, J] of every head, in that order (exact)."""
        out = {}
        for name, (a, axis) in self._by_group().items():
            idx = gid[:, :, None, :, None] if axis == 3 else gid[..., None]
            out[name] = (mx.take_along_axis(a, idx, axis=axis), axis)
        self._from_groups(out)

    def rebuild(self, k, v, exact, gid, src, factor=None) -> None:
        """Replace the rows by k, v [B, H, n, D] quantized (`append`'s
        `factor`), except what is already quantized: values keep old row
        src[b, h, i] as it was where src < the old rows (quantized once, never
        twice), and keys keep old group gid[b, h, j] where exact[b, h, j] (its
        rows are exactly that group's, in order)."""
        T = self.rows
        old_rows = {n: getattr(self, n) for n in self.PER_TOKEN}
        old_groups = self._by_group() if T else None
        self._empty()
        if k.shape[2] == 0:
            return
        self.append(k, v, factor)
        if not T:
            return
        take = mx.minimum(src, T - 1)[..., None]
        from_old = (src < T)[..., None]
        for name in self.PER_TOKEN:
            kept = mx.take_along_axis(old_rows[name], take, axis=2)
            setattr(self, name, mx.where(from_old, kept, getattr(self, name)))
        gid = mx.minimum(gid, T // self.group - 1)
        out = {}
        for name, (a, axis) in self._by_group().items():
            if axis == 3:  # keys per channel: whole groups only
                o = old_groups[name][0]
                kept = mx.take_along_axis(o, gid[:, :, None, :, None], axis=3)
                out[name] = (mx.where(exact[:, :, None, :, None], kept, a), 3)
        self._from_groups(out)

    def truncate(self, rows: int) -> None:
        """Keep the first `rows` (a multiple of `group`)."""
        if rows == 0:
            self._empty()
            return
        T = self.rows
        for name in self.NAMES:
            a = getattr(self, name)
            if name in self.PER_TOKEN:
                setattr(self, name, a[:, :, :rows])
            else:  # the last axis is proportional to T
                setattr(self, name, a[..., : a.shape[-1] * rows // T])

    def arrays(self) -> list[mx.array]:
        return [a for a in (getattr(self, n) for n in self.NAMES) if a is not None]

    def state(self, prefix: str) -> dict:
        return {f"{prefix}.{n}": getattr(self, n) for n in self.NAMES if self.rows}

    def load(self, st: dict, prefix: str) -> None:
        for n in self.NAMES:
            setattr(self, n, st.get(f"{prefix}.{n}"))


def sinks_then_groups(n: int, sinks: int, group: int) -> int:
    """How many of n rows a store quantizes: up to `sinks` (held dense), then
    whole groups."""
    lead = min(n, sinks)
    return lead + (n - lead) // group * group


class QuantizedStore:
    """Quantized rows of every KV head (`QuantizedRows`). `signs` [H, D]: rows
    stored rotated (module doc); they and every read are unrotated here. The
    signs are state, not KV: `arrays()` (the bytes held) leaves them out.
    `sinks`: the first rows held dense (`sink_k`, `sink_v` [B, H, <= sinks,
    D]), before the quantized ones. `key_bits`: the keys' width (None: `bits`).
    `query_aware`: keys scaled by `key_scale` [B, H, D] before the rotation,
    set from `query_power` (the cache's mean squared queries) when the first
    group is quantized. `rounds`: keys rounded with error feedback by
    `key_factor` (`pack_factor`'s), set from `query_moment` (the second moment
    of the cache's post-RoPE queries to come, unrotated) at the first group."""

    def __init__(
        self,
        bits: int,
        group: int,
        signs=None,
        sinks: int = 0,
        key_bits: int | None = None,
        query_aware: bool = False,
        rounds: bool = False,
    ):
        self.bits, self.group, self.signs = bits, group, signs
        self.sinks, self.key_bits = sinks, key_bits
        self.query_aware, self.key_scale, self.query_power = query_aware, None, None
        self.rounds, self.key_factor, self.query_moment = rounds, None, None
        self.factor_step = None
        self.sink_k = self.sink_v = None
        self.part = QuantizedRows(bits, group, key_bits)

    @property
    def sink_rows(self) -> int:
        return 0 if self.sink_k is None else self.sink_k.shape[2]

    @property
    def rows(self) -> int:
        return self.sink_rows + self.part.rows

    def _sinks_missing(self) -> int:
        """Sinks still to take: only ahead of every quantized row (a store
        saved with fewer sinks than its options now ask keeps its own)."""
        return 0 if self.part.rows else max(0, self.sinks - self.sink_rows)

    def to_fill(self, n: int) -> int:
        """How many of n rows past the residual to add: the sinks still
        missing, then whole groups."""
        return sinks_then_groups(n, self._sinks_missing(), self.group)

    def append(self, k, v) -> None:
        """Add rows [B, H, n, D]: the sinks still missing first, then whole
        groups (`to_fill`)."""
        lead = min(k.shape[2], self._sinks_missing())
        if lead > 0:  # copied out: a slice would keep the whole call's rows alive
            self.sink_k = _cat(self.sink_k, mx.contiguous(k[:, :, :lead]), 2)
            self.sink_v = _cat(self.sink_v, mx.contiguous(v[:, :, :lead]), 2)
            k, v = k[:, :, lead:], v[:, :, lead:]
        if k.shape[2] == 0:
            return
        if self.signs is not None:
            k, v = self._keys_in(k), rotate(v, self.signs)
        self.part.append(k, v, self._factor(k))

    def _factor(self, k: mx.array):
        """The rounding factor (None: nearest rounding); with `rounds`, set
        from `query_moment` when not yet (the identity, nearest rounding, when
        no query was seen)."""
        if not self.rounds:
            return None
        B, H, _, D = k.shape
        if self.key_factor is None:
            if self.query_moment is None:
                self.key_factor = mx.zeros((B, H, D * (D - 1) // 2), mx.int8)
                self.factor_step = mx.ones((B, H, 1), mx.float32)
            else:
                u = rounding_factor(self._stored_moment(self.query_moment))
                self.key_factor, self.factor_step = pack_factor(u)
            self.query_moment = None
        return unpack_factor(self.key_factor, self.factor_step, D)

    def _stored_moment(self, m: mx.array) -> mx.array:
        """A second moment of unrotated queries, m [B, H, D, D], as the stored
        keys meet them: M^T S^-1 m S^-1 M, S the key scales, M the rotation."""
        m = m.astype(mx.float32)
        if self.key_scale is not None:
            inv = 1.0 / self.key_scale
            m = m * inv[..., :, None] * inv[..., None, :]
        if self.signs is None:
            return m
        return rotate(rotate(m, self.signs).swapaxes(-1, -2), self.signs)

    def _keys_in(self, k: mx.array) -> mx.array:
        """Unrotated keys [B, H, n, D] as stored: scaled (query-aware, the
        scales set from them when not yet), then rotated."""
        if self.query_aware:
            if self.key_scale is None:
                self.key_scale = key_scales(self.query_power, k, self.group)
                self.query_power = None
            k = (k * self.key_scale[:, :, None, :]).astype(k.dtype)
        return rotate(k, self.signs)

    def _queries_in(self, q: mx.array) -> mx.array:
        if self.key_scale is not None:
            q = (q / self.key_scale[:, :, None, :]).astype(q.dtype)
        return rotate(q, self.signs)

    def _keys_out(self, k: mx.array) -> mx.array:
        k = unrotate(k, self.signs)
        if self.key_scale is None:
            return k
        return (k / self.key_scale[:, :, None, :]).astype(k.dtype)

    def logits(self, q: mx.array) -> mx.array:
        sink = None if self.sink_k is None else q @ self.sink_k.swapaxes(-1, -2)
        if not self.part.rows:
            return sink
        if self.signs is not None:
            q = self._queries_in(q)
        out = self.part.logits(q)
        return out if sink is None else mx.concatenate([sink, out], axis=-1)

    def weighted(self, p: mx.array) -> mx.array:
        s = self.sink_rows
        sink = None if not s else p[..., :s] @ self.sink_v
        if not self.part.rows:
            return sink
        out = self.part.weighted(p[..., s:] if s else p)
        out = out if self.signs is None else unrotate(out, self.signs)
        return out if sink is None else sink + out.astype(sink.dtype)

    def dequantize(self, dtype):
        keys = values = None
        if self.part.rows:
            keys, values = self.part.dequantize(dtype)
            if self.signs is not None:
                keys = self._keys_out(keys)
                values = unrotate(values, self.signs)
        if self.sink_k is None:
            return keys, values
        sk, sv = self.sink_k.astype(dtype), self.sink_v.astype(dtype)
        if keys is None:
            return sk, sv
        return mx.concatenate([sk, keys], 2), mx.concatenate([sv, values], 2)

    def take_groups(self, gid) -> None:
        self._no_sinks()
        self.part.take_groups(gid)

    def _no_sinks(self) -> None:
        if self.sinks:  # only eviction regroups rows, and kivi never evicts
            raise ValueError("quantized rows with dense sinks cannot be regrouped")

    def rebuild(self, k, v, exact, gid, src) -> None:
        """The quantized rows replaced as `QuantizedRows.rebuild` does (`src`:
        the old quantized row of each new one, counted after the sinks); the
        sinks ahead of them stay."""
        if self.signs is not None and k.shape[2]:  # unrotated rows in, as `append`
            k, v = self._keys_in(k), rotate(v, self.signs)
        self.part.rebuild(k, v, exact, gid, src, self._factor(k))

    def kept_rows(self, n: int) -> int:
        """The rows `truncate` keeps to hold the first n: the sinks exactly,
        then whole groups."""
        s = self.sink_rows
        return n if n <= s else s + -(-(n - s) // self.group) * self.group

    def truncate(self, rows: int) -> None:
        """Keep the first `rows` (a `kept_rows` value)."""
        s = self.sink_rows
        if rows < s:
            self.sink_k, self.sink_v = (
                self.sink_k[:, :, :rows],
                self.sink_v[:, :, :rows],
            )
            if not rows:
                self.sink_k = self.sink_v = None
        self.part.truncate(max(0, rows - s))

    def clone(self) -> QuantizedStore:
        new = QuantizedStore(
            self.bits,
            self.group,
            self.signs,
            self.sinks,
            self.key_bits,
            self.query_aware,
            self.rounds,
        )
        new.key_scale, new.query_power = self.key_scale, self.query_power
        new.key_factor, new.query_moment = self.key_factor, self.query_moment
        new.factor_step = self.factor_step
        new.sink_k, new.sink_v = self.sink_k, self.sink_v
        new.part.load(self.part.state("p"), "p")
        return new

    def arrays(self) -> list[mx.array]:
        sink = [] if self.sink_k is None else [self.sink_k, self.sink_v]
        # the rounding factor is per sequence, D(D-1)/2 per head: counted as held
        factor = [a for a in (self.key_factor, self.factor_step) if a is not None]
        return sink + factor + self.part.arrays()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def state(self) -> dict:
        st = {"q.bits": mx.array([self.bits], dtype=mx.int32)}
        if self.signs is not None:
            st["q.signs"] = self.signs
        if self.key_bits is not None:  # absent: keys at the values' width
            st["q.key_bits"] = mx.array([self.key_bits], dtype=mx.int32)
        if self.key_scale is not None:
            st["q.key_scale"] = self.key_scale
        if self.key_factor is not None:
            st["q.key_factor"] = self.key_factor
        if self.factor_step is not None:  # absent: an fp16 triangle
            st["q.factor_step"] = self.factor_step
        if self.sink_k is not None:
            st["q.sink_k"], st["q.sink_v"] = self.sink_k, self.sink_v
        st.update(self.part.state(f"q{self.bits}"))
        return st

    @classmethod
    def from_state(
        cls,
        st: dict,
        group: int,
        sinks: int = 0,
        query_aware: bool = False,
        rounds: bool = False,
    ) -> QuantizedStore | None:
        if "q.bits" not in st:
            return None
        retired = [k for k in RETIRED_STATE if k in st]
        widths = set(st["q.bits"].tolist())  # files before KVQuant: one a head
        if retired or len(widths) != 1:
            found = retired or f"per-head widths {sorted(widths)}"
            raise ValueError(f"quantized rows saved with a retired option: {found}")
        bits = widths.pop()
        key_bits = int(st["q.key_bits"].item()) if "q.key_bits" in st else None
        store = cls(
            bits, group, st.get("q.signs"), sinks, key_bits, query_aware, rounds
        )
        store.key_scale = st.get("q.key_scale")
        store.key_factor = st.get("q.key_factor")
        store.factor_step = st.get("q.factor_step")  # absent: an fp16 triangle
        store.sink_k, store.sink_v = st.get("q.sink_k"), st.get("q.sink_v")
        if store.sink_rows > sinks:
            raise ValueError(
                f"the saved rows hold {store.sink_rows} dense sinks, these "
                f"options {sinks}"
            )
        store.part.load(st, f"q{bits}")
        return store


# state of quantization options KVQuant retired (token keys, grids, fp16
# scales, QJL, the query basis): a file holding them is refused, not misread
RETIRED_STATE = ("q.token_keys", "q.grid", "q.scales16", "q.qjl", "q.key_unmap")
