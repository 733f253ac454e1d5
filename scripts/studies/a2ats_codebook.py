"""A2ATS codebooks on SmolLM2: query-aware (H from real queries) against plain
k-means (H = I), at several codebook sizes, on held-out prose.

Codebooks are calibrated on `--tokens` tokens of the calibration half of the
text; `--segments` stretches of the evaluation half are scored as described in
`veloxpatch/eval/codebook_quality.py` (recall of the true top 3% far keys by
exact attention and by windowed far logits; query-weighted reconstruction
error), per layer, then averaged over layers. The query-aware codebook of size
`--save-size` is saved for the evaluation runs.

    .venv/bin/python scripts/studies/a2ats_codebook.py --sizes 64,256,1024

The saved codebook (13 MB) is not committed. The same codebook (same tokens,
seed and k-means) comes faster from the calibrate command, without the study:

    veloxpatch calibrate --algo a2ats --tokens 8192 --codebook-size 256 \\
        --out scripts/results/smollm2_a2ats_256.safetensors
"""

from __future__ import annotations

import argparse
import time

from veloxpatch import blas

blas.preload()

import veloxpatch  # noqa: E402
from veloxpatch.caches.calibration_files import with_norms  # noqa: E402
from veloxpatch.calibration.a2ats import (  # noqa: E402
    capture,
    layer_codebook,
    save_codebook,
)
from veloxpatch.eval.codebook_quality import capture_segment, codebook_quality  # noqa: E402
from veloxpatch.eval.runinfo import run_info, write_results  # noqa: E402
from veloxpatch.prose import prose_tokens  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,256,1024", help="empty: ceiling only")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--segments", type=int, default=2)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sinks", type=int, default=8)
    ap.add_argument("--top", type=float, default=0.03)
    ap.add_argument("--far-position", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-size", type=int, default=256)
    ap.add_argument(
        "--save",
        default="scripts/results/smollm2_a2ats_256.safetensors",
        help="where the --save-size codebook goes (not committed; empty: none)",
    )
    ap.add_argument("--out", default="scripts/studies/results/a2ats_codebook.json")
    args = ap.parse_args()
    info = run_info()
    model, tokenizer = veloxpatch.load()
    b = args.far_position
    sizes = [int(s) for s in args.sizes.split(",") if s]
    t0 = time.perf_counter()
    ids = prose_tokens(tokenizer, args.tokens, "calibration")
    captured = capture(model, ids, b, seed=args.seed) if sizes else []
    print(f"calibration capture: {time.perf_counter() - t0:.0f}s", flush=True)
    segments = [
        capture_segment(
            model,
            prose_tokens(tokenizer, args.context, "evaluation", start=s * 20_000),
            args.queries,
            b,
        )
        for s in range(args.segments)
    ]
    metric = dict(window=args.window, sinks=args.sinks, top=args.top)
    books = [None] * len(segments[0])
    ceiling, ceiling_layers = codebook_quality(books, segments, **metric)
    print(f"ceiling (windowed far logits vs exact): {ceiling['ceiling']:.3f}")
    rows = []
    for size in sizes:
        for aware in (True, False):
            t0 = time.perf_counter()
            books = [
                with_norms(layer_codebook(k, q, size, args.seed, aware))
                for k, q in captured
            ]
            mean, per_layer = codebook_quality(books, segments, **metric)
            rows.append(dict(size=size, query_aware=aware, **mean, per_layer=per_layer))
            print(
                f"size {size:5d} {'query-aware' if aware else 'plain      '} "
                f"recall(exact) {mean['recall_exact']:.3f} recall(windowed) "
                f"{mean['recall_windowed']:.3f} error {mean['error']:.4f} "
                f"({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
            if aware and size == args.save_size and args.save:
                meta = dict(tokens=args.tokens, size=size, seed=args.seed)
                save_codebook(args.save, books, model, b, meta)
    ceiling = dict(**ceiling, per_layer=ceiling_layers)
    result = {"run": info, "config": vars(args), "ceiling": ceiling, "rows": rows}
    write_results(args.out, result)
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
