"""Q-Filters calibration (Godey et al., 2025): per layer and query head, the
first right singular vector of post-RoPE queries (the frame the cache scores
keys in), oriented so that most queries project positively, averaged over each
GQA group for the KV-head filters the file also carries.

The queries come through the probe seam (`probe.py`); the file is written with
`format.write` and read by the cache with `format.load_filters`.
"""

from __future__ import annotations

import mlx.core as mx

from model_adapters.base import fingerprint

from ..caches.calibration_files import QFILTERS_FORMAT, group_mean, write
from ..probe import rows_at, run_probe, sample_positions

MAX_VECTORS = 3000  # queries kept per layer and query head


# ---- query capture ---------------------------------------------------------------
def capture_queries(model, ids, chunk=1024, max_vectors=MAX_VECTORS, seed=0, tick=None):
    """Per layer [Hq, n, D] post-RoPE queries at up to `max_vectors` positions of
    `ids` (a seeded sample), the model run over `ids` in chunks of `chunk`;
    None for sliding-window layers."""
    wanted = sample_positions(len(ids), max_vectors, seed)
    kept: dict[int, list] = {}

    def keep(seen):
        idx = rows_at(wanted, seen)
        if idx is not None:
            piece = seen.q[0][:, idx].astype(mx.float32)
            mx.eval(piece)
            kept.setdefault(seen.layer, []).append(piece)

    run_probe(model, ids, keep, chunk=chunk, tick=tick)
    return [
        mx.concatenate(kept[i], axis=1) if i in kept else None
        for i in range(len(model.layers))
    ]


def query_filters(queries: mx.array) -> mx.array:
    """[Hq, D] unit filters: per head, v1 of the SVD of its queries [Hq, n, D],
    signed so that most queries project positively. SVD runs on the CPU."""
    with mx.stream(mx.cpu):
        _, _, vt = mx.linalg.svd(queries.astype(mx.float32))
        v1 = vt[:, 0, :]  # [Hq, D]
        proj = (queries * v1[:, None, :]).sum(-1)  # [Hq, n]
        positive = (proj > 0).mean(-1) >= 0.5
        v1 = mx.where(positive[:, None], v1, -v1)
        mx.eval(v1)
    return v1


def calibrate_filters(model, ids, *, seed=0, tick=None, fit_tick=None):
    """(per layer [Hq, D] filters, None for sliding-window layers; the queries
    they came from). `tick(n)`: n more tokens read; `fit_tick(1)`: one more
    layer's filters."""
    queries = capture_queries(model, ids, seed=seed, tick=tick)
    filters = []
    for q in queries:
        filters.append(None if q is None else query_filters(q))
        if fit_tick is not None:
            fit_tick(1)
    return filters, queries


def save_filters(path, per_head: list, model, info: dict | None = None):
    """Write per-layer query-head filters (and their GQA means) with the model's
    fingerprint; layers given as None (sliding-window layers) are left out."""
    fp = fingerprint(model)
    arrays = {}
    for i, f in enumerate(per_head):
        if f is not None:
            arrays[f"layer.{i}.query_heads"] = f
            arrays[f"layer.{i}.kv_heads"] = group_mean(f, fp["kv_heads"])
    write(path, arrays, fp, QFILTERS_FORMAT, "qfilters", info)
