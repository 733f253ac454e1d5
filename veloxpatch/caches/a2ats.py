"""`a2ats` (He et al., 2025): windowed RoPE, a query-aware VQ codebook of keys,
and top-k retrieval at decode.

Windowed RoPE: query i scores key j with exact RoPE when i - j < w (near), and
as <rope(q_i, b), k_j> with the pre-RoPE key otherwise (far): every far key
sees the query rotated to one constant position b, so far keys need no position
and can share one codebook. The cache stores keys unrotated (`rotate` hook) and
rotates what it needs on the fly.

Prefill is dense. At decode each query head scores the far keys from their codes
(a lookup table of <q~, c> per centroid, `codebook=` file from `veloxpatch
calibrate --algo a2ats`; without one, from the keys themselves: the same
retrieval with exact far scores), keeps the top `top` fraction of the context,
takes the union over its GQA group plus `sinks` and the `window`, and attends
over that set only, with exact RoPE (windowed RoPE over the retrieved keys, the
other reading of the paper, lost: KL 0.142 against 0.047, docs/results.md).
A2ATS saves compute, not memory: it keeps every key and value, plus a code per
key.
"""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx

from ..errors import OptionError, UnsupportedModelError
from .base import VeloxCache
from .calibration_files import find, load_codebook
from .options import CacheOptions, check_int, check_number, check_path, option


def rope_at(rope, x: mx.array, positions: mx.array) -> mx.array:
    """x [B, H, R, D] with row r rotated to positions[b, h, r]."""
    B, H, R, D = x.shape
    flat = x.reshape(B * H * R, 1, 1, D)
    return rope(flat, offset=positions.reshape(-1).astype(mx.int32)).reshape(x.shape)


def rope_to(rope, q: mx.array, position: int) -> mx.array:
    """q [B, H, L, D] with every row rotated to the same `position` (a view with
    length 1 on the sequence axis: `rope(q, offset=b)` would rotate row i to b + i)."""
    B, H, L, D = q.shape
    return rope(q.reshape(B, H * L, 1, D), offset=position).reshape(q.shape)


RESCALING_ROPES = ("YarnRoPE", "SuScaledRoPE")  # scale their input (mscale)


def check_pure_rotation(rope, dims: int) -> None:
    """A2ATS needs RoPE to be a rotation (norms kept, position 0 the identity).
    YaRN-style ropes rescale their input (by 1 only for some settings), so they
    are refused by kind, and any other rope is checked numerically."""
    x = mx.random.normal((1, 1, 3, dims), key=mx.random.key(0))
    y = rope(x, offset=0)
    same = mx.allclose(y[:, :, 0], x[:, :, 0], atol=1e-5).item()
    norms = mx.allclose(mx.linalg.norm(y, axis=-1), mx.linalg.norm(x, axis=-1), 1e-4)
    if type(rope).__name__ in RESCALING_ROPES or not (same and norms.item()):
        raise UnsupportedModelError(
            f"a2ats needs a RoPE that is a pure rotation; {type(rope).__name__} also "
            "rescales its input (YaRN-style), so far keys cannot stay position-free"
        )


@dataclasses.dataclass
class A2ATSOptions(CacheOptions):
    """`window` (w): newest keys scored with exact RoPE. `far_position` (b): the
    position far keys see the query at. `sinks`: first keys always attended.
    `top`: fraction of the context each query head retrieves at decode.
    `codebook`: file from `veloxpatch calibrate --algo a2ats` (None: this
    model's in the calibration cache, if any, calibrated at this b)."""

    window: int = option(64, check_int, 1)
    # int32 positions
    far_position: int = option(2048, check_int, 0, 2**31 - 1)
    sinks: int = option(8, check_int, 0)
    top: float = option(0.03, check_number, 0, 1, lo_open=True)
    codebook: str | None = option(None, check_path)

    def __post_init__(self):
        super().__post_init__()
        self.loaded = None  # per layer codebook, once bound to a model

    def bind(self, model, dims):
        for rope, d, sliding in zip(dims.ropes, dims.head_dims, dims.sliding):
            if not sliding:
                check_pure_rotation(rope, d)
        far = self.far_position
        if self.codebook is not None:
            self.loaded = load_codebook(self.codebook, far, dims)
        else:  # this model's file in the calibration cache, if there is one
            found = find("a2ats", dims, lambda p: load_codebook(p, far, dims))
            if found is not None:
                self.codebook, self.loaded = found
        return super().bind(model, dims)


def assign(keys: mx.array, book: dict) -> mx.array:
    """Codes [B, Hkv, L] (uint16) of pre-RoPE keys [B, Hkv, L, D]: the nearest
    centroid after the query-aware transform, argmin |k L - c'|."""
    kt = keys.astype(mx.float32) @ book["transform"]  # [B, Hkv, L, D]
    dist = book["tnorm2"][:, None, :] - 2 * (kt @ book["tcentroids"].swapaxes(-1, -2))
    return mx.argmin(dist, axis=-1).astype(mx.uint16)


class A2ATSCache(VeloxCache):
    name = "a2ats"
    row_arrays = ("codes",)  # [B, Hkv, rows] each row's centroid
    batchable = True  # one cache per sequence (caches/batch.py)
    summary = "windowed RoPE + query-aware VQ codes; decode attends the top 3% only"
    note = (
        "keeps every key (saves compute, not memory); codebook=FILE from "
        "`veloxpatch calibrate --algo a2ats`, else far scores are exact."
    )
    Options = A2ATSOptions

    def __init__(self, options=None, layer=0, num_layers=1):
        super().__init__(options, layer, num_layers)
        self.codes = None  # [B, Hkv, T] uint16, with a codebook
        self.decoding = False  # the prompt has ended: retrieve
        self._rope = None
        self._q_far = None  # the call's queries rotated to b (times any scale)
        # this layer's codebook: from the bound options, or from a saved state
        loaded = self.options.loaded
        self.book = None if loaded is None else loaded[layer]

    def rotate(self, q, k, rope, offset, query_scale):
        self._rope = rope
        q_far = rope_to(rope, q, self.options.far_position)
        q = rope(q, offset=offset)
        if query_scale is not None:
            q, q_far = q * query_scale, q_far * query_scale
        self._q_far = q_far
        return q, k  # keys are stored pre-RoPE

    def _append(self, k, v, offset):
        if self.options.codebook is not None and self.book is None:
            raise OptionError("a2ats: the codebook file was not loaded for a model")
        out = super()._append(k, v, offset)
        if self.book is not None:
            new = assign(k, self.book)
            self.codes = (
                new if self.codes is None else mx.concatenate([self.codes, new], 2)
            )
        return out

    def end_prompt(self):
        self.decoding = True

    # ---- attention ----------------------------------------------------------------
    def attention(self, q, keys, values, mask, scale):
        try:
            return self._attention(q, keys, values, mask, scale)
        finally:
            self._q_far = None  # the call's own: not held between calls

    def _attention(self, q, keys, values, mask, scale):
        o, T = self.options, keys.shape[2]
        if q.shape[2] == 1 and self.decoding and T - o.window > o.sinks:
            return self._retrieved(q, keys, values, scale)
        # rows are positions 0..T-1: one rope call
        k_near = self._rope(keys, offset=0)
        return mx.fast.scaled_dot_product_attention(
            q, k_near, values, scale=scale, mask=mask
        )

    def _attend(self, q, k_near, values, valid, scale):
        """Attention of the decode query over the retrieved keys k_near (RoPE
        at their positions); `valid` [B, Hkv, R] hides duplicates."""
        B, Hq, L, D = q.shape
        Hkv = k_near.shape[1]
        G = Hq // Hkv
        qg = q.reshape(B, Hkv, G, L, D).astype(mx.float32)
        logits = qg @ k_near[:, :, None].astype(mx.float32).swapaxes(-1, -2)
        logits = mx.where(valid[:, :, None, None, :], logits * scale, -mx.inf)
        p = mx.softmax(logits, axis=-1)
        out = p @ values[:, :, None].astype(mx.float32)  # [B, Hkv, G, L, D]
        return out.reshape(B, Hq, L, -1).astype(q.dtype)

    def far_scores(self, keys) -> mx.array:
        """Approximate far scores [B, Hkv, G, F] of the decode query over rows
        sinks .. T - window - 1: <q~, c> looked up by code, or exact <q~, k>."""
        o = self.options
        B, Hkv, T, D = keys.shape
        G = self._q_far.shape[1] // Hkv
        qf = self._q_far.reshape(B, Hkv, G, D).astype(mx.float32)
        end = T - o.window
        if self.book is None:
            return qf @ keys[:, :, o.sinks : end].astype(mx.float32).swapaxes(-1, -2)
        lut = qf @ self.book["centroids"].swapaxes(-1, -2)  # [B, Hkv, G, C]
        codes = self.codes[:, :, None, o.sinks : end].astype(mx.int32)
        return mx.take_along_axis(
            lut, mx.broadcast_to(codes, (B, Hkv, G, end - o.sinks)), -1
        )

    def retrieve(self, keys) -> tuple[mx.array, mx.array]:
        """Rows [B, Hkv, R] to attend (sinks, the union over the group of each
        query head's top far rows, the window) and which are not duplicates."""
        o = self.options
        B, Hkv, T, _ = keys.shape
        scores = self.far_scores(keys)
        G, F = scores.shape[2], scores.shape[3]
        k = min(F, max(1, math.ceil(o.top * T)))
        top = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
        picked = mx.sort(top.reshape(B, Hkv, G * k).astype(mx.int32), axis=-1) + o.sinks
        dup = picked[..., 1:] == picked[..., :-1]
        sinks = mx.broadcast_to(mx.arange(o.sinks, dtype=mx.int32), (B, Hkv, o.sinks))
        near = mx.broadcast_to(
            mx.arange(T - o.window, T, dtype=mx.int32), (B, Hkv, o.window)
        )
        rows = mx.concatenate([sinks, picked, near], axis=-1)
        valid = mx.concatenate(
            [
                mx.ones((B, Hkv, o.sinks + 1), mx.bool_),
                ~dup,
                mx.ones((B, Hkv, o.window), mx.bool_),
            ],
            axis=-1,
        )
        return rows, valid

    def _retrieved(self, q, keys, values, scale):
        rows, valid = self.retrieve(keys)
        k_sel = mx.take_along_axis(keys, rows[..., None], axis=2)
        v_sel = mx.take_along_axis(values, rows[..., None], axis=2)
        k_near = rope_at(self._rope, k_sel, rows)
        return self._attend(q, k_near, v_sel, valid, scale)

    # ---- contract -----------------------------------------------------------------
    def extra_state(self):
        # the codebook travels with the codes, so a loaded cache needs no model
        book = {f"book.{k}": v for k, v in (self.book or {}).items()}
        return super().extra_state() | book

    def load_extra_state(self, st):
        super().load_extra_state(st)
        book = {k[5:]: v for k, v in st.items() if k.startswith("book.")}
        self.book = book or self.book

    def extra_meta(self):
        return {"decoding": self.decoding}

    def load_extra_meta(self, m):
        self.decoding = bool(m.get("decoding", False))
