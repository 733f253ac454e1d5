"""A2ATS codebooks on SmolLM2: query-aware (H from real queries) against plain
k-means (H = I), at several codebook sizes, on held-out prose.

Codebooks are calibrated on the calibration half of the text (`--tokens`
tokens). On `--segments` stretches of the evaluation half, the last `--queries`
queries of each stretch score the far keys (i - j >= w, past the sinks) three
ways: exact attention logits <rope(q, i), rope(k, j)>, windowed far logits
<q~, k> (q~ = rope(q, b)), and the codebook's <q~, c(k)>. Reported per layer
(averaged over KV heads, their query heads and the queries), then averaged over
layers:
  - recall: of the top 3% far keys by exact attention (and by windowed far
    logits), the share the codebook's top 3% finds;
  - query-weighted error: mean (q~ . (k - c(k)))^2 / mean (q~ . k)^2.

    .venv/bin/python scripts/a2ats_codebook.py --sizes 64,256,1024
"""

from __future__ import annotations

import argparse
import math
import time

from veloxpatch import blas

blas.preload()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import veloxpatch  # noqa: E402
from veloxpatch.caches.a2ats import assign, rope_to  # noqa: E402
from veloxpatch.caches.full import FullCache  # noqa: E402
from veloxpatch.codebook import capture, layer_codebook, with_norms  # noqa: E402
from veloxpatch.eval.runinfo import run_info, write_results  # noqa: E402
from veloxpatch.eval.text import prose_tokens  # noqa: E402


class Capture(FullCache):
    """Keeps pre-RoPE keys, and the queries of the last `n` positions: exact
    (rotated to their position) and rotated to b."""

    name = "capture"

    def __init__(self, *a, last=(), b=2048, **kw):
        super().__init__(*a, **kw)
        self.last, self.b = last, b
        self.k_pre, self.q_exact, self.q_far, self.rope = [], [], [], None

    def rotate(self, q, k, rope, offset, query_scale):
        self.rope = rope
        self.k_pre.append(k[0].astype(mx.float32))
        lo, hi = self.last
        a, z = max(lo, offset), min(hi, offset + q.shape[2])
        if z > a:
            sl = q[:, :, a - offset : z - offset]
            self.q_exact.append(rope(sl, offset=a)[0].astype(mx.float32))
            self.q_far.append(rope_to(rope, sl, self.b)[0].astype(mx.float32))
        return super().rotate(q, k, rope, offset, query_scale)


def segment(model, ids, n_queries, b):
    T = len(ids)
    with veloxpatch.patched(model, algo=Capture) as patch:
        caches = [Capture(last=(T - n_queries, T), b=b, layer=i) for i in range(len(patch.sites))]
        for s in range(0, T, 1024):
            mx.eval(model(mx.array(ids[s : s + 1024])[None], cache=caches))
    out = []
    for c in caches:
        k_pre = mx.concatenate(c.k_pre, axis=1)  # [Hkv, T, D]
        k_exact = c.rope(k_pre[None], offset=0)[0]
        out.append((k_pre, k_exact, mx.concatenate(c.q_exact, 1), mx.concatenate(c.q_far, 1)))
    return out


def topk_sets(scores, k):
    return np.argpartition(-scores, k - 1, axis=-1)[..., :k]


def recall(approx, truth, k):
    a, t = topk_sets(approx, k), topk_sets(truth, k)
    hits = [len(set(x) & set(y)) for x, y in zip(a.reshape(-1, k), t.reshape(-1, k))]
    return float(np.mean(hits)) / k


def layer_metrics(book, data, window, sinks, top):
    """Recall against exact and windowed truth, and query-weighted error, for one
    layer's codebook on one segment (query positions are the last ones)."""
    k_pre, k_exact, q_exact, q_far = data
    hkv, T, D = k_pre.shape
    hq, nq, _ = q_exact.shape
    g = hq // hkv
    codes = np.array(assign(k_pre[None], book)[0]).astype(np.int64)  # [Hkv, T]
    cent = np.array(book["centroids"])  # [Hkv, C, D]
    kp, ke = np.array(k_pre), np.array(k_exact)
    qe, qf = (np.array(a).reshape(hkv, g, nq, D) for a in (q_exact, q_far))
    res = {"recall_exact": [], "recall_windowed": [], "error": []}
    for a in range(nq):
        i = T - nq + a
        far = slice(sinks, i - window + 1)
        n = max(1, math.ceil(top * (i + 1)))
        for h in range(hkv):
            kf, kq = kp[h, far], cent[h][codes[h, far]]
            exact = qe[h, :, a] @ ke[h, far].T
            windowed = qf[h, :, a] @ kf.T
            approx = qf[h, :, a] @ kq.T
            res["recall_exact"].append(recall(approx, exact, n))
            res["recall_windowed"].append(recall(approx, windowed, n))
            res["error"].append(((windowed - approx) ** 2).mean() / (windowed**2).mean())
    return {k: float(np.mean(v)) for k, v in res.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--segments", type=int, default=2)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sinks", type=int, default=8)
    ap.add_argument("--top", type=float, default=0.03)
    ap.add_argument("--far-position", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default="scripts/results/smollm2_a2ats_256.safetensors")
    ap.add_argument("--out", default="scripts/results/a2ats_codebook.json")
    args = ap.parse_args()
    info = run_info()
    model, tokenizer = veloxpatch.load()
    b = args.far_position
    t0 = time.perf_counter()
    ids = prose_tokens(tokenizer, args.tokens, "calibration")
    captured = capture(model, ids, b, seed=args.seed)
    print(f"calibration capture: {time.perf_counter() - t0:.0f}s", flush=True)
    segs = [
        segment(model, prose_tokens(tokenizer, args.context, "evaluation", start=s * 20_000), args.queries, b)
        for s in range(args.segments)
    ]
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        for aware in (True, False):
            t0 = time.perf_counter()
            books = [with_norms(layer_codebook(k, q, size, args.seed, aware)) for k, q in captured]
            per_layer = []
            for layer, book in enumerate(books):
                ms = [layer_metrics(book, seg[layer], args.window, args.sinks, args.top) for seg in segs]
                per_layer.append({k: float(np.mean([m[k] for m in ms])) for k in ms[0]})
            mean = {k: float(np.mean([p[k] for p in per_layer])) for k in per_layer[0]}
            rows.append(dict(size=size, query_aware=aware, **mean, per_layer=per_layer))
            print(
                f"size {size:5d} {'query-aware' if aware else 'plain      '} recall(exact) "
                f"{mean['recall_exact']:.3f} recall(windowed) {mean['recall_windowed']:.3f} "
                f"error {mean['error']:.4f} ({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
            if aware and size == 256 and args.save:
                from veloxpatch.codebook import save_codebook

                save_codebook(args.save, books, model, b, dict(tokens=args.tokens, size=size, seed=args.seed))
    write_results(args.out, {"run": info, "config": vars(args), "rows": rows})
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
