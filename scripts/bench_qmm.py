"""One layer's decode attention on mlx's quantized kernels, per bit width: the
time of q . K^T and p . V on KIVI's layout (keys transposed and quantized along
tokens, values along channels, both `transpose=False`) against the dense
matmuls and the fused kernel unpatched mlx-lm decodes with. SmolLM2's shape:
3 KV heads, 3 query heads per KV head, head dim 64, float32; medians of
interleaved repeats.

Then the same two products for more query rows per KV head (`--rows`: the
query heads sharing a KV head times the call's queries) against dequantizing
the rows once and multiplying densely: mlx's quantized kernels on the CPU are
linear in query rows, so past a few rows the dense copy is faster
(`qview.CPU_DENSE_ROWS`).

    .venv/bin/python scripts/bench_qmm.py --tokens 4096 --repeats 5 \
        --out scripts/results/bench_qmm.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from veloxpatch import blas

blas.preload()

import mlx.core as mx  # noqa: E402

from veloxpatch.eval.runinfo import run_info, write_results  # noqa: E402

HEADS, REP, DIM = 3, 3, 64


def per_call_ms(f, n: int) -> float:
    for _ in range(5):
        mx.eval(f())
    start = time.perf_counter()
    for _ in range(n):
        mx.eval(f())
    return (time.perf_counter() - start) / n * 1e3


def kernels(tokens: int, group: int) -> dict:
    """name -> a function computing it once, on fresh random inputs."""
    mx.random.seed(0)
    q = mx.random.normal((1, HEADS, REP, DIM))
    k = mx.random.normal((1, HEADS, tokens, DIM))
    v = mx.random.normal((1, HEADS, tokens, DIM))
    p = mx.softmax(mx.random.normal((1, HEADS, REP, tokens)), axis=-1)
    qf = q.reshape(1, HEADS * REP, 1, DIM)
    out = {
        "dense q.K^T + p.V": lambda: (q @ k.swapaxes(-1, -2), p @ v),
        "fused attention (unpatched)": lambda: mx.fast.scaled_dot_product_attention(
            qf, k, v, scale=DIM**-0.5
        ),
    }
    for bits in (2, 3, 4, 8):
        kq = mx.quantize(k.swapaxes(-1, -2), group_size=group, bits=bits)
        vq = mx.quantize(v, group_size=group, bits=bits)

        def both(kq=kq, vq=vq, bits=bits):
            opts = dict(transpose=False, group_size=group, bits=bits)
            return mx.quantized_matmul(q, *kq, **opts), mx.quantized_matmul(
                p, *vq, **opts
            )

        out[f"{bits}-bit q.K^T + p.V"] = both
    return out


def crossover(tokens: int, group: int, rows: int, bits: int) -> dict:
    """Both products of `rows` query rows per KV head: on the quantized rows,
    and dequantized first (as `qview.QuantizedView` does past CPU_DENSE_ROWS)."""
    mx.random.seed(rows)
    q = mx.random.normal((1, HEADS, rows, DIM))
    p = mx.softmax(mx.random.normal((1, HEADS, rows, tokens)), axis=-1)
    k = mx.random.normal((1, HEADS, tokens, DIM))
    v = mx.random.normal((1, HEADS, tokens, DIM))
    kq = mx.quantize(k.swapaxes(-1, -2), group_size=group, bits=bits)
    vq = mx.quantize(v, group_size=group, bits=bits)
    opts = dict(group_size=group, bits=bits)

    def quantized():
        return mx.quantized_matmul(
            q, *kq, transpose=False, **opts
        ), mx.quantized_matmul(p, *vq, transpose=False, **opts)

    def dense():
        dk, dv = mx.dequantize(*kq, **opts), mx.dequantize(*vq, **opts)
        return q @ dk, p @ dv

    return {"quantized": quantized, "dequantized": dense}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", default="3,6,9,18,48,144")
    ap.add_argument("--rows-calls", type=int, default=20)
    ap.add_argument("--out", default="scripts/results/bench_qmm.json")
    args = ap.parse_args()
    info = run_info()
    funcs = kernels(args.tokens, args.group)
    times = {name: [] for name in funcs}
    for _ in range(args.repeats):  # interleaved, so drift hits every kernel
        for name, f in funcs.items():
            times[name].append(per_call_ms(f, args.calls))
    base = statistics.median(times["fused attention (unpatched)"])
    rows = []
    for name, t in times.items():
        med = statistics.median(t)
        rows.append({"kernel": name, "ms": t, "median_ms": med, "vs_fused": med / base})
        print(f"{name:<30} {med:7.3f} ms  {med / base:5.2f}x", flush=True)
    sweep = []
    for n in (int(r) for r in args.rows.split(",")):
        for bits in (2, 3, 4):
            funcs = crossover(args.tokens, args.group, n, bits)
            times = {name: [] for name in funcs}
            for _ in range(args.repeats):
                for name, f in funcs.items():
                    times[name].append(per_call_ms(f, args.rows_calls))
            row = {"rows": n, "bits": bits}
            for name, t in times.items():
                row[f"{name}_ms"] = statistics.median(t)
            sweep.append(row)
            print(
                f"{n:4d} rows {bits}-bit  quantized {row['quantized_ms']:8.3f} ms"
                f"  dequantized {row['dequantized_ms']:8.3f} ms",
                flush=True,
            )
    out = {"run": info, "config": vars(args), "table": rows, "rows_sweep": sweep}
    write_results(args.out, out)


if __name__ == "__main__":
    main()
