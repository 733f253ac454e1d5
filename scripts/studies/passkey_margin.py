"""How close to the edge agnostic passkey answers are: each question's answer
(" " and the five digits) teacher-forced one token per call, as greedy decoding
reads it, on each arm's compressed context. Per answer: its NLL and its margin,
the least over the digits of (the right token's logit - the best other's). A
miss is a margin below 0 somewhere; a margin is continuous, so arms that miss
equally rarely still differ in how near they come, paired case by case with
full, on far fewer cases than pass rates need.

    .venv/bin/python scripts/studies/passkey_margin.py --seeds 42-51 \\
        --arms "kivi:bits=2;kivi:bits=2,key_bits=3,..." \\
        --out scripts/studies/results/passkey_margin.json

Arms are separated by ";" (their options by ","). Full runs with them; cases
are those of `veloxpatch eval --tasks passkey --protocol agnostic --cases 10
--seed <seed>`, every one of `--seeds` or those `--cases 59:2,63:5` names.
"""

from __future__ import annotations

import argparse
import statistics

from veloxpatch import blas

blas.preload()

import mlx.core as mx  # noqa: E402
from passkey_recheck import (  # noqa: E402
    add_arguments,
    case_list,
    chosen_cases,
    model_and_arms,
)

from veloxpatch.context import copy_cache  # noqa: E402
from veloxpatch.eval.agnostic import compressed  # noqa: E402
from veloxpatch.eval.passkey import paired_interval  # noqa: E402
from veloxpatch.eval.runinfo import run_info, write_results  # noqa: E402


def answer_margin(model, question, target, caches) -> tuple[float, float]:
    """(NLL, margin) of `target` after `question` on `caches`: the question's
    rows in one call, then one token per call, as mlx-lm's generate_step."""
    if len(question) > 1:
        model(mx.array([question[:-1]]), cache=caches)
    nll, margin = 0.0, float("inf")
    for prev, want in zip([question[-1]] + target[:-1], target):
        logits = model(mx.array([[prev]]), cache=caches)[0, -1].astype(mx.float32)
        logp = logits - mx.logsumexp(logits)
        right = logits[want]
        other = mx.max(mx.where(mx.arange(logits.shape[0]) == want, -mx.inf, logits))
        mx.eval(logp, right, other)
        nll -= logp[want].item()
        margin = min(margin, (right - other).item())
    return nll, margin


def case_rows(model, tokenizer, case, arms) -> list[dict]:
    rows = []
    for arm, caches, _, _ in compressed(model, tokenizer, case, arms):
        rows += answer_rows(model, tokenizer, case, arm.label, caches)
    return rows


def answer_rows(model, tokenizer, case, label: str, caches) -> list[dict]:
    """Each question of `case` answered on a copy of `caches`: its row."""
    target = tokenizer.encode(" " + case.key, add_special_tokens=False)
    rows = []
    for i, q in enumerate(case.questions):
        nll, margin = answer_margin(model, q, target, copy_cache(caches))
        rows.append({"arm": label, "question": i, "nll": nll, "margin": margin})
    return rows


def summary(raw: list[dict]) -> list[dict]:
    """Per arm: misses (margin < 0), mean NLL and margin, and the mean paired
    differences against full on the same answers."""
    full = {(r["case"], r["question"]): r for r in raw if r["arm"] == "full"}
    table = []
    for arm in dict.fromkeys(r["arm"] for r in raw):
        rows = [r for r in raw if r["arm"] == arm]
        d_nll = [r["nll"] - full[r["case"], r["question"]]["nll"] for r in rows]
        d_margin = [
            r["margin"] - full[r["case"], r["question"]]["margin"] for r in rows
        ]
        table.append(
            {
                "arm": arm,
                "answers": len(rows),
                "misses": sum(r["margin"] < 0 for r in rows),
                "nll": statistics.fmean(r["nll"] for r in rows),
                "margin_median": statistics.median(r["margin"] for r in rows),
                "nll_minus_full": statistics.fmean(d_nll),
                "nll_minus_full_ci": paired_interval(d_nll),
                "margin_minus_full": statistics.fmean(d_margin),
                "margin_minus_full_ci": paired_interval(d_margin),
            }
        )
    return table


def add_case_arguments(ap: argparse.ArgumentParser, seeds: str) -> None:
    """Which cases: every case of `--seeds`, or the `--cases` named."""
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--seeds", help=f"first-last, as {seeds}")
    which.add_argument("--cases", type=case_list, help="seed:index,..., as 59:2")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_arguments(ap, "42-51")
    add_arguments(ap, "scripts/studies/results/passkey_margin.json")
    args = ap.parse_args()
    model, tokenizer, arms = model_and_arms(args)
    run_seeds(args, tokenizer, lambda case: case_rows(model, tokenizer, case, arms))


def run_seeds(args, tokenizer, rows_of) -> None:
    """Every chosen case (`chosen_cases`) through `rows_of(case)` (its answers'
    rows), each row printed as it comes; the results file at `args.out`."""
    raw = []
    for name, case in chosen_cases(tokenizer, args):
        for row in rows_of(case):
            raw.append(row | {"case": name})
            print(
                row["arm"],
                name,
                row["question"],
                f"{row['nll']:.3f} {row['margin']:.2f}",
                flush=True,
            )
    write_results(
        args.out,
        {"run": run_info(), "config": vars(args), "table": summary(raw), "raw": raw},
    )


if __name__ == "__main__":
    main()
