"""Chosen agnostic passkey cases asked again with other arms: which side of a
quantized cache (keys or values) a miss comes from. A case is `seed:index`,
the index-th of the ten cases `veloxpatch eval --tasks passkey --protocol
agnostic --cases 10 --seed <seed>` builds (its context, depth and number).

    .venv/bin/python scripts/studies/passkey_recheck.py \\
        --cases 18:0,23:0,23:1,27:8,11:0 \\
        --arms "kivi:bits=2;..." \\
        --out scripts/studies/results/passkey_key_side.json

Arms are separated by ";" (their options by ","). Full runs with them.
"""

from __future__ import annotations

import argparse

from veloxpatch import blas

blas.preload()

from veloxpatch.eval.agnostic import run_agnostic_case  # noqa: E402
from veloxpatch.eval.arms import Arm, bind_to, parse_arm  # noqa: E402
from veloxpatch.eval.passkey import make_cases  # noqa: E402
from veloxpatch.eval.runinfo import run_info, write_results  # noqa: E402
from veloxpatch.loading.models import load  # noqa: E402

CASES_PER_SEED = 10  # as the eval runs the seeds rechecked


def add_arguments(ap: argparse.ArgumentParser, out: str) -> None:
    """The options this script shares with passkey_margin.py."""
    ap.add_argument("--arms", required=True, help="arms separated by ';'")
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--text", default="evaluation")
    ap.add_argument("--out", default=out)


def picked_cases(text: str) -> list[tuple[int, int]]:
    """ "59:2,63:5" -> [(59, 2), (63, 5)]."""
    return [tuple(map(int, c.split(":"))) for c in text.split(",")]


def case_list(text: str) -> str:
    """`--cases` checked as an argparse type, so a bad one is a usage error
    before the model loads; kept as written (the results file records it)."""
    try:
        picked = picked_cases(text)
    except ValueError:
        picked = [()]
    if any(len(c) != 2 or not 0 <= c[1] < CASES_PER_SEED for c in picked):
        raise argparse.ArgumentTypeError(
            f"cases are seed:index, index 0 to {CASES_PER_SEED - 1}: {text!r}"
        )
    return text


def model_and_arms(args):
    """(model, tokenizer, arms): full first, then `--arms`, bound to the model."""
    arms = [Arm("full", {})] + [parse_arm(a) for a in args.arms.split(";")]
    model, tokenizer = load()
    bind_to(model, arms)
    return model, tokenizer, arms


def seed_cases(tokenizer, seed: int, args) -> list:
    """The agnostic cases `veloxpatch eval --cases 10 --seed <seed>` builds."""
    return make_cases(
        tokenizer,
        CASES_PER_SEED,
        args.context,
        seed=seed,
        text_split=args.text,
        agnostic=True,
    )


def seed_range(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def chosen_cases(tokenizer, args):
    """("seed:index", case) of `args.cases`, else of every case of
    `args.seeds`, in order (each seed's cases built once)."""
    if args.cases:
        picked = picked_cases(args.cases)
    else:
        picked = [(s, i) for s in seed_range(args.seeds) for i in range(CASES_PER_SEED)]
    built: dict[int, list] = {}
    for seed, index in picked:
        if seed not in built:
            built[seed] = seed_cases(tokenizer, seed, args)
        yield f"{seed}:{index}", built[seed][index]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", required=True, type=case_list, help="seed:index,...")
    add_arguments(ap, "scripts/studies/results/passkey_recheck.json")
    args = ap.parse_args()
    model, tokenizer, arms = model_and_arms(args)
    raw = []
    for name, case in chosen_cases(tokenizer, args):
        for row in run_agnostic_case(model, tokenizer, case, arms):
            raw.append(row | {"case": name})
            print(row["arm"], name, row["correct"], repr(row["answer"]))
    table = []
    for arm in dict.fromkeys(r["arm"] for r in raw):
        rows = [r for r in raw if r["arm"] == arm]
        cases = {r["case"] for r in rows}
        whole = {c for c in cases if all(r["correct"] for r in rows if r["case"] == c)}
        table.append(
            {
                "arm": arm,
                "correct": sum(r["correct"] for r in rows),
                "answers": len(rows),
                "cases_all_right": len(whole),
                "cases": len(cases),
            }
        )
    write_results(
        args.out,
        {"run": run_info(), "config": vars(args), "table": table, "raw": raw},
    )


if __name__ == "__main__":
    main()
