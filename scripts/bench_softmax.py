"""The exponential on mlx's CPU backend, and what it costs attention: mlx's exp
against numpy's on the same floats, mlx's softmax against the one scoring uses
(`veloxpatch.caches.attention_math.softmax`, numpy's exp on the CPU) on one
tile of kvzip's reconstruction (SmolLM2's 3 KV heads x 3 query heads, 164
queries over 2,830 rows), and one layer's prefill attention of a 512-token
chunk over 2,000 rows: mlx's fused kernel (what unpatched mlx-lm runs) against
the same attention written out with that softmax. Medians of interleaved
repeats.

    .venv/bin/python scripts/bench_softmax.py --repeats 7 \\
        --out scripts/results/bench_softmax.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from veloxpatch import blas

blas.preload()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from veloxpatch.caches.attention_math import softmax  # noqa: E402
from veloxpatch.eval.runinfo import run_info, write_results  # noqa: E402

HEADS, REP, DIM = 3, 3, 64
TILE = (164, 2830)  # queries, rows: one tile of a 1,412-token reconstruction
CHUNK = (512, 2000)  # queries, rows: a prefill chunk late in a 2,000-token prompt


def per_call_ms(f, n: int) -> float:
    f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n * 1e3


def attention_with(q, k, v, probs_of):
    """Causal attention of the newest q.shape[2] rows, softmax by `probs_of`."""
    L, T = q.shape[2], k.shape[2]
    logits = q.reshape(1, HEADS, REP * L, DIM) @ k.swapaxes(-1, -2) * DIM**-0.5
    visible = mx.arange(T)[None] <= mx.arange(T - L, T)[:, None]  # [L, T]
    logits = mx.where(visible, logits.reshape(1, HEADS, REP, L, T), -mx.inf)
    p = probs_of(logits).reshape(1, HEADS, REP * L, T)
    return (p @ v).reshape(1, HEADS * REP, L, DIM)


def cases() -> dict:
    """name -> a function computing it once (evaluated)."""
    mx.random.seed(0)
    x = mx.random.normal((1, HEADS, REP, *TILE))
    xn = np.array(x)
    L, T = CHUNK
    q = mx.random.normal((1, HEADS * REP, L, DIM))
    k, v = mx.random.normal((2, 1, HEADS, T, DIM))
    mx.eval(x, q, k, v)

    def mlx_softmax(t):
        return mx.softmax(t, axis=-1)

    return {
        "exp, mlx": lambda: mx.eval(mx.exp(x)),
        "exp, numpy": lambda: np.exp(xn),
        "softmax of a tile, mlx": lambda: mx.eval(mlx_softmax(x)),
        "softmax of a tile, attention_math": lambda: mx.eval(softmax(x)),
        "prefill chunk attention, mlx fused": lambda: mx.eval(
            mx.fast.scaled_dot_product_attention(
                q, k, v, scale=DIM**-0.5, mask="causal"
            )
        ),
        "prefill chunk attention, mlx softmax": lambda: mx.eval(
            attention_with(q, k, v, mlx_softmax)
        ),
        "prefill chunk attention, attention_math softmax": lambda: mx.eval(
            attention_with(q, k, v, softmax)
        ),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="scripts/results/bench_softmax.json")
    args = ap.parse_args()
    info = run_info()
    funcs = cases()
    times = {name: [] for name in funcs}
    for _ in range(args.repeats):  # interleaved, so drift hits every case
        for name, f in funcs.items():
            times[name].append(per_call_ms(f, args.calls))
    rows = []
    for name, t in times.items():
        rows.append({"case": name, "ms": t, "median_ms": statistics.median(t)})
        print(f"{name:<48} {rows[-1]['median_ms']:8.1f} ms", flush=True)
    config = vars(args) | {"tile": TILE, "chunk": CHUNK}
    write_results(args.out, {"run": info, "config": config, "table": rows})


if __name__ == "__main__":
    main()
