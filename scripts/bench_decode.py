"""Decode speed of every algorithm at a long context vs unpatched mlx-lm.

One dense prefill of `--context` prose tokens is captured once and replayed into
each arm's caches (cut into mlx-lm's prefill chunks); then every repeat decodes
`--decode-tokens` greedy tokens through mlx-lm's generate_step from a copy of
each arm's caches, arms interleaved (order rotating), and reports the median
tok/s, the median of per-repeat ratios against unpatched mlx-lm (a plain
KVCache holding the same context), KV bytes held and peak memory. The rate of
the first `--early` tokens is reported apart from the rest (lookahead arms hold
the whole prompt until then). Arms are written `NAME[:key=value,...]`; an arm
without a budget gets `--budget`. `--baseline ARM` adds each arm's median of
per-repeat ratios against that arm (e.g. a rotated cache against the same bits
unrotated).

    .venv/bin/python scripts/bench_decode.py --context 4000 --budget 512 \
        --arms full,snapkv,snapkv:lookahead=16
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
from veloxpatch.api import make_options  # noqa: E402
from veloxpatch.eval.arms import expand, split_arms  # noqa: E402
from veloxpatch.eval.replay import capture_prefill  # noqa: E402
from veloxpatch.eval.runinfo import run_info, write_results  # noqa: E402
from veloxpatch.prose import prose_tokens  # noqa: E402

ALGOS = "full,streaming_llm,knorm,snapkv,pyramidkv,adakv,h2o,tova,keyformer"


def as_mlx_kvcache(cache) -> KVCache:
    """A plain mlx-lm KVCache holding the same rows as a dense veloxpatch cache."""
    kv = KVCache()
    kv.keys, kv.values = cache.keys, cache.values
    kv.offset = cache.rows
    return kv


def decode_times(model, tail, caches, n) -> list[float]:
    """Seconds per decoded token (mlx-lm computes one step ahead, so the time
    between two yields is one decode step)."""
    steps = generate_step(mx.array(tail), model, max_tokens=n + 1, prompt_cache=caches)
    next(steps)  # the last prompt token
    times, t0 = [], time.perf_counter()
    for _ in steps:
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    return times


def write_markdown(out, res: dict):
    """The run's table beside its results file (`.md`)."""
    from results_markdown import mb, table, write_beside

    rows = [
        [
            f"`{r['arm']}`",
            f"{r['decode_tok_per_s_median']:.2f}",
            f"{r['ratio_vs_unpatched_median']:.2f} "
            f"[{r['ratio_min']:.2f}, {r['ratio_max']:.2f}]",
            mb(r.get("kv_bytes")),
        ]
        for r in res["table"]
    ]
    head = ["arm", "tok/s", "vs unpatched [min, max]", "KV MB"]
    body = table(head, rows)
    title = "Decode speed against unpatched mlx-lm"
    return write_beside(out, res, title, body, f"{PY} scripts/bench_decode.py")


PY = ".venv/bin/python"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--arms", "--algos", dest="arms", default=ALGOS)
    ap.add_argument("--early", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--baseline", default=None, help="an arm to compare with")
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
    arms, specs = {}, {}
    for arm in expand(["full"] + split_arms(args.arms), [args.budget]):
        # bound to the model: calibration files (filters, codebooks) are loaded
        _, bound = make_options(arm.algo, arm.options, model)
        arms[arm.label] = captured.caches(arm.algo, arm.options, chunks, bound=bound)
        specs[arm.label] = arm
    arms = {"unpatched": [as_mlx_kvcache(c) for c in arms["full"]], **arms}
    if args.baseline and args.baseline not in arms:
        raise SystemExit(f"--baseline {args.baseline!r} is none of: {', '.join(arms)}")

    rates = {a: [] for a in arms}
    early, late = {a: [] for a in arms}, {a: [] for a in arms}
    kv, peak = {}, {}
    names = list(arms)
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            caches = copy.deepcopy(arms[name])
            mx.reset_peak_memory()
            if name == "unpatched":
                times = decode_times(model, tail, caches, args.decode_tokens)
            else:
                spec = specs[name]  # patched as the caches were made
                with veloxpatch.patched(model, algo=spec.algo, **spec.options):
                    times = decode_times(model, tail, caches, args.decode_tokens)
            rates[name].append(len(times) / sum(times))
            e = args.early
            early[name].append(len(times[:e]) / sum(times[:e]))
            late[name].append(len(times[e:]) / max(sum(times[e:]), 1e-9))
            kv[name] = sum(c.nbytes for c in caches)
            peak[name] = mx.get_peak_memory()
        print(
            f"repeat {r + 1}: " + " ".join(f"{n}={rates[n][-1]:.1f}" for n in names),
            flush=True,
        )

    table = []
    for name in names:
        ratios = [a / b for a, b in zip(rates[name], rates["unpatched"])]
        row = {}
        if args.baseline:
            vs = [a / b for a, b in zip(rates[name], rates[args.baseline])]
            row = {
                "ratio_vs_baseline_median": statistics.median(vs),
                "ratio_vs_baseline_min": min(vs),
                "ratio_vs_baseline_max": max(vs),
            }
        table.append(
            {
                "arm": name,
                "decode_tok_per_s_median": statistics.median(rates[name]),
                "ratio_vs_unpatched_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "early_tok_per_s_median": statistics.median(early[name]),
                "late_tok_per_s_median": statistics.median(late[name]),
                "kv_bytes": kv[name],
                "peak_memory_bytes": peak[name],
                **row,
            }
        )
    raw = {"rates": rates, "early": early, "late": late}
    result = {"run": info, "config": vars(args), "table": table, "raw": raw}
    write_results(args.out, result)
    write_markdown(args.out, result)
    print(
        f"\n{'arm':<30} {'tok/s':>7} {'ratio':>6} {'[min, max]':>14} "
        f"{'early':>6} {'late':>6} {'KV MB':>8}"
    )
    for t in table:
        print(
            f"{t['arm']:<30} {t['decode_tok_per_s_median']:7.2f} "
            f"{t['ratio_vs_unpatched_median']:6.2f} "
            f"[{t['ratio_min']:.2f}, {t['ratio_max']:.2f}] "
            f"{t['early_tok_per_s_median']:6.2f} {t['late_tok_per_s_median']:6.2f} "
            f"{t['kv_bytes'] / 1e6:8.1f}"
            + (
                f"  vs {args.baseline}: {t['ratio_vs_baseline_median']:.2f} "
                f"[{t['ratio_vs_baseline_min']:.2f}, {t['ratio_vs_baseline_max']:.2f}]"
                if args.baseline
                else ""
            )
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
