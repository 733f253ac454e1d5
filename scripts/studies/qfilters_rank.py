"""How well does each key-only signal rank keys by the attention they really get?

For `segments` stretches of evaluation prose (`context` tokens each), run the
model once, keep every layer's post-RoPE keys and queries (the frame the caches
score in), and take as ground truth the mean softmax attention each key receives
from the last `later` queries (all query heads of its GQA group). Then, per
layer and KV head, the Spearman rank correlation of that truth with:

  - calibrated Q-Filters (a `veloxpatch calibrate` file: calibration-half prose);
  - on-the-fly Q-Filters (the filter `qfilters` without a file derives at the
    prompt end from the prompt's own queries, read from the real cache);
  - knorm's signal, minus the key's L2 norm.

Keys scored: every key older than the `later` queries except the 4 sinks (every
algorithm keeps those). Averaged over heads, layers and segments.

    .venv/bin/python scripts/studies/qfilters_rank.py \
        --filters scripts/results/smollm2_qfilters.safetensors \
        --out scripts/studies/results/qfilters_rank.json
"""

from __future__ import annotations

import argparse
import statistics

from veloxpatch import blas

blas.preload()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import veloxpatch  # noqa: E402
from model_adapters import adapter_for  # noqa: E402
from veloxpatch.caches.calibration_files import load_filters  # noqa: E402
from veloxpatch.eval.runinfo import run_info, write_results  # noqa: E402
from veloxpatch.probe import run_probe  # noqa: E402
from veloxpatch.prose import prose_length, prose_tokens  # noqa: E402

SINKS = 4


def ranks(x: np.ndarray) -> np.ndarray:
    r = np.empty_like(x, dtype=np.float64)
    r[np.argsort(x, kind="stable")] = np.arange(len(x))
    return r


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def segment(model, ids, later, filters):
    """Per signal: Spearman per (layer, KV head) on one stretch of prose."""
    seen_by_layer = {}  # layer -> (post-RoPE keys, queries, scale)

    def keep(seen):
        seen_by_layer[seen.layer] = (seen.k[0], seen.q[0], seen.scale)

    run_probe(model, ids, keep, chunk=len(ids))
    # the on-the-fly filters: what `qfilters` without a file derives at the
    # prompt end (budget above the length: nothing evicted, only the filter)
    with veloxpatch.patched(model, "qfilters", budget=len(ids) + 2) as patch:
        qf = patch.make_cache()
        mx.eval(model(mx.array(ids)[None], cache=qf))
        patch.end_prompt(qf)
    T = len(ids)
    out = {"calibrated": [], "on_the_fly": [], "knorm": []}
    for layer, (k, q, scale) in sorted(seen_by_layer.items()):
        keys = np.array(k.astype(mx.float32))  # [Hkv, T, D]
        q = np.array(q.astype(mx.float32))  # [Hq, T, D]
        hkv, hq = keys.shape[0], q.shape[0]
        g = hq // hkv
        qs = q[:, T - later :]  # the later queries [Hq, later, D]
        logits = np.einsum("hld,htd->hlt", qs, np.repeat(keys, g, axis=0))
        logits *= scale
        qpos = np.arange(T - later, T)[:, None]
        logits = np.where(np.arange(T)[None, :] <= qpos, logits, -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        truth = p.mean(axis=1).reshape(hkv, g, T).mean(axis=1)  # [Hkv, T]
        scored = slice(SINKS, T - later)
        cal = np.array(filters[layer])
        fly = np.array(qf[layer].filter)
        for h in range(hkv):
            k, t = keys[h, scored], truth[h, scored]
            out["calibrated"].append(spearman(k @ cal[h], t))
            out["on_the_fly"].append(spearman(k @ fly[h], t))
            out["knorm"].append(spearman(-np.linalg.norm(k, axis=-1), t))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--filters", required=True)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--later", type=int, default=128)
    ap.add_argument("--segments", type=int, default=3)
    ap.add_argument("--out", default="scripts/studies/results/qfilters_rank.json")
    args = ap.parse_args()
    info = run_info()
    model, tokenizer = veloxpatch.load(args.model)
    filters = load_filters(args.filters, adapter_for(model).dims(model))
    total = prose_length(tokenizer, "evaluation")
    stride = (total - args.context) // max(1, args.segments - 1)
    per_segment = []
    for s in range(args.segments):
        ids = prose_tokens(tokenizer, args.context, "evaluation", start=s * stride)
        per_segment.append(segment(model, ids, args.later, filters))
        means = {k: statistics.mean(v) for k, v in per_segment[-1].items()}
        print(f"segment {s}: " + ", ".join(f"{k} {v:+.3f}" for k, v in means.items()))
    signals = per_segment[0].keys()
    table = {
        k: {
            "mean_spearman": statistics.mean(x for seg in per_segment for x in seg[k]),
            "share_heads_positive": statistics.mean(
                float(x > 0) for seg in per_segment for x in seg[k]
            ),
        }
        for k in signals
    }
    for k, v in table.items():
        print(
            f"{k:<12} mean Spearman {v['mean_spearman']:+.3f}  "
            f"heads with rho > 0: {v['share_heads_positive']:.2f}"
        )
    write_results(
        args.out,
        {"run": info, "config": vars(args), "table": table, "raw": per_segment},
    )


if __name__ == "__main__":
    main()
