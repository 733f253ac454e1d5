"""Overhead of the patch: unpatched mlx-lm vs patched `full` on SmolLM2.

Paired and interleaved: every repeat runs both arms back to back (alternating
which goes first) through mlx-lm's own generate_step, so drift in machine speed
hits both. Reports the median of the per-pair ratios patched/unpatched.

    .venv/bin/python scripts/bench_overhead.py [--repeats 7] [--prompt-tokens 1000]
"""

from __future__ import annotations

import argparse
import statistics
import time

from veloxpatch import blas

blas.preload()

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import veloxpatch  # noqa: E402
from veloxpatch.eval.runinfo import run_info, write_results  # noqa: E402
from veloxpatch.prose import prose_tokens  # noqa: E402


def timed_generation(model, prompt, max_tokens, prefill_step_size):
    """(prefill tok/s, decode tok/s) of one greedy generation."""
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    steps = generate_step(
        prompt,
        model,
        max_tokens=max_tokens,
        prompt_cache=cache,
        prefill_step_size=prefill_step_size,
    )
    next(steps)  # the first token: the whole prompt has been processed
    t1 = time.perf_counter()
    n = 1
    for _ in steps:
        n += 1
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), (n - 1) / (t2 - t1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--out", default="scripts/results/bench_overhead.json")
    args = ap.parse_args()
    info = run_info()  # the code and machine this run starts with

    model, tokenizer = veloxpatch.load()
    prompt = mx.array(prose_tokens(tokenizer, args.prompt_tokens))
    patch = veloxpatch.apply(model, algo="full")
    patch.restore()

    def run(arm):
        if arm == "patched_full":
            with veloxpatch.patched(model, algo="full"):
                return timed_generation(
                    model, prompt, args.decode_tokens, args.prefill_step_size
                )
        return timed_generation(
            model, prompt, args.decode_tokens, args.prefill_step_size
        )

    arms = ["unpatched", "patched_full"]
    for arm in arms:  # warm-up, not counted
        run(arm)
    raw = {arm: [] for arm in arms}
    for r in range(args.repeats):
        order = arms if r % 2 == 0 else arms[::-1]
        for arm in order:
            raw[arm].append(run(arm))
        print(
            f"repeat {r + 1}/{args.repeats}: "
            + ", ".join(
                f"{a} prefill {raw[a][-1][0]:.1f} decode {raw[a][-1][1]:.1f} tok/s"
                for a in arms
            )
        )

    def summary(values):
        return {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
        }

    result = {"run": info, "config": vars(args), "raw_tok_per_s": raw}
    for i, phase in enumerate(("prefill", "decode")):
        ratios = [p[i] / u[i] for p, u in zip(raw["patched_full"], raw["unpatched"])]
        result[phase] = {
            "unpatched_tok_per_s": summary([x[i] for x in raw["unpatched"]]),
            "patched_full_tok_per_s": summary([x[i] for x in raw["patched_full"]]),
            "ratio_patched_over_unpatched": summary(ratios),
        }
        rs = result[phase]["ratio_patched_over_unpatched"]
        print(
            f"{phase}: ratio median {rs['median']:.3f} "
            f"(min {rs['min']:.3f}, max {rs['max']:.3f})"
        )
    write_results(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
