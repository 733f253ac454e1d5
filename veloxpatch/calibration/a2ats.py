"""A2ATS's query-aware key codebook, calibrated on the model's real queries.

Far keys are scored as <q~, k> with q~ the query rotated to position b, so the
error a code c makes on key k is E[(q~ . (k - c))^2] = (k - c) H (k - c)^T with
H = E[q~^T q~] over the queries of the key's GQA group. With H = L L^T that is
|(k - c) L|^2: k-means on the transformed keys k L minimises it, and a key's code
is argmin |k L - c'|. The lookup table uses the centroids in key space,
c = c' L^-1. H is normalised to trace D and gets a small ridge (it may be near
singular); `query_aware=False` uses H = I, plain k-means, for comparison.

Keys are captured pre-RoPE and queries rotated to b through the probe seam
(`probe.py`). The file (`save_codebook`) carries the model fingerprint and b.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from model_adapters.base import fingerprint

from ..caches.a2ats import rope_to
from ..caches.calibration_files import CODEBOOK_FORMAT, RIDGE, with_norms, write
from ..errors import CalibrationError
from ..probe import rows_at, run_probe, sample_positions

MAX_KEYS = 16384  # keys captured per layer: a codebook has at most this many codes


def capture(
    model, ids, far_position, chunk=1024, max_vectors=MAX_KEYS, seed=0, tick=None
):
    """Per layer (keys [Hkv, n, D], rotated queries [Hq, n, D]) at up to
    `max_vectors` seeded positions of `ids`; None for sliding-window layers."""
    wanted = sample_positions(len(ids), max_vectors, seed)
    kept: dict[int, tuple[list, list]] = {}

    def keep(seen):
        idx = rows_at(wanted, seen)
        if idx is None:
            return
        q_far = rope_to(seen.rope, seen.q_pre[:, :, idx], far_position)
        if seen.query_scale is not None:
            q_far = q_far * seen.query_scale[..., idx, :]
        keys = seen.k_pre[0][:, idx].astype(mx.float32)
        q_far = q_far[0].astype(mx.float32)
        mx.eval(keys, q_far)
        ks, qs = kept.setdefault(seen.layer, ([], []))
        ks.append(keys)
        qs.append(q_far)

    run_probe(model, ids, keep, chunk=chunk, tick=tick)
    return [
        (mx.concatenate(kept[i][0], 1), mx.concatenate(kept[i][1], 1))
        if i in kept
        else None
        for i in range(len(model.layers))
    ]


def second_moment(queries: np.ndarray, kv_heads: int) -> np.ndarray:
    """[Hkv, D, D]: E[q~^T q~] over each group's queries [Hq, n, D], trace D,
    plus RIDGE x I."""
    hq, n, d = queries.shape
    q = queries.reshape(kv_heads, hq // kv_heads * n, d).astype(np.float64)
    h = np.einsum("gnd,gne->gde", q, q) / q.shape[1]
    h *= d / np.trace(h, axis1=1, axis2=2)[:, None, None]
    return h + RIDGE * np.eye(d)


def kmeans(x: np.ndarray, k: int, seed: int, iters: int = 25) -> np.ndarray:
    """Centroids [k, D] of x [n, D]: k-means++ seeding, then Lloyd iterations
    (an empty cluster takes the point farthest from its centroid)."""
    rng = np.random.default_rng(seed)
    n = x.shape[0]
    centers = np.empty((k, x.shape[1]))
    centers[0] = x[rng.integers(n)]
    d2 = ((x - centers[0]) ** 2).sum(1)
    for i in range(1, k):
        centers[i] = x[rng.choice(n, p=d2 / d2.sum())]
        d2 = np.minimum(d2, ((x - centers[i]) ** 2).sum(1))
    xs = mx.array(x.astype(np.float32))
    xn = (xs * xs).sum(-1)
    for _ in range(iters):
        c = mx.array(centers.astype(np.float32))
        dist = xn[:, None] - 2 * (xs @ c.T) + (c * c).sum(-1)[None]
        label = np.array(mx.argmin(dist, axis=-1))
        best = np.array(dist.min(-1))
        sums = np.zeros_like(centers)
        np.add.at(sums, label, x)
        counts = np.bincount(label, minlength=k)
        empty = np.flatnonzero(counts == 0)
        centers = np.where(
            counts[:, None] > 0, sums / np.maximum(counts, 1)[:, None], centers
        )
        for j, far in zip(empty, np.argsort(-best)[: len(empty)]):
            centers[j] = x[far]
    return centers


def layer_codebook(keys, queries, size: int, seed: int, query_aware=True) -> dict:
    """One layer's codebook from keys [Hkv, n, D] and rotated queries [Hq, n, D]."""
    keys, queries = np.array(keys, np.float64), np.array(queries, np.float64)
    hkv, n, d = keys.shape
    if size > n:
        raise CalibrationError(f"codebook size {size} exceeds the {n} keys captured")
    h = (
        second_moment(queries, hkv)
        if query_aware
        else np.broadcast_to(np.eye(d), (hkv, d, d))
    )
    out = {"transform": [], "tcentroids": [], "centroids": []}
    for g in range(hkv):
        lower = np.linalg.cholesky(h[g])  # H = L L^T
        tc = kmeans(keys[g] @ lower, size, seed + g)
        out["transform"].append(lower)
        out["tcentroids"].append(tc)
        out["centroids"].append(np.linalg.solve(lower.T, tc.T).T)  # c' L^-1
    return {k: mx.array(np.stack(v).astype(np.float32)) for k, v in out.items()}


def calibrate_codebook(
    model,
    ids,
    *,
    size,
    far_position,
    seed=0,
    tick=None,
    query_aware=True,
    fit_tick=None,
):
    """Per layer codebooks (with norms) and the captured keys and queries.
    `tick(n)`: n more tokens read; `fit_tick(1)`: one more layer's codebook."""
    captured = capture(model, ids, far_position, seed=seed, tick=tick)
    books = []
    for c in captured:
        book = None if c is None else layer_codebook(*c, size, seed, query_aware)
        books.append(None if book is None else with_norms(book))
        if fit_tick is not None:
            fit_tick(1)
    return books, captured


def save_codebook(path, books: list, model, far_position: int, info=None):
    """Write per-layer codebooks (None for sliding-window layers) with the
    model's fingerprint and the far position b the queries were rotated to."""
    arrays = {
        f"layer.{i}.{k}": v
        for i, b in enumerate(books)
        if b is not None
        for k, v in b.items()
        if k != "tnorm2"  # derived, recomputed on load
    }
    far = str(far_position)
    fp = fingerprint(model)
    write(path, arrays, fp, CODEBOOK_FORMAT, "a2ats", info, far_position=far)
