"""kvzap's calibration on the embedded SmolLM2: how long it takes, on how much
text, and how well the surrogates predict held-out KVzip+ scores.

Each (tokens, kind) is `veloxpatch calibrate --algo kvzap` on the calibration
half of the built-in prose (never the evaluation half), its file written
unless it exists; the summary (the metadata each file carries: segments, held
out, R^2 and rank correlation per layer, seconds) goes to --out.

    .venv/bin/python scripts/kvzap_calibration.py \\
        --runs 1024:linear,4096:linear,16384:linear,16384:mlp \\
        --out scripts/results/kvzap_calibration.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def scorer_path(folder: Path, tokens: int, kind: str) -> Path:
    size = "" if tokens == 16384 else f"_{tokens // 1024}k"
    return folder / f"smollm2_kvzap_{kind}{size}.safetensors"


def file_info(path: Path) -> dict:
    """The calibration's record, as the file carries it."""
    from veloxpatch import blas

    blas.preload()
    import mlx.core as mx

    _, meta = mx.load(str(path), return_metadata=True)
    return json.loads(meta["info"]) | {"file": str(path), "kind": meta["kind"]}


def score_percentiles(path: Path, tokens: int = 2048) -> dict:
    """Percentiles of the scores `path`'s surrogates predict for `tokens` tokens
    of calibration prose, sinks left out (where kvzap's thresholds come from)."""
    import mlx.core as mx
    import numpy as np

    import veloxpatch
    from veloxpatch.prose import prose_tokens

    model, tokenizer = veloxpatch.load()
    ids = prose_tokens(tokenizer, tokens, "calibration")
    opts = dict(scorer=str(path), threshold=-1e6)  # keep everything
    with veloxpatch.patched(model, "kvzap", **opts) as patch:
        caches = patch.make_cache()
        for a in range(0, tokens, 512):
            mx.eval(model(mx.array(ids[a : a + 512])[None], cache=caches))
        z = np.concatenate([np.array(c.row_scores()[0, :, 4:]).ravel() for c in caches])
    return {
        str(q): round(float(np.quantile(z, q)), 2) for q in (0.1, 0.25, 0.5, 0.75, 0.9)
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="1024:linear,4096:linear,16384:linear,16384:mlp")
    ap.add_argument("--folder", default="scripts/results", help="scorer files")
    ap.add_argument(
        "--percentiles-of",
        default="16384:linear",
        help="the run whose predicted scores give the threshold percentiles",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from veloxpatch.eval.runinfo import run_info, write_results

    rows = []
    for run in args.runs.split(","):
        tokens, kind = run.split(":")
        path = scorer_path(Path(args.folder), int(tokens), kind)
        if not (ROOT / path).exists():
            cmd = [sys.executable, "-m", "veloxpatch.cli", "calibrate", "--algo"]
            cmd += ["kvzap", "--tokens", tokens, "--kind", kind, "--out", str(path)]
            subprocess.run(cmd, cwd=ROOT, check=True)
        rows.append(file_info(ROOT / path))
        print(
            f"{tokens:>6} {kind:6} R^2 {rows[-1]['mean_r2']:.3f} rank "
            f"{rows[-1]['mean_spearman']:.3f} ({rows[-1]['scoring_seconds']} s)",
            flush=True,
        )
    source = scorer_path(Path(args.folder), *_parse(args.percentiles_of))
    percentiles = score_percentiles(ROOT / source)
    print(f"predicted scores of {source.name}: {percentiles}")
    result = {"run": run_info(), "config": vars(args), "table": rows}
    write_results(args.out, result | {"score_percentiles": percentiles})


def _parse(run: str) -> tuple[int, str]:
    tokens, kind = run.split(":")
    return int(tokens), kind


if __name__ == "__main__":
    main()
