"""KIVI-style quantized rows: the storage behind `kivi` and `kv_bits=`.

Asymmetric min/max quantization (Liu et al., 2024): one scale and one zero point
per group (fp16), code = round((x - zero) / scale), codes packed as bit planes
(`bits` uint32 words per 32 values, so 3 bits packs as tightly as 2 or 4).

Keys are quantized per channel: each channel of each run of `group` rows shares
a scale. Values are quantized per row, in groups of `group` channels. Every row
stores its own packed codes, and a key row refers to its group's scale by index,
so rows can be evicted one by one without requantizing what stays: a row keeps
its codes and its group's scale for as long as it is held.
"""

from __future__ import annotations

import mlx.core as mx

_SHIFTS = mx.arange(32, dtype=mx.uint32)


def pack(codes: mx.array, bits: int) -> mx.array:
    """uint32 codes [..., n] (n a multiple of 32) -> bit planes [..., n/32*bits]."""
    *lead, n = codes.shape
    words = codes.reshape(*lead, n // 32, 32)
    planes = [(((words >> j) & 1) << _SHIFTS).sum(-1) for j in range(bits)]
    return mx.stack(planes, axis=-1).astype(mx.uint32).reshape(*lead, n // 32 * bits)


def unpack(packed: mx.array, bits: int) -> mx.array:
    """The inverse of `pack`: uint32 codes [..., n]."""
    *lead, words = packed.shape
    planes = packed.reshape(*lead, words // bits, bits)
    codes = sum(((planes[..., j : j + 1] >> _SHIFTS) & 1) << j for j in range(bits))
    return codes.reshape(*lead, words // bits * 32)


def minmax(x: mx.array, axis: int, bits: int) -> tuple:
    """(codes uint32, scales, zeros) of x, one group along `axis` (kept as size 1
    in scales and zeros, which are fp16)."""
    x = x.astype(mx.float32)
    lo, hi = x.min(axis, keepdims=True), x.max(axis, keepdims=True)
    zeros = lo.astype(mx.float16)
    scales = ((hi - lo) / (2**bits - 1)).astype(mx.float16)
    s = mx.maximum(scales.astype(mx.float32), 1e-8)  # a constant group: code 0
    codes = mx.round((x - zeros.astype(mx.float32)) / s)
    return mx.clip(codes, 0, 2**bits - 1).astype(mx.uint32), scales, zeros


def _affine(codes, scales, zeros):
    return codes.astype(mx.float32) * scales.astype(mx.float32) + zeros.astype(
        mx.float32
    )


class QuantizedRows:
    """Quantized keys and values of heads sharing one width: [B, H, T, ...].

    Keys: `kcodes` [B, H, T, D/32*bits], scales and zeros `kscale`, `kzero`
    [B, H, G, D], and `kgroup` [B, H, T] (the group of each row; None while row t
    is in group t // group). Values: `vcodes` like keys, `vscale`, `vzero`
    [B, H, T, D/group]."""

    NAMES = ("kcodes", "kscale", "kzero", "kgroup", "vcodes", "vscale", "vzero")

    def __init__(self, bits: int, group: int):
        self.bits, self.group = bits, group
        for name in self.NAMES:
            setattr(self, name, None)

    @property
    def rows(self) -> int:
        return 0 if self.kcodes is None else self.kcodes.shape[2]

    def append(self, k: mx.array, v: mx.array) -> None:
        """Quantize and add rows [B, H, n, D]; n is a multiple of `group`."""
        B, H, n, D = k.shape
        g, bits = self.group, self.bits
        codes, ks, kz = minmax(k.reshape(B, H, n // g, g, D), 3, bits)
        kcodes = pack(codes.reshape(B, H, n, D), bits)
        codes, vs, vz = minmax(v.reshape(B, H, n, D // g, g), 4, bits)
        vcodes = pack(codes.reshape(B, H, n, D), bits)
        new = dict(kcodes=kcodes, kscale=ks[:, :, :, 0], kzero=kz[:, :, :, 0])
        new.update(vcodes=vcodes, vscale=vs[..., 0], vzero=vz[..., 0])
        if self.kgroup is not None:
            first = self.kscale.shape[2]
            ids = first + mx.arange(n, dtype=mx.int32) // g
            new["kgroup"] = mx.broadcast_to(ids, (B, H, n))
        for name, value in new.items():
            old = getattr(self, name)
            axis = 2
            setattr(
                self, name, value if old is None else mx.concatenate([old, value], axis)
            )

    def _groups(self) -> mx.array:
        if self.kgroup is not None:
            return self.kgroup
        B, H, T = self.kcodes.shape[:3]
        ids = mx.arange(T, dtype=mx.int32) // self.group
        return mx.broadcast_to(ids, (B, H, T))

    def dequantize(self, dtype) -> tuple[mx.array, mx.array]:
        """Keys and values [B, H, T, D] in `dtype` (computed, never stored)."""
        B, H, T, _ = self.kcodes.shape
        kc = unpack(self.kcodes, self.bits)
        D = kc.shape[-1]
        if self.kgroup is None:
            ks = mx.repeat(self.kscale, self.group, axis=2)[:, :, :T]
            kz = mx.repeat(self.kzero, self.group, axis=2)[:, :, :T]
        else:
            idx = self.kgroup[..., None]
            ks = mx.take_along_axis(self.kscale, idx, axis=2)
            kz = mx.take_along_axis(self.kzero, idx, axis=2)
        keys = _affine(kc, ks, kz)
        vc = unpack(self.vcodes, self.bits).reshape(B, H, T, D // self.group, -1)
        values = _affine(vc, self.vscale[..., None], self.vzero[..., None])
        return keys.astype(dtype), values.reshape(B, H, T, D).astype(dtype)

    def take(self, idx: mx.array) -> None:
        """Keep rows idx [B, H, K] of every head, in that order."""
        if idx.shape[2] == 0:
            self.__init__(self.bits, self.group)
            return
        groups = mx.take_along_axis(self._groups(), idx, axis=2)
        for name in ("kcodes", "vcodes", "vscale", "vzero"):
            setattr(
                self,
                name,
                mx.take_along_axis(getattr(self, name), idx[..., None], axis=2),
            )
        self.kgroup = groups
        used_bound = 2 * (-(-idx.shape[2] // self.group)) + 1
        if self.kscale.shape[2] > used_bound:
            self._drop_unused_groups()

    def _drop_unused_groups(self) -> None:
        """Forget key groups no row refers to any more (one host sync, only once
        the table is more than twice what the rows could need)."""
        G = self.kscale.shape[2]
        used = mx.zeros((G,), mx.int32).at[self.kgroup.reshape(-1)].add(1) > 0
        keep = [g for g, u in enumerate(used.tolist()) if u]
        if len(keep) == G:
            return
        remap = mx.cumsum(used.astype(mx.int32)) - 1
        self.kgroup = remap[self.kgroup]
        keep = mx.array(keep, dtype=mx.int32)
        self.kscale, self.kzero = self.kscale[:, :, keep], self.kzero[:, :, keep]

    def arrays(self) -> list[mx.array]:
        return [a for a in (getattr(self, n) for n in self.NAMES) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def state(self, prefix: str) -> dict:
        return {
            f"{prefix}.{n}": getattr(self, n)
            for n in self.NAMES
            if getattr(self, n) is not None
        }

    def load(self, st: dict, prefix: str) -> None:
        for n in self.NAMES:
            setattr(self, n, st.get(f"{prefix}.{n}"))


class QuantizedStore:
    """Quantized rows of every KV head, each head at its own width (`bits`, one
    per head): heads of one width are stored together and dequantized back into
    head order."""

    def __init__(self, bits: tuple[int, ...], group: int):
        self.bits, self.group = tuple(bits), group
        self.widths = sorted(set(self.bits))
        self.heads = [
            [h for h, b in enumerate(self.bits) if b == w] for w in self.widths
        ]
        self.parts = [QuantizedRows(w, group) for w in self.widths]
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

    def append(self, k, v) -> None:
        for part, kh, vh in zip(self.parts, self._split(k), self._split(v)):
            part.append(kh, vh)

    def dequantize(self, dtype):
        pairs = [part.dequantize(dtype) for part in self.parts]
        if len(pairs) == 1:
            return pairs[0]
        keys = mx.concatenate([p[0] for p in pairs], axis=1)
        values = mx.concatenate([p[1] for p in pairs], axis=1)
        if self.inverse is None:  # heads already in order
            return keys, values
        return keys[:, self.inverse], values[:, self.inverse]

    def take(self, idx) -> None:
        for part, ih in zip(self.parts, self._split(idx)):
            part.take(ih)

    def clone(self) -> QuantizedStore:
        new = QuantizedStore(self.bits, self.group)
        for src, dst in zip(self.parts, new.parts):
            dst.load(src.state("p"), "p")
        return new

    def arrays(self) -> list[mx.array]:
        return [a for part in self.parts for a in part.arrays()]

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def state(self) -> dict:
        st = {"q.bits": mx.array(self.bits, dtype=mx.int32)}
        for w, part in zip(self.widths, self.parts):
            st.update(part.state(f"q{w}"))
        return st

    @classmethod
    def from_state(cls, st: dict, group: int) -> QuantizedStore | None:
        if "q.bits" not in st:
            return None
        store = cls(tuple(st["q.bits"].tolist()), group)
        for w, part in zip(store.widths, store.parts):
            part.load(st, f"q{w}")
        return store
