"""Perplexity, greedy agreement and KL of a continuation after a compressed context.

On the embedded SmolLM2 by default: `segments` stretches of evaluation-half prose,
each a `context`-token context followed by a `continuation`-token continuation fed
one token per call (so decode-time eviction happens as in generation).

    .venv/bin/python scripts/quality_ppl.py --arms full,streaming_llm,knorm \
        --budgets 256,512,1024 --out scripts/results/ppl_core.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from veloxpatch import blas

blas.preload()

import veloxpatch  # noqa: E402
from veloxpatch.eval.arms import expand, split_arms  # noqa: E402
from veloxpatch.eval.metrics import evaluate_continuation  # noqa: E402
from veloxpatch.eval.runinfo import run_info, write_results  # noqa: E402
from veloxpatch.eval.text import prose_tokens  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--arms", default="full,streaming_llm,knorm")
    ap.add_argument("--budgets", default="256,512,1024")
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--segments", type=int, default=2)
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--out", default="scripts/results/ppl.json")
    args = ap.parse_args()
    info = run_info()  # the code and machine this run starts with

    budgets = [int(b) for b in args.budgets.split(",") if b]
    arms = expand(split_arms(args.arms), budgets)
    model, tokenizer = veloxpatch.load(args.model)
    span = args.context + args.continuation
    rows = []
    for seg in range(args.segments):
        ids = prose_tokens(tokenizer, span, "evaluation", start=seg * 20_000)
        context, cont = ids[: args.context], ids[args.context :]
        t0 = time.perf_counter()
        for res in evaluate_continuation(
            model, arms, context, cont, args.prefill_step_size
        ):
            row = {"segment": seg, **res.as_dict()}
            rows.append(row)
            print(
                f"seg {seg} {res.arm:<28} ppl {res.perplexity:8.3f} "
                f"agree {res.agreement:.3f} kl {res.kl:.4f} kv {res.kv_bytes:,}",
                flush=True,
            )
        print(f"segment {seg} took {time.perf_counter() - t0:.0f}s", flush=True)

    table = []
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm.label]
        table.append(
            {
                "arm": arm.label,
                "perplexity_mean": statistics.mean(r["perplexity"] for r in mine),
                "perplexity_per_segment": [r["perplexity"] for r in mine],
                "agreement_mean": statistics.mean(r["agreement"] for r in mine),
                "kl_mean": statistics.mean(r["kl"] for r in mine),
                "kv_bytes": mine[0]["kv_bytes"],
            }
        )
    result = {"run": info, "config": vars(args), "table": table, "raw": rows}
    write_results(args.out, result)
    print(f"\n{'arm':<28} {'ppl':>8} {'agree':>6} {'KL':>7} {'KV bytes':>12}")
    for t in table:
        print(
            f"{t['arm']:<28} {t['perplexity_mean']:8.3f} {t['agreement_mean']:6.3f} "
            f"{t['kl_mean']:7.4f} {t['kv_bytes']:12,}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
