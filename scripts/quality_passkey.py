"""Passkey retrieval accuracy (Wilson 95% intervals) for algorithms x budgets.

A five-digit key hidden at depths spread over 5-95% of evaluation-half prose,
the question at the end, chat template. Each case is prefilled once and replayed
into every arm (exact for prompts within one prefill chunk, see eval/replay.py).
Algorithms that stay under 90% of `full` at every listed budget are retried at
the `--search` budgets, in order, to find the smallest budget that reaches it.

    .venv/bin/python scripts/quality_passkey.py --arms snapkv,adakv \
        --budgets 128,256,512 --cases 30 --out scripts/results/passkey.json
"""

from __future__ import annotations

import argparse
import time

from veloxpatch import blas

blas.preload()

import veloxpatch  # noqa: E402
from veloxpatch.eval.arms import expand, split_arms  # noqa: E402
from veloxpatch.eval.metrics import Arm  # noqa: E402
from veloxpatch.eval.passkey import make_cases  # noqa: E402
from veloxpatch.eval.runinfo import run_info, write_results  # noqa: E402
from veloxpatch.eval.runner import run_case, smallest_budget, summarize  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--arms", default="snapkv,pyramidkv,adakv,h2o,tova,keyformer")
    ap.add_argument("--budgets", default="128,256,512")
    ap.add_argument("--search", default="", help="budgets to try upward, e.g. 768,1024")
    ap.add_argument("--cases", type=int, default=30)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument(
        "--decode-lead-in",
        action="store_true",
        help="end the prompt at the question and feed the answer's lead-in "
        "('The secret number is') as answer tokens, so lookahead compresses "
        "before the first digit is predicted",
    )
    ap.add_argument("--out", default="scripts/results/passkey.json")
    args = ap.parse_args()
    info = run_info()  # the code and machine this run starts with

    model, tokenizer = veloxpatch.load(args.model)
    cases = make_cases(tokenizer, args.cases, args.context, seed=args.seed)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    arms = [Arm("full")] + expand(split_arms(args.arms), budgets)
    rows, t0 = [], time.perf_counter()
    for i, case in enumerate(cases):
        rows += run_case(
            model,
            tokenizer,
            case,
            arms,
            args.prefill_step_size,
            decode_lead_in=args.decode_lead_in,
        )
        done = [r for r in rows if r["seed"] == case.seed]
        print(
            f"case {i + 1}/{len(cases)} depth {case.depth:.2f} "
            f"({time.perf_counter() - t0:.0f}s): "
            + " ".join(f"{r['arm']}={'Y' if r['correct'] else '.'}" for r in done),
            flush=True,
        )
    table = summarize(rows, arms)
    full_acc = table[0]["accuracy"]

    for extra in [int(b) for b in args.search.split(",") if b]:
        families = sorted({a.family for a in arms if a.algo != "full"})
        missing = [f for f in families if smallest_budget(table, f, full_acc) is None]
        if not missing:
            break
        more = [
            Arm(a.algo, {**a.options, "budget": extra})
            for a in arms
            if a.family in missing and a.options.get("budget") == budgets[-1]
        ]
        print(f"search: budget {extra} for {', '.join(missing)}", flush=True)
        for case in cases:
            rows += run_case(
                model,
                tokenizer,
                case,
                more,
                args.prefill_step_size,
                decode_lead_in=args.decode_lead_in,
            )
        arms += more
        table = summarize(rows, arms)

    families = sorted({a.family for a in arms if a.algo != "full"})
    needed = {f: smallest_budget(table, f, full_acc) for f in families}
    result = {
        "run": info,
        "config": vars(args),
        "table": table,
        "smallest_budget_for_90pct_of_full": needed,
        "raw": rows,
    }
    write_results(args.out, result)
    print(f"\n{'arm':<40} {'acc':>5} {'k/n':>7}  wilson95      KV MB")
    for t in table:
        lo, hi = t["wilson95"]
        print(
            f"{t['arm']:<40} {t['accuracy']:5.2f} {t['correct']:>3}/{t['cases']:<3}"
            f"  [{lo:.2f}, {hi:.2f}]  {t['kv_mb']:6.2f}"
        )
    print("smallest budget keeping 90% of full:", needed)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
