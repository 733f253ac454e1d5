"""Decode speed of every algorithm at a long context vs unpatched mlx-lm.

One dense prefill of `--context` prose tokens is captured once and replayed into
each arm's caches (cut into mlx-lm's prefill chunks); then every repeat decodes
`--decode-tokens` greedy tokens through mlx-lm's generate_step from a copy of
each arm's caches, arms interleaved (order rotating), and reports the median
tok/s, the median of per-repeat ratios against unpatched mlx-lm (a plain
KVCache holding the same context), KV bytes held and peak memory.

    .venv/bin/python scripts/bench_decode.py --context 4000 --budget 512
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

from veloxpatch import blas

blas.preload()

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

import veloxpatch  # noqa: E402
from veloxpatch.eval.replay import capture_prefill  # noqa: E402
from veloxpatch.eval.runinfo import run_info, write_results  # noqa: E402
from veloxpatch.eval.text import prose_tokens  # noqa: E402

ALGOS = "full,streaming_llm,knorm,snapkv,pyramidkv,adakv,h2o,tova,keyformer"


def as_mlx_kvcache(cache) -> KVCache:
    """A plain mlx-lm KVCache holding the same rows as a dense veloxpatch cache."""
    kv = KVCache()
    kv.keys, kv.values = cache.keys, cache.values
    kv.offset = cache.rows
    return kv


def decode_rate(model, tail, caches, n):
    steps = generate_step(mx.array(tail), model, max_tokens=n + 1, prompt_cache=caches)
    next(steps)  # the last prompt token
    t0 = time.perf_counter()
    count = sum(1 for _ in steps)
    return count / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--algos", default=ALGOS)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--out", default="scripts/results/bench_decode.json")
    args = ap.parse_args()
    info = run_info()  # the code and machine this run starts with

    model, tokenizer = veloxpatch.load()
    ids = prose_tokens(tokenizer, args.context, start=1000)
    head, tail = ids[:-1], ids[-1:]
    t0 = time.perf_counter()
    captured = capture_prefill(model, head)
    print(f"captured {len(head)}-token prefill in {time.perf_counter() - t0:.0f}s")
    step = args.prefill_step_size
    chunks = [min(step, len(head) - s) for s in range(0, len(head), step)]
    arms = {}
    for algo in args.algos.split(","):
        opts = {} if algo == "full" else {"budget": args.budget}
        arms[algo] = captured.caches(algo, opts, chunks)
    arms = {"unpatched": [as_mlx_kvcache(c) for c in arms["full"]], **arms}

    rates = {a: [] for a in arms}
    kv, peak = {}, {}
    names = list(arms)
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            caches = copy.deepcopy(arms[name])
            mx.reset_peak_memory()
            if name == "unpatched":
                rate = decode_rate(model, tail, caches, args.decode_tokens)
            else:
                with veloxpatch.patched(model, algo="full"):
                    rate = decode_rate(model, tail, caches, args.decode_tokens)
            rates[name].append(rate)
            kv[name] = sum(c.nbytes for c in caches)
            peak[name] = mx.get_peak_memory()
        print(
            f"repeat {r + 1}: " + " ".join(f"{n}={rates[n][-1]:.1f}" for n in names),
            flush=True,
        )

    table = []
    for name in names:
        ratios = [a / b for a, b in zip(rates[name], rates["unpatched"])]
        table.append(
            {
                "arm": name,
                "decode_tok_per_s_median": statistics.median(rates[name]),
                "ratio_vs_unpatched_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "kv_bytes": kv[name],
                "peak_memory_bytes": peak[name],
            }
        )
    result = {"run": info, "config": vars(args), "table": table, "raw": rates}
    write_results(args.out, result)
    print(f"\n{'arm':<14} {'tok/s':>7} {'ratio':>6} {'[min, max]':>14} {'KV MB':>8}")
    for t in table:
        print(
            f"{t['arm']:<14} {t['decode_tok_per_s_median']:7.2f} "
            f"{t['ratio_vs_unpatched_median']:6.2f} "
            f"[{t['ratio_min']:.2f}, {t['ratio_max']:.2f}] {t['kv_bytes'] / 1e6:8.1f}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
