"""A2ATS's query-aware key codebook, calibrated on the model's real queries.

Far keys are scored as <q~, k> with q~ the query rotated to position b, so the
error a code c makes on key k is E[(q~ . (k - c))^2] = (k - c) H (k - c)^T with
H = E[q~^T q~] over the queries of the key's GQA group. With H = L L^T that is
|(k - c) L|^2: k-means on the transformed keys k L minimises it, and a key's code
is argmin |k L - c'|. The lookup table uses the centroids in key space,
c = c' L^-1. H is normalised to trace D and gets a small ridge (it may be near
singular); `query_aware=False` uses H = I, plain k-means, for comparison.

Keys are captured pre-RoPE and queries rotated to b through the patch seam (the
`rotate` hook). The file carries the model fingerprint and b.
"""

from __future__ import annotations

import json
import os

import mlx.core as mx
import numpy as np

from .caches.a2ats import rope_to
from .caches.full import FullCache
from .errors import CalibrationError

FORMAT = "veloxpatch-a2ats/1"
RIDGE = 1e-3  # relative to the normalised H (trace D)


class KeyQueryCapture(FullCache):
    """A full cache that keeps, at chosen positions, the pre-RoPE keys and the
    queries rotated to position `b` (times any query scale)."""

    name = "a2ats-capture"

    def __init__(self, *args, positions=(), far_position=2048, **kwargs):
        super().__init__(*args, **kwargs)
        self.wanted = np.asarray(sorted(positions), dtype=np.int64)
        self.b = far_position
        self.keys_kept, self.queries_kept = [], []

    def rotate(self, q, k, rope, offset, query_scale):
        q_far = rope_to(rope, q, self.b)
        if query_scale is not None:
            q_far = q_far * query_scale
        start, L = offset, q.shape[2]
        lo, hi = np.searchsorted(self.wanted, [start, start + L])
        if hi > lo:
            idx = mx.array(self.wanted[lo:hi] - start)
            self.keys_kept.append(k[0][:, idx].astype(mx.float32))
            self.queries_kept.append(q_far[0][:, idx].astype(mx.float32))
            mx.eval(self.keys_kept[-1], self.queries_kept[-1])
        return super().rotate(q, k, rope, offset, query_scale)


def capture(model, ids, far_position, chunk=1024, max_vectors=16384, seed=0, tick=None):
    """Per layer (keys [Hkv, n, D], rotated queries [Hq, n, D]) at up to
    `max_vectors` seeded positions of `ids`."""
    from . import api

    rng = np.random.default_rng(seed)
    n = min(max_vectors, len(ids))
    positions = rng.choice(len(ids), size=n, replace=False)
    with api.patched(model, algo=KeyQueryCapture) as patch:
        caches = [
            KeyQueryCapture(positions=positions, far_position=far_position, layer=i)
            for i in range(len(patch.sites))
        ]
        for start in range(0, len(ids), chunk):
            piece = mx.array(ids[start : start + chunk])[None]
            mx.eval(model(piece, cache=caches))
            if tick is not None:
                tick(piece.shape[1])
    return [
        (mx.concatenate(c.keys_kept, 1), mx.concatenate(c.queries_kept, 1))
        for c in caches
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


def with_norms(book: dict) -> dict:
    return {**book, "tnorm2": (book["tcentroids"] ** 2).sum(-1)}


def save_codebook(path, books: list[dict], model, far_position: int, info=None):
    from .calibration import fingerprint

    arrays = {f"layer.{i}.{k}": v for i, b in enumerate(books) for k, v in b.items()}
    meta = {
        "format": FORMAT,
        "algo": "a2ats",
        "fingerprint": json.dumps(fingerprint(model), sort_keys=True),
        "far_position": str(far_position),
        "info": json.dumps(info or {}, sort_keys=True),
    }
    mx.save_safetensors(os.fspath(path), arrays, metadata=meta)


def load_codebook(path, model, far_position: int) -> list[dict]:
    """Per layer {transform, tcentroids, centroids, tnorm2}, checked against
    `model` and against the b the caches will rotate queries to."""
    from .calibration import read_checked

    arrays, meta, ours = read_checked(path, model, FORMAT, "A2ATS codebook")
    if int(meta.get("far_position", -1)) != far_position:
        raise CalibrationError(
            f"{path} was calibrated with far_position {meta.get('far_position')}, "
            f"not {far_position}"
        )
    books = []
    for i in range(ours["layers"]):
        book = {
            k: arrays.get(f"layer.{i}.{k}")
            for k in ("transform", "tcentroids", "centroids")
        }
        ok = all(
            v is not None and v.ndim == 3 and v.shape[0] == ours["kv_heads"]
            for v in book.values()
        )
        if not ok or not all(bool(mx.isfinite(v).all().item()) for v in book.values()):
            raise CalibrationError(f"{path}: damaged, layer {i} codebook")
        books.append(with_norms(book))
    return books


def calibrate_codebook(
    model, ids, *, size, far_position, seed=0, tick=None, query_aware=True
):
    """Per layer codebooks (with norms) and the captured keys and queries."""
    captured = capture(model, ids, far_position, seed=seed, tick=tick)
    books = [layer_codebook(k, q, size, seed, query_aware) for k, q in captured]
    return [with_norms(b) for b in books], captured
