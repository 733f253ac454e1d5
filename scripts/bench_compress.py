"""What compressing a context costs: `Patch.prefill` time per algorithm against
the same context's plain prefill (`full`), medians of interleaved repeats; the
compression pass alone is the difference (kvzip: its reconstruction, at three
chunk sizes).

    .venv/bin/python scripts/bench_compress.py --contexts 1000,2000 --repeats 3 \
        --out scripts/results/bench_compress.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from veloxpatch import blas

blas.preload()

import mlx.core as mx  # noqa: E402

import veloxpatch  # noqa: E402
from veloxpatch.eval.runinfo import run_info, write_results  # noqa: E402
from veloxpatch.prose import prose_tokens  # noqa: E402

ARMS = {
    "full": {},
    "snapkv": dict(budget=256),
    "expected_attention": dict(budget=256),
    "kvzip": dict(budget=256),
    "kvzip:chunk=1024": dict(budget=256, chunk=1024),
    "kvzip:chunk=512": dict(budget=256, chunk=512),
}


def once(model, tokenizer, arm, options, ids) -> float:
    with veloxpatch.patched(model, arm.split(":")[0], **options) as patch:
        start = time.perf_counter()
        caches = patch.prefill(ids, tokenizer=tokenizer)
        mx.eval([c.state for c in caches])
        return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1000,2000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="scripts/results/bench_compress.json")
    args = ap.parse_args()
    info = run_info()
    model, tokenizer = veloxpatch.load()
    rows = []
    for n in [int(x) for x in args.contexts.split(",")]:
        ids = prose_tokens(tokenizer, n, "evaluation")
        once(model, tokenizer, "full", {}, ids[:64])  # warm-up
        times = {a: [] for a in ARMS}
        for _ in range(args.repeats):  # interleaved, so drift hits every arm
            for algo, options in ARMS.items():
                times[algo].append(once(model, tokenizer, algo, options, ids))
        base = statistics.median(times["full"])
        for algo, t in times.items():
            med = statistics.median(t)
            rows.append(
                {
                    "context": n,
                    "arm": algo,
                    "options": ARMS[algo],
                    "seconds": t,
                    "median_s": med,
                    "vs_full_prefill": med / base,
                    "pass_vs_prefill": (med - base) / base,
                }
            )
            print(f"{n:>6} {algo:<20} {med:6.2f} s  {med / base:5.2f}x", flush=True)
    write_results(args.out, {"run": info, "config": vars(args), "table": rows})


if __name__ == "__main__":
    main()
