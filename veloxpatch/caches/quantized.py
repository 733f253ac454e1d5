"""Quantized rows on mlx's kernels: the storage behind `kivi` and `kv_bits=`.

Keys are stored transposed, K^T [B, H, D, T], and quantized along T in groups
of `group` tokens: one scale and bias per channel and group of tokens, KIVI's
per-channel keys (`kv_keys="token"`: as values, per token along D, read with
quantized_matmul(q, K_w, ..., transpose=True), as mlx-lm's cache and TurboQuant
do). Values [B, H, T, D] are quantized along D in groups of `group`
channels, per token. Both are mlx's packed affine layout (codes as a
little-endian bit stream in uint32 words, scales and biases in the model's
dtype), so attention never dequantizes:

    q . K^T = quantized_matmul(q, Kt_w, Kt_s, Kt_b, transpose=False)
    p . V   = quantized_matmul(p, V_w, V_s, V_b, transpose=False)

(the second is how mlx-lm's quantized attention reads values). Rows are added
in whole groups; a group of keys shares its scales, so rows are never taken out
one by one: whole groups are gathered per head (`take_groups`), anything else is
requantized (`rebuild`).

Which grid: `QUANTIZER` "mlx" is `mx.quantize` (affine, its grid snapped so
that 0 is exact); "minmax" is the paper's asymmetric min/max grid (scale
(max - min) / (2^bits - 1), zero point min) packed in the same layout. Both
run on the same kernels; scripts/quantizer_kl.py compares them on SmolLM2.

Rotation (`kv_rotate="hadamard"`, TurboQuant / QuaRot): each head's keys and
values are stored as x M, M = diag(signs) H / sqrt(D) (random signs per head and
channel, H the Hadamard matrix): an orthogonal map that spreads outlier channels
over every coordinate before quantizing. q . k = (q M) . (k M), so a query is
rotated once before the key kernel, and p . (V M) M^T gives the output: the
store still never dequantizes, and everything outside it (scores, eviction,
dequantized copies) sees unrotated rows.
"""

from __future__ import annotations

import mlx.core as mx

QUANTIZER = "minmax"


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


def minmax_quantize(x: mx.array, group: int, bits: int):
    """The paper's grid in mlx's layout: (words, scales, biases) along the last
    axis, scales and biases in x's dtype."""
    *lead, n = x.shape
    g = x.astype(mx.float32).reshape(*lead, n // group, group)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    scales = ((hi - lo) / (2**bits - 1)).astype(x.dtype)
    biases = lo.astype(x.dtype)
    s = mx.maximum(scales.astype(mx.float32), 1e-12)  # a constant group: code 0
    codes = mx.round((g - biases.astype(mx.float32)) / s)
    codes = mx.clip(codes, 0, 2**bits - 1).astype(mx.uint32).reshape(*lead, n)
    return pack(codes, bits), scales[..., 0], biases[..., 0]


def quantize(x: mx.array, group: int, bits: int):
    """(words, scales, biases) of x along its last axis, groups of `group`."""
    if QUANTIZER == "minmax":
        return minmax_quantize(x, group, bits)
    return mx.quantize(x, group_size=group, bits=bits)


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


def _cat(old, new, axis):
    return new if old is None else mx.concatenate([old, new], axis=axis)


class QuantizedRows:
    """Quantized rows of heads sharing one width, [B, H, ...].

    Keys per channel (KIVI): `kw` [B, H, D, T/32*bits], `ks`, `kb` [B, H, D,
    T/group]; per token (`keys="token"`, as values and mlx-lm's cache): `kw`
    [B, H, T, D/32*bits], `ks`, `kb` [B, H, T, D/group].
    Values: `vw` [B, H, T, D/32*bits], `vs`, `vb` [B, H, T, D/group]."""

    NAMES = ("kw", "ks", "kb", "vw", "vs", "vb")

    def __init__(self, bits: int, group: int, keys: str = "channel"):
        self.bits, self.group, self.keys = bits, group, keys
        for name in self.NAMES:
            setattr(self, name, None)

    def _per_token(self) -> tuple[str, ...]:
        """The arrays stored a row per token: [B, H, T, ...]."""
        return self.NAMES if self.keys == "token" else self.NAMES[3:]

    @property
    def rows(self) -> int:
        return 0 if self.vw is None else self.vw.shape[2]

    def _qmm(self, x, w, s, b, transpose=False):
        return mx.quantized_matmul(
            x, w, s, b, transpose=transpose, group_size=self.group, bits=self.bits
        )

    def append(self, k: mx.array, v: mx.array) -> None:
        """Quantize and add rows [B, H, n, D]; n is a multiple of `group`."""
        token = self.keys == "token"
        kw, ks, kb = quantize(k if token else k.swapaxes(-1, -2), self.group, self.bits)
        vw, vs, vb = quantize(v, self.group, self.bits)
        new = dict(kw=kw, ks=ks, kb=kb, vw=vw, vs=vs, vb=vb)
        rows = self._per_token()
        for name, a in new.items():
            setattr(self, name, _cat(getattr(self, name), a, 2 if name in rows else -1))

    def logits(self, q: mx.array) -> mx.array:
        """q [B, H, M, D] . K^T -> [B, H, M, T]."""
        return self._qmm(q, self.kw, self.ks, self.kb, transpose=self.keys == "token")

    def weighted(self, p: mx.array) -> mx.array:
        """p [B, H, M, T] . V -> [B, H, M, D]."""
        return self._qmm(p, self.vw, self.vs, self.vb)

    def dequantize(self, dtype) -> tuple[mx.array, mx.array]:
        """Keys and values [B, H, T, D] in `dtype` (computed, never stored)."""
        g, b = self.group, self.bits
        keys = mx.dequantize(self.kw, self.ks, self.kb, group_size=g, bits=b)
        values = mx.dequantize(self.vw, self.vs, self.vb, group_size=g, bits=b)
        if self.keys != "token":
            keys = keys.swapaxes(-1, -2)
        return keys.astype(dtype), values.astype(dtype)

    def _by_group(self):
        """Every array with its groups of rows on one axis: name -> (array
        reshaped [B, H, ..., G, per-group], axis of G)."""
        B, H, T = *self.vw.shape[:2], self.rows
        G = T // self.group
        out = {}
        rows = self._per_token()
        for name in self.NAMES:
            a = getattr(self, name)
            if name in rows:  # [B, H, T, x] -> [B, H, G, group*x]
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

    def rebuild(self, k, v, exact: mx.array, gid: mx.array) -> None:
        """Replace the rows by k, v [B, H, n, D] quantized, except that group j
        of head h is the old group gid[b, h, j] unchanged where exact[b, h, j]
        (its rows are exactly that group's, in order)."""
        old = self._by_group() if self.vw is not None else None
        self.__init__(self.bits, self.group, self.keys)
        if k.shape[2] == 0:
            return
        self.append(k, v)
        if old is None:
            return
        new = self._by_group()
        gid = mx.minimum(gid, old["vw"][0].shape[2] - 1)
        out = {}
        for name, (a, axis) in new.items():
            o = old[name][0]
            if axis == 3:
                kept = mx.take_along_axis(o, gid[:, :, None, :, None], axis=3)
                out[name] = (mx.where(exact[:, :, None, :, None], kept, a), 3)
            else:
                kept = mx.take_along_axis(o, gid[..., None], axis=2)
                out[name] = (mx.where(exact[..., None], kept, a), 2)
        self._from_groups(out)

    def truncate(self, rows: int) -> None:
        """Keep the first `rows` (a multiple of `group`)."""
        if rows == 0:
            self.__init__(self.bits, self.group, self.keys)
            return
        T = self.rows
        for name in self.NAMES:
            a = getattr(self, name)
            if name in self._per_token():
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


class QuantizedStore:
    """Quantized rows of every KV head, each head at its own width (`bits`, one
    per head): heads of one width are stored together, and what attention
    reads is put back in head order. `signs` [H, D]: rows stored rotated (module
    doc); they and every read are unrotated here. The signs are state, not KV:
    `arrays()` (the bytes held) leaves them out."""

    def __init__(
        self, bits: tuple[int, ...], group: int, signs=None, keys: str = "channel"
    ):
        self.bits, self.group, self.signs, self.keys = tuple(bits), group, signs, keys
        self.widths = sorted(set(self.bits))
        self.heads = [
            [h for h, b in enumerate(self.bits) if b == w] for w in self.widths
        ]
        self.parts = [QuantizedRows(w, group, keys) for w in self.widths]
        order = [h for heads in self.heads for h in heads]
        self.inverse = None
        if order != list(range(len(order))):
            self.inverse = mx.array([order.index(h) for h in range(len(order))])

    @property
    def rows(self) -> int:
        return self.parts[0].rows

    def _split(self, x: mx.array):
        if len(self.parts) == 1:
            return [x]
        return [x[:, mx.array(heads)] for heads in self.heads]

    def _join(self, xs: list) -> mx.array:
        if len(xs) == 1:
            return xs[0]
        x = mx.concatenate(xs, axis=1)
        return x if self.inverse is None else x[:, self.inverse]

    def append(self, k, v) -> None:
        if self.signs is not None:
            k, v = rotate(k, self.signs), rotate(v, self.signs)
        for part, kh, vh in zip(self.parts, self._split(k), self._split(v)):
            part.append(kh, vh)

    def logits(self, q: mx.array) -> mx.array:
        if self.signs is not None:
            q = rotate(q, self.signs)
        return self._join([p.logits(qh) for p, qh in zip(self.parts, self._split(q))])

    def weighted(self, p: mx.array) -> mx.array:
        parts = zip(self.parts, self._split(p))
        out = self._join([part.weighted(ph) for part, ph in parts])
        return out if self.signs is None else unrotate(out, self.signs)

    def dequantize(self, dtype):
        pairs = [part.dequantize(dtype) for part in self.parts]
        keys, values = (
            self._join([k for k, _ in pairs]),
            self._join([v for _, v in pairs]),
        )
        if self.signs is not None:
            keys, values = unrotate(keys, self.signs), unrotate(values, self.signs)
        return keys, values

    def take_groups(self, gid) -> None:
        for part, g in zip(self.parts, self._split(gid)):
            part.take_groups(g)

    def rebuild(self, k, v, exact, gid) -> None:
        split = zip(self.parts, *(self._split(x) for x in (k, v, exact, gid)))
        for part, kh, vh, eh, gh in split:
            part.rebuild(kh, vh, eh, gh)

    def truncate(self, rows: int) -> None:
        for part in self.parts:
            part.truncate(rows)

    def clone(self) -> QuantizedStore:
        new = QuantizedStore(self.bits, self.group, self.signs, self.keys)
        for src, dst in zip(self.parts, new.parts):
            dst.load(src.state("p"), "p")
        return new

    def arrays(self) -> list[mx.array]:
        return [a for part in self.parts for a in part.arrays()]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def state(self) -> dict:
        st = {"q.bits": mx.array(self.bits, dtype=mx.int32)}
        if self.signs is not None:
            st["q.signs"] = self.signs
        if self.keys == "token":  # absent: per channel, as files before it
            st["q.token_keys"] = mx.array([1], dtype=mx.int32)
        for w, part in zip(self.widths, self.parts):
            st.update(part.state(f"q{w}"))
        return st

    @classmethod
    def from_state(cls, st: dict, group: int) -> QuantizedStore | None:
        if "q.bits" not in st:
            return None
        keys = "token" if "q.token_keys" in st else "channel"
        store = cls(tuple(st["q.bits"].tolist()), group, st.get("q.signs"), keys)
        for w, part in zip(store.widths, store.parts):
            part.load(st, f"q{w}")
        return store
