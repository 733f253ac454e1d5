"""How well an A2ATS codebook finds the keys queries really attend to.

On a stretch of text, the last `n_queries` queries score the far keys (i - j >=
w, past the sinks) three ways: exact attention logits <rope(q, i), rope(k, j)>,
windowed far logits <q~, k> (q~ = rope(q, b)), and the codebook's <q~, c(k)>.
Per layer (mean over KV heads, their query heads and the queries):
  - recall: of the top `top` fraction of far keys by exact attention (and by
    windowed far logits), the share the codebook's top fraction finds;
  - query-weighted error: mean (q~ . (k - c(k)))^2 / mean (q~ . k)^2;
  - ceiling: the recall of exact attention's top keys by the windowed far
    logits themselves, what a perfect codebook would reach.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..caches.a2ats import assign, rope_to
from ..probe import rows_at, run_probe


def capture_segment(model, ids, n_queries: int, b: int, chunk: int = 1024) -> list:
    """Per layer (pre-RoPE keys, RoPE keys [Hkv, T, D], exact and rotated
    queries [Hq, n, D] of the last `n_queries` positions)."""
    T = len(ids)
    wanted = np.arange(T - n_queries, T)
    seen_by_layer: dict[int, dict] = {}

    def keep(seen):
        got = seen_by_layer.setdefault(seen.layer, {"k": [], "qe": [], "qf": []})
        got["rope"] = seen.rope
        got["k"].append(seen.k_pre[0].astype(mx.float32))
        idx = rows_at(wanted, seen)
        if idx is not None:
            far = rope_to(seen.rope, seen.q_pre[:, :, idx], b)
            if seen.query_scale is not None:
                far = far * seen.query_scale[..., idx, :]
            got["qe"].append(seen.q[0][:, idx].astype(mx.float32))
            got["qf"].append(far[0].astype(mx.float32))

    run_probe(model, ids, keep, chunk=chunk)
    out = []
    for layer in sorted(seen_by_layer):
        got = seen_by_layer[layer]
        k_pre = mx.concatenate(got["k"], axis=1)
        k_exact = got["rope"](k_pre[None], offset=0)[0]
        q_exact, q_far = (mx.concatenate(got[x], 1) for x in ("qe", "qf"))
        out.append((k_pre, k_exact, q_exact, q_far))
    return out


def _topk(scores: np.ndarray, k: int) -> np.ndarray:
    return np.argpartition(-scores, k - 1, axis=-1)[..., :k]


def recall(approx: np.ndarray, truth: np.ndarray, k: int) -> float:
    a, t = _topk(approx, k), _topk(truth, k)
    hits = [len(set(x) & set(y)) for x, y in zip(a.reshape(-1, k), t.reshape(-1, k))]
    return float(np.mean(hits)) / k


def layer_metrics(book: dict | None, data, window=64, sinks=8, top=0.03) -> dict:
    """recall_exact, recall_windowed, error and ceiling of one layer's codebook
    on one captured segment (`capture_segment`); only the ceiling without one."""
    k_pre, k_exact, q_exact, q_far = data
    hkv, T, D = k_pre.shape
    hq, nq, _ = q_exact.shape
    g = hq // hkv
    if book is not None:
        codes = np.array(assign(k_pre[None], book)[0]).astype(np.int64)  # [Hkv, T]
        cent = np.array(book["centroids"])
    kp, ke = np.array(k_pre), np.array(k_exact)
    qe, qf = (np.array(a).reshape(hkv, g, nq, D) for a in (q_exact, q_far))
    res = {"recall_exact": [], "recall_windowed": [], "error": [], "ceiling": []}
    if book is None:  # no codebook: only the ceiling
        res = {"ceiling": []}
    for a in range(nq):
        i = T - nq + a
        far = slice(sinks, i - window + 1)
        n = max(1, math.ceil(top * (i + 1)))
        for h in range(hkv):
            exact = qe[h, :, a] @ ke[h, far].T
            windowed = qf[h, :, a] @ kp[h, far].T
            res["ceiling"].append(recall(windowed, exact, n))  # a perfect codebook
            if book is None:
                continue
            approx = qf[h, :, a] @ cent[h][codes[h, far]].T
            res["recall_exact"].append(recall(approx, exact, n))
            res["recall_windowed"].append(recall(approx, windowed, n))
            err = ((windowed - approx) ** 2).mean() / (windowed**2).mean()
            res["error"].append(err)
    return {k: float(np.mean(v)) for k, v in res.items()}


def codebook_quality(books: list[dict], segments: list, **kw) -> tuple[dict, list]:
    """(mean over layers, per layer) of `layer_metrics` averaged over segments."""
    per_layer = []
    for layer, book in enumerate(books):
        ms = [layer_metrics(book, seg[layer], **kw) for seg in segments]
        per_layer.append({k: float(np.mean([m[k] for m in ms])) for k in ms[0]})
    mean = {k: float(np.mean([p[k] for p in per_layer])) for k in per_layer[0]}
    return mean, per_layer
