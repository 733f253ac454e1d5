"""What limits kvzap's surrogates on the embedded SmolLM2: the fit or the data.

One collection of KVzip+ scores on the calibration half of the built-in prose
(`veloxpatch calibrate --algo kvzap`'s segments, samples and held-out split),
then every fit below on the same data, judged on the same held-out segments:
ridge on 1/4, 1/2 and all of each segment's samples (how quality moves with
data at a fixed scoring cost), and the 2-layer MLP as shipped and with the
usual remedies for a small training set (fewer or more epochs, a narrower
layer, standardized inputs, weight decay).

    .venv/bin/python scripts/studies/kvzap_fit_study.py --tokens 16384 \\
        --out scripts/studies/results/kvzap_fit_study.json
"""

from __future__ import annotations

import argparse
import time

# each MLP variant: fit_mlp's keyword arguments (the first is fit_mlp as shipped)
MLP_VARIANTS = [
    {},
    {"epochs": 5},
    {"epochs": 40},
    {"hidden": 32},
    {"standardize": True},
    {"standardize": True, "epochs": 5},
    {"standardize": True, "weight_decay": 1.0},
    {"standardize": True, "hidden": 256, "weight_decay": 0.05},
]
RIDGE_SHARES = (4, 2, 1)  # every n-th sample of a segment


def _row(fit: str, options: dict, report: list, seconds: float) -> dict:
    from veloxpatch.calibration.kvzap import summary

    seconds = round(seconds, 1)
    return {"fit": fit, "options": options, **summary(report), "fit_seconds": seconds}


def _every(a, n: int):
    """Every n-th sample of a layer's array (None for sliding-window layers)."""
    return None if a is None else a[::n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from veloxpatch import blas

    blas.preload()  # before mlx is imported
    import veloxpatch
    from veloxpatch.calibration.kvzap import (
        collect,
        fit_layers,
        fit_mlp,
        fit_ridge,
        held_out,
    )
    from veloxpatch.eval.runinfo import run_info, write_results
    from veloxpatch.prose import prose_tokens

    model, tokenizer = veloxpatch.load()
    ids = prose_tokens(tokenizer, args.tokens, "calibration")
    start = time.perf_counter()
    data = collect(model, tokenizer, ids, seed=args.seed)
    scoring = time.perf_counter() - start
    print(f"scored {len(data)} segments in {scoring:.0f} s", flush=True)

    rows = []
    mask = held_out(len(data))
    for every in RIDGE_SHARES:
        # the held-out segments keep every sample: only training data shrinks
        part = [
            (X, Y)
            if out
            else ([_every(x, every) for x in X], [_every(y, every) for y in Y])
            for (X, Y), out in zip(data, mask)
        ]
        t = time.perf_counter()
        _, report = fit_layers(part, fit_ridge)
        rows.append(
            _row("ridge", {"samples_share": 1 / every}, report, time.perf_counter() - t)
        )
        print(rows[-1], flush=True)
    for options in MLP_VARIANTS:
        t = time.perf_counter()
        _, report = fit_layers(
            data, lambda X, Y, o=options: fit_mlp(X, Y, seed=args.seed, **o)
        )
        rows.append(_row("mlp", options, report, time.perf_counter() - t))
        print(rows[-1], flush=True)
    samples = next(len(y) for y in data[0][1] if y is not None)
    result = {
        "run": run_info(),
        "config": vars(args),
        "segments": len(data),
        "samples_per_segment": samples,
        "scoring_seconds": round(scoring, 1),
        "table": rows,
    }
    write_results(args.out, result)


if __name__ == "__main__":
    main()
