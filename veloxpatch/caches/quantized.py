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

Which grid (`kv_grid`): "minmax" (the default) is the paper's asymmetric
min/max grid (scale (max - min) / (2^bits - 1), zero point min); "mlx" is
`mx.quantize` (affine, its grid snapped so that 0 is exact); "gaussian" is
TurboQuant's scalar quantizer as mlx's kernels can read it: after a rotation
each coordinate is close to Gaussian, so each group is quantized on the
MSE-optimal uniform grid of a Gaussian with the group's mean and standard
deviation (TurboQuant's Lloyd-Max levels are not uniform, which the affine
kernels cannot express; the uniform grid's error is within 1.1% of theirs at
2 bits, 8% at 3, `gaussian_step`). The three share one layout and kernels.
"mxfp4" is mlx's microscaling 4-bit float (e2m1 codes, one shared 8-bit
exponent per 32 values, no bias), read by the same kernels in its mode.
scripts/studies/quantizer_kl.py compares them on SmolLM2.

TurboQuant's 1-bit residual (`kv_qjl`, keys per token): a key is quantized on
bits - 1 bits, and its residual r = k - k_hat is sketched by QJL, the signs of
r S^T for a Gaussian S [D, D] (seeded per layer, saved with the state), each
key's signs read as ±alpha with alpha = sqrt(pi / 2) / D x |r|. Stored as mlx's
1-bit affine codes (scale 2 alpha, bias -alpha, one group per row), so

    q . k ~ quantized_matmul(q, K_w, ...) + quantized_matmul(q S^T, R_w, ...)

with the residual's term unbiased (E[S^T sign(S r)] = D sqrt(2 / pi) r / |r|):
two kernel calls, no dequantizing. What reads rows gets k_hat + alpha signs S,
whose dot product with q is the same estimate. Values keep all `bits`.

Rotation (`kv_rotate="hadamard"`, TurboQuant / QuaRot): each head's keys and
values are stored as x M, M = diag(signs) H / sqrt(D) (random signs per head and
channel, H the Hadamard matrix): an orthogonal map that spreads outlier channels
over every coordinate before quantizing. q . k = (q M) . (k M), so a query is
rotated once before the key kernel, and p . (V M) M^T gives the output: the
store still never dequantizes, and everything outside it (scores, eviction,
dequantized copies) sees unrotated rows.

Query-aware scaling (`kv_rotate="query"`): keys are scaled per channel by s
before the rotation, x (s * k) M, and queries by 1 / s, so q . k is unchanged.
The rounding error of rotated keys is spread evenly over channels, while a
logit's error weighs channel c by E[q_c^2]: s_c = (E[q_c^2] / var_c)^(1/4), var_c
the channel's spread within its key groups, minimises E[(q . (k - k_hat))^2]
over such scalings (Cauchy-Schwarz; with no scaling the error is
sum(var) x sum(E q^2)). `key_scales` takes E[q_c^2] from the queries the
cache saw before its first group was quantized (the prompt's own) and var_c
from that group's rows; fixed from then on and saved with the state.

Query basis (`kv_rotate="query_basis"`): scaling channels only reaches the
channels' own axes; the keys' spread C (within their groups) and the queries'
moment H are ellipsoids along other axes. Keys are stored as k A^T M, queries
as q A^-1 M: A = L^1/4 V^T C^-1/2 with V L V^T = C^1/2 H C^1/2, so that A C
A^T = A^-T H A^-1 = L^1/2, and the logit error after the Hadamard rotation,
tr(A C A^T) tr(A^-T H A^-1) / D = (sum sqrt(l))^2 / D, is the least any linear
map reaches (Cauchy-Schwarz on the joint eigenvalues; scaling channels reaches
(sum_c sqrt(C_cc H_cc))^2 / D). H is kv_round's moment (below), C the first
quantized rows'. Each eigenvector's sign is fixed (its largest entry
positive): LAPACK's flips with float rounding, and the rotation after the
map would round a flipped coordinate differently. A^-1 is fixed then, saved
with the state and counted in the bytes held, on 8 bits with a step a column
(4.3 KB a KV head at D 64); keys are mapped by the inverse of A^-1 as
stored, so q . k stays exact and only the basis is rounded. On SmolLM2's keys
the 2-bit attention KL of the next 256 queries falls by a fifth against the
scaling, with and without the rounding (`scripts/studies/key_basis_study.py`).

Rounding for the queries (`rounds`, kv_round="query"): nearest rounding
spreads a key's error evenly, but a logit sees q . e, and queries look along
few directions. With H = E[q q^T] of the queries to come (as stored: scaled
and rotated), each key is rounded channel by channel on its group's grid and
each error is fed forward to the key's later channels by GPTQ's rule (Frantar
et al., 2023; U the upper Cholesky factor of H^-1): e^T H e, the expected
squared logit error, is what the feedback keeps small. H is the prompt's own
pre-RoPE queries' second moment (every query seen before the first group is
quantized), moved by the layer's rope to each of the next `FUTURE_QUERIES`
positions and averaged (`future_moment`): post-RoPE queries turn with their
position, so the prompt's queries at their own positions would weigh the
wrong directions of the slow-turning channels. U [B, H, D, D] is fixed from
then on, saved with the state and counted in the bytes held: its rows over
their diagonal, the strict upper triangle on 8 bits with one step a head
(`pack_factor`: 2,020 bytes a KV head at D 64, as much as 32 rows of 2-bit
keys and values with fp32 scales). The codes stay on the group's grid: the
kernels and the layout are unchanged.

Sinks (`sinks=N`, kivi's `kv_sinks`): the store's first N rows (the first
tokens, where attention sinks its surplus) are held dense and unrotated ahead of
the quantized groups. Their keys are outliers that take a group's scale, and
every query reads them: at 2 bits keeping them dense halves SmolLM2's
continuation KL for 1/2000 of the rows (docs/results.md).

Debiased logits (`debias`, kivi's and `kv_bits`' `kv_debias`): a rounded key
k_hat = k + e puts noise q . e on its logit, and E exp(x + n) = exp(x)
exp(var(n) / 2): the softmax's sum over many quantized rows is inflated
against exact ones (sinks, residual) and groups of wide steps against narrow
ones. Rounding to a step s is close to uniform error, variance s^2 / 12 per
coordinate, so attention subtracts sum_c q_c^2 s_c^2 / 24 from each quantized
row's logit (`noise`, the steps already stored: one small matmul of squared
queries by squared scales; a dense read appends it as channels,
`noise_channels`). The uniform model fits rotated rows, whose
coordinates are near Gaussian; unrotated channels with outliers round
unevenly. Scoring reads the logits undebiased.

Key width (`key_bits`, kivi's `key_bits` and `kv_key_bits`): keys at another
width than values, as llama.cpp's separate key and value cache types. Keys and
values already sit in their own arrays and kernel calls, so only the width
passed differs; at 2 bits SmolLM2's keys carry most of the continuation's KL.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

# the code of each grid in a saved cache's state (absent: minmax)
GRID_CODES = {"minmax": 0, "mlx": 1, "gaussian": 2, "mxfp4": 3}


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


@functools.cache
def gaussian_step(bits: int) -> float:
    """The step, in standard deviations, of the b-bit uniform quantizer (levels
    symmetric about the mean, outer cells unbounded) of least mean squared error
    on a Gaussian: 0.9957 at 2 bits, 0.5860 at 3, 0.3352 at 4 (Max, 1960)."""
    x = np.linspace(-8.0, 8.0, 100_001)
    weight = np.exp(-0.5 * x * x)
    weight /= weight.sum()
    n = 2**bits

    def mse(step):
        codes = np.clip(np.round(x / step + (n - 1) / 2), 0, n - 1)
        return float((weight * (x - (codes - (n - 1) / 2) * step) ** 2).sum())

    lo, hi = 1e-3, 4.0  # golden-section search: the error is unimodal in the step
    ratio = (5**0.5 - 1) / 2
    for _ in range(50):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if mse(a) < mse(b):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2


def gaussian_quantize(x: mx.array, group: int, bits: int, dtype=None):
    """TurboQuant's scalar quantizer on mlx's affine layout: each group on the
    `gaussian_step` grid of its own mean and standard deviation, centred on
    the mean; a constant group is its mean exactly. Scales and biases in
    `dtype` (default x's)."""
    g = _groups(x, group)
    return _encode(x, g, *gaussian_grid(g, bits, dtype or x.dtype), bits)


def gaussian_grid(g: mx.array, bits: int, dtype):
    """`gaussian_quantize`'s (scales, biases) [..., 1] of groups g [..., group]."""
    mean = g.mean(-1, keepdims=True)
    std = mx.sqrt(((g - mean) ** 2).mean(-1, keepdims=True))
    step = (std * gaussian_step(bits)).astype(dtype)
    biases = mean - step.astype(mx.float32) * ((2**bits - 1) / 2)
    return step, biases.astype(dtype)


GRIDS = {"minmax": minmax_grid, "gaussian": gaussian_grid}  # kv_round="query"'s


def feedback_quantize(k: mx.array, group: int, bits: int, grid: str, dtype, factor):
    """Keys k [B, H, T, D] quantized per channel (K^T along T, as `quantize`
    lays them out) with rounding error fed forward along each key's channels
    (GPTQ's rule, Frantar et al. 2023): channel j is rounded on its group's
    grid, then the later channels of the same key move by -e_j U[j] / U[j, j],
    `factor` U [B, H, D, D] the upper Cholesky factor of H^-1, so that the
    error lands where q^T H q (the expected queries) is small (module doc,
    kv_round). The grid is the unmoved keys' (`GRIDS`)."""
    g = _groups(k.swapaxes(-1, -2), group)  # [B, H, D, T/group, group]
    scales, biases = GRIDS[grid](g, bits, dtype or k.dtype)

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


def quantize(x: mx.array, group: int, bits: int, grid: str = "minmax", dtype=None):
    """(words, scales, biases) of x along its last axis, groups of `group`,
    scales and biases in `dtype` (default x's; biases None for mxfp4, whose
    scales are 8-bit exponents)."""
    if grid == "minmax":
        return minmax_quantize(x, group, bits, dtype)
    if grid == "gaussian":
        return gaussian_quantize(x, group, bits, dtype)
    if grid == "mxfp4":
        words, scales = mx.quantize(x, group_size=group, bits=bits, mode="mxfp4")
        return words, scales, None
    return mx.quantize(x if dtype is None else x.astype(dtype), group, bits)


def _times(x: mx.array, m: mx.array) -> mx.array:
    """x [B, H, n, D] @ m [B, H, D, D] in float32, back in x's dtype."""
    return (x.astype(mx.float32) @ m.astype(mx.float32)).astype(x.dtype)


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


def key_basis(moment: mx.array | None, k: mx.array, group: int):
    """A^-1 [B, H, D, D] as the store holds it (module doc, query basis), on 8
    bits: int8 codes and one fp32 step a column [B, H, 1, D] (`unpack_unmap`),
    from the queries' second moment [B, H, D, D] (None: no queries seen, the
    identity) and unrotated keys k [B, H, n, D], n a multiple of `group`: C is
    their spread within each group of rows. Both matrices are damped by
    `ROUNDING_DAMP` of their mean diagonal; A is scaled to determinant 1 (the
    grid ignores a common factor). Keys are mapped by the inverse of A^-1 as
    stored (`key_map`), so q . k stays exact whatever its rounding."""
    B, H, n, D = k.shape
    if moment is None:
        inverse = mx.broadcast_to(mx.eye(D, dtype=mx.float32), (B, H, D, D))
    else:
        inverse = mx.linalg.inv(_basis(moment, k, group), stream=mx.cpu)
    step = mx.maximum(mx.abs(inverse).max(-2, keepdims=True) / 127, 1e-30)
    return mx.round(inverse / step).astype(mx.int8), step


def _basis(moment: mx.array, k: mx.array, group: int) -> mx.array:
    """A [B, H, D, D] (`key_basis`), float32."""
    B, H, n, D = k.shape
    g = k.astype(mx.float32).reshape(B, H, n // group, group, D)
    dev = (g - g.mean(3, keepdims=True)).reshape(B, H, n, D)
    cpu = mx.cpu
    w, u = mx.linalg.eigh(_damped(dev.swapaxes(-1, -2) @ dev / n), stream=cpu)
    w = mx.maximum(w, 1e-30)
    root = (u * mx.sqrt(w)[..., None, :]) @ u.swapaxes(-1, -2)
    inv_root = (u * mx.rsqrt(w)[..., None, :]) @ u.swapaxes(-1, -2)
    joint = root @ _damped(moment.astype(mx.float32)) @ root
    lam, v = mx.linalg.eigh((joint + joint.swapaxes(-1, -2)) / 2, stream=cpu)
    v = v * _largest_positive(v)
    quarter = mx.maximum(lam, 1e-30) ** 0.25
    a = (quarter[..., :, None] * v.swapaxes(-1, -2)) @ inv_root
    log_det = mx.log(quarter).sum(-1) - 0.5 * mx.log(w).sum(-1)
    return a * mx.exp(-log_det / D)[..., None, None]


def _largest_positive(v: mx.array) -> mx.array:
    """The signs [..., 1, D] that make each eigenvector (column of v) have its
    largest entry positive (module doc, query basis; as sklearn's svd_flip)."""
    top = mx.argmax(mx.abs(v), axis=-2, keepdims=True)
    return mx.where(mx.take_along_axis(v, top, axis=-2) < 0, -1.0, 1.0)


def unpack_unmap(codes: mx.array, step: mx.array | None) -> mx.array:
    """`key_basis`'s A^-1 back in float32 (step None: an fp16 A^-1, as files
    saved before the 8-bit one)."""
    values = codes.astype(mx.float32)
    return values if step is None else values * step


def key_map(unmap: mx.array) -> mx.array:
    """A^T [B, H, D, D], float32, from A^-1 as stored: computed where keys are
    mapped (once a group), not held."""
    return mx.linalg.inv(unmap, stream=mx.cpu).swapaxes(-1, -2)


def _damped(h: mx.array) -> mx.array:
    """h [..., D, D] plus `ROUNDING_DAMP` of its mean diagonal (and a floor)."""
    D = h.shape[-1]
    diag = mx.diagonal(h, axis1=-2, axis2=-1).mean(-1)[..., None, None]
    return h + (ROUNDING_DAMP * diag + 1e-12) * mx.eye(D)


FUTURE_QUERIES = 512  # positions after the prompt whose queries kv_round weighs
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


def qjl_matrix(dim: int, layer: int) -> mx.array:
    """TurboQuant's QJL projection S [dim, dim], i.i.d. N(0, 1), seeded by the
    layer (a cache's state stores it, as the rotation's signs)."""
    return mx.random.normal((dim, dim), key=mx.random.key(0x91A + layer))


def _cat(old, new, axis):
    return new if old is None else mx.concatenate([old, new], axis=axis)


class QuantizedRows:
    """Quantized rows of heads sharing one width, [B, H, ...].

    Keys per channel (KIVI): `kw` [B, H, D, T/32*bits], `ks`, `kb` [B, H, D,
    T/group]; per token (`keys="token"`, as values and mlx-lm's cache): `kw`
    [B, H, T, D/32*bits], `ks`, `kb` [B, H, T, D/group].
    Values: `vw` [B, H, T, D/32*bits], `vs`, `vb` [B, H, T, D/group].
    `grid`: module doc (mxfp4 has no biases: `kb` and `vb` stay None).
    `scales`: "model" (scales and biases in the rows' dtype) or "float16".
    `qjl` [D, D] (keys per token only): TurboQuant's 1-bit residual, module
    doc: keys on `bits` - 1 bits, and `rw` [B, H, T, D/32], `rs`, `rb` [B, H,
    T, 1], the signs of the projected residual, each key's ±alpha.
    `key_bits`: the keys' width, when not `bits` (values keep `bits`)."""

    NAMES = ("kw", "ks", "kb", "vw", "vs", "vb", "rw", "rs", "rb")

    def __init__(
        self,
        bits: int,
        group: int,
        keys: str = "channel",
        grid: str = "minmax",
        scales: str = "model",
        qjl: mx.array | None = None,
        key_bits: int | None = None,
    ):
        self.bits, self.group, self.keys, self.grid = bits, group, keys, grid
        self.scales, self.qjl = scales, qjl
        self.key_bits = key_bits or (bits - 1 if qjl is not None else bits)
        self.dtype = mx.float16 if scales == "float16" else None
        self.mode = "mxfp4" if grid == "mxfp4" else "affine"
        self._empty()

    def _empty(self) -> None:
        for name in self.NAMES:
            setattr(self, name, None)

    def _held(self) -> tuple[str, ...]:
        """The names of the arrays this grid stores."""
        names = self.NAMES if self.qjl is not None else self.NAMES[:6]
        return tuple(n for n in names if self.mode == "affine" or n[1] != "b")

    def _per_token(self) -> tuple[str, ...]:
        """The arrays stored a row per token: [B, H, T, ...]."""
        return self.NAMES if self.keys == "token" else self.NAMES[3:]

    @property
    def rows(self) -> int:
        return 0 if self.vw is None else self.vw.shape[2]

    def _qmm(self, x, w, s, b, transpose=False, bits=None, group=None):
        return mx.quantized_matmul(
            x,
            w,
            s,
            b,
            transpose=transpose,
            group_size=group or self.group,
            bits=bits or self.bits,
            mode=self.mode,
        )

    def _dq(self, w, s, b, bits=None, group=None):
        if self.dtype is not None:  # fp16 scales: dequantize in fp32, as the kernel
            s, b = s.astype(mx.float32), b.astype(mx.float32)
        g, bits = group or self.group, bits or self.bits
        return mx.dequantize(w, s, b, group_size=g, bits=bits, mode=self.mode)

    def append(self, k: mx.array, v: mx.array, factor=None) -> None:
        """Quantize and add rows [B, H, n, D]; n is a multiple of `group`.
        `factor`: keys per channel rounded with error feedback by this U
        [B, H, D, D] (`feedback_quantize`)."""
        token = self.keys == "token"
        g, b, grid, dt = self.group, self.bits, self.grid, self.dtype
        kb_ = self.key_bits
        if factor is not None:
            kw, ks, kb = feedback_quantize(k, g, kb_, grid, dt, factor)
        else:
            kw, ks, kb = quantize(k if token else k.swapaxes(-1, -2), g, kb_, grid, dt)
        vw, vs, vb = quantize(v, g, b, grid, dt)
        new = dict(kw=kw, ks=ks, kb=kb, vw=vw, vs=vs, vb=vb)
        if self.qjl is not None:
            residual = k.astype(mx.float32) - self._dq(kw, ks, kb, kb_)
            new.update(zip(("rw", "rs", "rb"), self._sketch(residual, k.dtype)))
        rows = self._per_token()
        for name in self._held():
            a = _cat(getattr(self, name), new[name], 2 if name in rows else -1)
            setattr(self, name, a)

    def _sketch(self, r: mx.array, dtype):
        """QJL of residuals r [B, H, n, D]: the signs of r S^T as 1-bit codes,
        read as ±alpha, alpha = sqrt(pi / 2) / D x |r| (scale 2 alpha, bias
        -alpha), so that (q S^T) . signs x alpha estimates q . r unbiased."""
        D = r.shape[-1]
        codes = (r @ self.qjl.T > 0).astype(mx.uint32)
        alpha = math.sqrt(math.pi / 2) / D * mx.linalg.norm(r, axis=-1, keepdims=True)
        dtype = self.dtype or dtype
        return pack(codes, 1), (2 * alpha).astype(dtype), (-alpha).astype(dtype)

    def logits(self, q: mx.array) -> mx.array:
        """q [B, H, M, D] . K^T -> [B, H, M, T]."""
        token = self.keys == "token"
        out = self._qmm(q, self.kw, self.ks, self.kb, token, self.key_bits)
        if self.qjl is None:
            return out
        D = q.shape[-1]
        sq = (q.astype(mx.float32) @ self.qjl.T).astype(q.dtype)
        return out + self._qmm(sq, self.rw, self.rs, self.rb, True, 1, D)

    def weighted(self, p: mx.array) -> mx.array:
        """p [B, H, M, T] . V -> [B, H, M, D]."""
        return self._qmm(p, self.vw, self.vs, self.vb)

    def _half_variance(self) -> mx.array:
        """s^2 / 24 of every key step (float32; `ks`'s layout): half the
        variance of uniform rounding error on a step s (module doc, `debias`)."""
        return self.ks.astype(mx.float32) ** 2 / 24.0

    def noise(self, q: mx.array) -> mx.array:
        """Half the expected variance of q . (k - k_hat) per row [B, H, M, T]
        (float32), sum_c q_c^2 s_c^2 / 24."""
        q2, s2 = q.astype(mx.float32) ** 2, self._half_variance()
        if self.keys == "token":  # s2 [B, H, T, D/group]: a step per channel group
            *lead, M, D = q2.shape
            q2 = q2.reshape(*lead, M, D // self.group, self.group).sum(-1)
            return q2 @ s2.swapaxes(-1, -2)
        # s2 [B, H, D, T/group]: a step per channel and group of rows
        return mx.repeat(q2 @ s2, self.group, axis=-1)

    def noise_rows(self) -> mx.array:
        """s_c^2 / 24 per row and channel [B, H, T, D] (float32): `noise` is
        q^2 . noise_rows per row, so a dense read can carry it as channels."""
        s2 = mx.repeat(self._half_variance(), self.group, axis=-1)
        return s2 if self.keys == "token" else s2.swapaxes(-1, -2)

    def dequantize(self, dtype) -> tuple[mx.array, mx.array]:
        """Keys and values [B, H, T, D] in `dtype` (computed, never stored):
        with `qjl`, each key plus alpha x signs S, the residual's unbiased
        estimate (q . it is the kernel's estimate of q . r)."""
        keys = self._dq(self.kw, self.ks, self.kb, self.key_bits)
        values = self._dq(self.vw, self.vs, self.vb)
        if self.keys != "token":
            keys = keys.swapaxes(-1, -2)
        if self.qjl is not None:
            D = keys.shape[-1]
            keys = keys + self._dq(self.rw, self.rs, self.rb, 1, D) @ self.qjl
        return keys.astype(dtype), values.astype(dtype)

    def _by_group(self):
        """Every array with its groups of rows on one axis: name -> (array
        reshaped [B, H, ..., G, per-group], axis of G)."""
        B, H, T = *self.vw.shape[:2], self.rows
        G = T // self.group
        out = {}
        rows = self._per_token()
        for name in self._held():
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

    def rebuild(self, k, v, exact, gid, src, factor=None) -> None:
        """Replace the rows by k, v [B, H, n, D] quantized (`append`'s
        `factor`), except what is
        already quantized: an array stored a row per token keeps old row
        src[b, h, i] as it was where src < the old rows (so values, and keys
        per token with their QJL signs, are quantized once, never twice), and
        an array per channel keeps old group gid[b, h, j] where exact[b, h, j]
        (its rows are exactly that group's, in order)."""
        T = self.rows
        old_rows = {n: getattr(self, n) for n in self._per_token()}
        old_groups = self._by_group() if T and self.keys != "token" else None
        self._empty()
        if k.shape[2] == 0:
            return
        self.append(k, v, factor)
        if not T:
            return
        take = mx.minimum(src, T - 1)[..., None]
        from_old = (src < T)[..., None]
        for name in set(self._per_token()) & set(self._held()):
            kept = mx.take_along_axis(old_rows[name], take, axis=2)
            setattr(self, name, mx.where(from_old, kept, getattr(self, name)))
        if old_groups is None:
            return
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
        for name in self._held():
            a = getattr(self, name)
            if name in self._per_token():
                setattr(self, name, a[:, :, :rows])
            else:  # the last axis is proportional to T
                setattr(self, name, a[..., : a.shape[-1] * rows // T])

    def arrays(self) -> list[mx.array]:
        return [a for a in (getattr(self, n) for n in self.NAMES) if a is not None]

    def state(self, prefix: str) -> dict:
        return {f"{prefix}.{n}": getattr(self, n) for n in self._held() if self.rows}

    def load(self, st: dict, prefix: str) -> None:
        for n in self._held():
            setattr(self, n, st.get(f"{prefix}.{n}"))


def sinks_then_groups(n: int, sinks: int, group: int) -> int:
    """How many of n rows a store quantizes: up to `sinks` (held dense), then
    whole groups."""
    lead = min(n, sinks)
    return lead + (n - lead) // group * group


class QuantizedStore:
    """Quantized rows of every KV head, each head at its own width (`bits`, one
    per head): heads of one width are stored together, and what attention
    reads is put back in head order. `signs` [H, D]: rows stored rotated (module
    doc); they and every read are unrotated here. The signs are state, not KV:
    `arrays()` (the bytes held) leaves them out. `sinks`: the first rows held
    dense (`sink_k`, `sink_v` [B, H, <= sinks, D]), before the quantized ones.
    `key_bits`: every head's keys at this width, the values at `bits` (None:
    keys at `bits` too). `query_aware`: keys scaled by `key_scale` [B, H, D]
    before the rotation (module doc), set from `query_power` (the cache's mean
    squared queries) when the first group is quantized. `rounds`: keys per
    channel rounded with error feedback (kv_round="query", module doc) by
    `key_factor` (`pack_factor`'s), set from `query_moment` (the second moment of
    the cache's post-RoPE queries to come, unrotated) when the first group is
    quantized."""

    def __init__(
        self,
        bits: tuple[int, ...],
        group: int,
        signs=None,
        keys: str = "channel",
        grid: str = "minmax",
        scales: str = "model",
        qjl: mx.array | None = None,
        sinks: int = 0,
        key_bits: int | None = None,
        query_aware: bool = False,
        rounds: bool = False,
        basis: bool = False,
    ):
        self.bits, self.group, self.signs, self.keys = tuple(bits), group, signs, keys
        self.grid, self.scales, self.qjl = grid, scales, qjl
        self.sinks, self.key_bits = sinks, key_bits
        self.query_aware, self.key_scale, self.query_power = query_aware, None, None
        self.rounds, self.key_factor, self.query_moment = rounds, None, None
        self.factor_step = None
        self.basis, self.key_unmap, self.unmap_step = basis, None, None
        self.sink_k = self.sink_v = None
        self.widths = sorted(set(self.bits))
        self.heads = [
            [h for h, b in enumerate(self.bits) if b == w] for w in self.widths
        ]
        self.parts = [
            QuantizedRows(w, group, keys, grid, scales, qjl, key_bits)
            for w in self.widths
        ]
        order = [h for heads in self.heads for h in heads]
        self.inverse = None
        if order != list(range(len(order))):
            self.inverse = mx.array([order.index(h) for h in range(len(order))])

    @property
    def sink_rows(self) -> int:
        return 0 if self.sink_k is None else self.sink_k.shape[2]

    @property
    def rows(self) -> int:
        return self.sink_rows + self.parts[0].rows

    def _sinks_missing(self) -> int:
        """Sinks still to take: only ahead of every quantized row (a store
        saved with fewer sinks than its options now ask keeps its own)."""
        return 0 if self.parts[0].rows else max(0, self.sinks - self.sink_rows)

    def to_fill(self, n: int) -> int:
        """How many of n rows past the residual to add: the sinks still
        missing, then whole groups."""
        return sinks_then_groups(n, self._sinks_missing(), self.group)

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
        factors = self._factors(k)
        for part, kh, vh, fh in zip(
            self.parts, self._split(k), self._split(v), factors
        ):
            part.append(kh, vh, fh)

    def _factors(self, k: mx.array) -> list:
        """Each part's rounding factor (None: nearest rounding); with `rounds`,
        set from `query_moment` when not yet (the identity, nearest rounding,
        when no query was seen)."""
        if not self.rounds:
            return [None] * len(self.parts)
        B, H, _, D = k.shape
        if self.key_factor is None:
            if self.query_moment is None:
                self.key_factor = mx.zeros((B, H, D * (D - 1) // 2), mx.int8)
                self.factor_step = mx.ones((B, H, 1), mx.float32)
            else:
                u = rounding_factor(self._stored_moment(self.query_moment))
                self.key_factor, self.factor_step = pack_factor(u)
            self.query_moment = None
        return self._split(unpack_factor(self.key_factor, self.factor_step, D))

    def _unmap(self) -> mx.array:
        """A^-1 [B, H, D, D] in float32 (the query basis is set)."""
        return unpack_unmap(self.key_unmap, self.unmap_step)

    def _stored_moment(self, m: mx.array) -> mx.array:
        """A second moment of unrotated queries, m [B, H, D, D], as the stored
        keys meet them: M^T S^-1 m S^-1 M, S the key scales, M the rotation."""
        m = m.astype(mx.float32)
        if self.key_scale is not None:
            inv = 1.0 / self.key_scale
            m = m * inv[..., :, None] * inv[..., None, :]
        if self.key_unmap is not None:
            unmap = self._unmap()
            m = unmap.swapaxes(-1, -2) @ m @ unmap
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
        if self.basis:
            if self.key_unmap is None:
                maps = key_basis(self.query_moment, k, self.group)
                self.key_unmap, self.unmap_step = maps
            k = _times(k, key_map(self._unmap()))
        return rotate(k, self.signs)

    def _queries_in(self, q: mx.array) -> mx.array:
        if self.key_scale is not None:
            q = (q / self.key_scale[:, :, None, :]).astype(q.dtype)
        if self.key_unmap is not None:
            q = _times(q, self._unmap())
        return rotate(q, self.signs)

    def _keys_out(self, k: mx.array) -> mx.array:
        k = unrotate(k, self.signs)
        if self.key_unmap is not None:
            k = _times(k, self._unmap().swapaxes(-1, -2))
        if self.key_scale is None:
            return k
        return (k / self.key_scale[:, :, None, :]).astype(k.dtype)

    def logits(self, q: mx.array) -> mx.array:
        sink = None if self.sink_k is None else q @ self.sink_k.swapaxes(-1, -2)
        if not self.parts[0].rows:
            return sink
        if self.signs is not None:
            q = self._queries_in(q)
        out = self._join([p.logits(qh) for p, qh in zip(self.parts, self._split(q))])
        return out if sink is None else mx.concatenate([sink, out], axis=-1)

    def _after_sinks(self, x: mx.array, axis: int) -> mx.array:
        """x over the quantized rows (along `axis`) with 0 for the sinks ahead."""
        if not self.sink_rows:
            return x
        shape = list(x.shape)
        shape[axis] = self.sink_rows
        return mx.concatenate([mx.zeros(shape), x], axis=axis)

    def logit_bias(self, q: mx.array) -> mx.array | None:
        """What `debias` adds to `logits(q)` [B, H, M, rows] (float32): minus
        each quantized row's `noise`, 0 for the sinks; None before any row
        is quantized."""
        if not self.parts[0].rows:
            return None
        if self.signs is not None:
            q = self._queries_in(q)
        out = self._join([p.noise(qh) for p, qh in zip(self.parts, self._split(q))])
        return self._after_sinks(-out, -1)

    def noise_channels(self, q: mx.array) -> tuple[mx.array, mx.array] | None:
        """`logit_bias` as D more channels for a dense read: (x [B, H, M, D],
        y [B, H, rows, D]) with x . y = logit_bias(q), so that keys read with y
        appended attend queries with x appended as the biased logits (float32);
        None before any row is quantized."""
        if not self.parts[0].rows:
            return None
        if self.signs is not None:
            q = self._queries_in(q)
        y = self._join([p.noise_rows() for p in self.parts])
        return q.astype(mx.float32) ** 2, self._after_sinks(-y, 2)

    def weighted(self, p: mx.array) -> mx.array:
        s = self.sink_rows
        sink = None if not s else p[..., :s] @ self.sink_v
        if not self.parts[0].rows:
            return sink
        parts = zip(self.parts, self._split(p[..., s:] if s else p))
        out = self._join([part.weighted(ph) for part, ph in parts])
        out = out if self.signs is None else unrotate(out, self.signs)
        return out if sink is None else sink + out.astype(sink.dtype)

    def dequantize(self, dtype):
        keys = values = None
        if self.parts[0].rows:
            pairs = [part.dequantize(dtype) for part in self.parts]
            keys, values = (
                self._join([k for k, _ in pairs]),
                self._join([v for _, v in pairs]),
            )
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
        for part, g in zip(self.parts, self._split(gid)):
            part.take_groups(g)

    def _no_sinks(self) -> None:
        if self.sinks:  # only eviction regroups rows, and kivi never evicts
            raise ValueError("quantized rows with dense sinks cannot be regrouped")

    def rebuild(self, k, v, exact, gid, src) -> None:
        """The quantized rows replaced as `QuantizedRows.rebuild` does (`src`:
        the old quantized row of each new one, counted after the sinks); the
        sinks ahead of them stay."""
        if self.signs is not None and k.shape[2]:  # unrotated rows in, as `append`
            k, v = self._keys_in(k), rotate(v, self.signs)
        split = zip(self.parts, *(self._split(x) for x in (k, v, exact, gid, src)))
        for (part, kh, vh, eh, gh, sh), fh in zip(split, self._factors(k)):
            part.rebuild(kh, vh, eh, gh, sh, fh)

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
        for part in self.parts:
            part.truncate(max(0, rows - s))

    def clone(self) -> QuantizedStore:
        new = QuantizedStore(
            self.bits,
            self.group,
            self.signs,
            self.keys,
            self.grid,
            self.scales,
            self.qjl,
            self.sinks,
            self.key_bits,
            self.query_aware,
            self.rounds,
            self.basis,
        )
        new.key_unmap, new.unmap_step = self.key_unmap, self.unmap_step
        new.key_scale, new.query_power = self.key_scale, self.query_power
        new.key_factor, new.query_moment = self.key_factor, self.query_moment
        new.factor_step = self.factor_step
        new.sink_k, new.sink_v = self.sink_k, self.sink_v
        for src, dst in zip(self.parts, new.parts):
            dst.load(src.state("p"), "p")
        return new

    def arrays(self) -> list[mx.array]:
        sink = [] if self.sink_k is None else [self.sink_k, self.sink_v]
        # the rounding factor is per sequence, D(D-1)/2 per head: counted as held
        factor = [a for a in (self.key_factor, self.factor_step) if a is not None]
        # so is the query basis, D^2 int8 and D fp32 steps per head
        factor += [a for a in (self.key_unmap, self.unmap_step) if a is not None]
        return sink + factor + [a for part in self.parts for a in part.arrays()]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def state(self) -> dict:
        st = {"q.bits": mx.array(self.bits, dtype=mx.int32)}
        if self.signs is not None:
            st["q.signs"] = self.signs
        if self.keys == "token":  # absent: per channel, as files before it
            st["q.token_keys"] = mx.array([1], dtype=mx.int32)
        if self.grid != "minmax":  # absent: minmax, as files before it
            st["q.grid"] = mx.array([GRID_CODES[self.grid]], dtype=mx.int32)
        if self.scales == "float16":  # absent: the model's dtype
            st["q.scales16"] = mx.array([1], dtype=mx.int32)
        if self.qjl is not None:
            st["q.qjl"] = self.qjl
        if self.key_bits is not None:  # absent: keys at the values' width
            st["q.key_bits"] = mx.array([self.key_bits], dtype=mx.int32)
        if self.key_scale is not None:
            st["q.key_scale"] = self.key_scale
        if self.key_factor is not None:
            st["q.key_factor"] = self.key_factor
        if self.factor_step is not None:  # absent: an fp16 triangle
            st["q.factor_step"] = self.factor_step
        if self.key_unmap is not None:
            st["q.key_unmap"] = self.key_unmap
        if self.unmap_step is not None:  # absent: an fp16 A^-1
            st["q.unmap_step"] = self.unmap_step
        if self.sink_k is not None:
            st["q.sink_k"], st["q.sink_v"] = self.sink_k, self.sink_v
        for w, part in zip(self.widths, self.parts):
            st.update(part.state(f"q{w}"))
        return st

    @classmethod
    def from_state(
        cls,
        st: dict,
        group: int,
        sinks: int = 0,
        query_aware: bool = False,
        rounds: bool = False,
        basis: bool = False,
    ) -> QuantizedStore | None:
        if "q.bits" not in st:
            return None
        keys = "token" if "q.token_keys" in st else "channel"
        code = int(st["q.grid"].item()) if "q.grid" in st else 0
        grid = next((g for g, c in GRID_CODES.items() if c == code), None)
        if grid is None:
            raise ValueError(f"unknown quantization grid code {code}")
        bits = tuple(st["q.bits"].tolist())
        scales = "float16" if "q.scales16" in st else "model"
        key_bits = int(st["q.key_bits"].item()) if "q.key_bits" in st else None
        store = cls(
            bits,
            group,
            st.get("q.signs"),
            keys,
            grid,
            scales,
            st.get("q.qjl"),
            sinks,
            key_bits,
            query_aware,
            rounds,
            basis,
        )
        store.key_scale = st.get("q.key_scale")
        # files before the 8-bit basis also hold q.key_map, which keys now
        # take from A^-1 itself
        store.key_unmap, store.unmap_step = (
            st.get("q.key_unmap"),
            st.get("q.unmap_step"),
        )
        store.key_factor = st.get("q.key_factor")
        store.factor_step = st.get("q.factor_step")  # absent: an fp16 triangle
        store.sink_k, store.sink_v = st.get("q.sink_k"), st.get("q.sink_v")
        if store.sink_rows > sinks:
            raise ValueError(
                f"the saved rows hold {store.sink_rows} dense sinks, these "
                f"options {sinks}"
            )
        for w, part in zip(store.widths, store.parts):
            part.load(st, f"q{w}")
        return store
