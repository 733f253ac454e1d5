"""Peak memory and time of the attention veloxpatch computes in tiles of
queries against one piece: the probabilities it computes explicitly (each tile
evaluated before the next) and, on the CPU, mlx's fused attention (tiles
chained, `attention_math.fused_attention`).

One layer of SmolLM2's shape (9 query heads, 3 KV heads, head dim 64), random
float32 queries, keys and values, on the CPU. For `h2o` and `keyformer`
(budget 512), `snapkv` (a budget above the prompt: the fused attention alone)
and `kivi` (4 bits: the fused attention over quantized rows, dequantized): a
prompt of `--context` tokens in chunks of `--chunk`, the peak of the last
chunk's call. For `kvzip`'s reconstruction: a context of `--context` rows,
then one repeat chunk of `--chunk` queries scored against it.
`mx.get_peak_memory()` above the memory in use before the call and the call's
seconds, median of `--repeats`, each (arm, mode) in a process of its own.

    .venv/bin/python scripts/bench_attention_tiles.py --context 8192 \\
        --chunk 2048 --out scripts/results/bench_attention_tiles.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

HQ, HKV, D = 9, 3, 64
ARMS = ("h2o", "keyformer", "kvzip", "snapkv", "kivi")
MODES = ("one piece", "tiles")


def peak_of_call(algo: str, tiled: bool, context: int, chunk: int) -> dict:
    from veloxpatch import blas

    blas.preload()
    import mlx.core as mx

    from veloxpatch.caches import ALGORITHMS, attention_math

    if not tiled:
        attention_math.TILE_ELEMENTS = 1 << 62
        attention_math.FUSED_TILE_ELEMENTS = 1 << 62
    cls = ALGORITHMS[algo]
    mx.random.seed(0)

    def rows(n, heads=HKV):
        return mx.random.normal((1, heads, n, D))

    def rope(t, offset=0):
        return t

    if algo == "kvzip":
        cache = cls(cls.Options(budget=512, sinks=4))
        cache.score_prompt = False
        k, v = rows(context), rows(context)
        mx.eval(cache.attend(rows(context, HQ), k, v, rope=rope, scale=D**-0.5))
        cache.repeat = (0, min(chunk, context))
        calls = [chunk]
    else:
        if algo == "snapkv":
            opts = cls.Options(budget=2 * context)
        elif algo == "kivi":
            opts = cls.Options(bits=4)
        else:
            opts = cls.Options(budget=512, sinks=4, recent=64)
        cache = cls(opts)
        calls = [chunk] * (context // chunk)
    for n in calls:
        q, k, v = rows(n, HQ), rows(n), rows(n)
        mx.eval(q, k, v)
        against = n + (cache.offset and cache.positions_view().shape[-1])
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        start = time.perf_counter()
        out = cache.attend(q, k, v, rope=rope, scale=D**-0.5)
        mx.eval(out, *cache.side_arrays())
        mx.synchronize()
        seconds = time.perf_counter() - start
        peak = mx.get_peak_memory() - before
    return {
        "peak_bytes": peak,
        "seconds": seconds,
        "rows_against": against,
        "queries": calls[-1],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="scripts/results/bench_attention_tiles.json")
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        algo, mode = args.child
        print(json.dumps(peak_of_call(algo, mode == "tiles", args.context, args.chunk)))
        return

    from veloxpatch import blas

    blas.preload()  # the run line names the BLAS the children load
    from veloxpatch.eval.runinfo import run_info, write_results

    rows = []
    for algo in ARMS:
        for mode in MODES:
            peaks, seconds = [], []
            for _ in range(args.repeats):
                cmd = [sys.executable, __file__, "--child", algo, mode]
                cmd += ["--context", str(args.context), "--chunk", str(args.chunk)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True)
                got = json.loads(out.stdout.strip().splitlines()[-1])
                peaks.append(got["peak_bytes"])
                seconds.append(got["seconds"])
            row = {"arm": algo, "mode": mode, **got}
            row["peak_bytes"] = statistics.median(peaks)
            row["seconds"] = statistics.median(seconds)
            row["peaks"], row["all_seconds"] = peaks, seconds
            rows.append(row)
            print(
                f"{algo:<10} {mode:<10} peak {row['peak_bytes'] / 1e6:8.1f} MB"
                f"  {row['seconds']:6.3f} s"
            )
    config = {"context": args.context, "chunk": args.chunk, "repeats": args.repeats}
    config["out"] = args.out
    write_results(args.out, {"run": run_info(), "config": config, "rows": rows})
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
