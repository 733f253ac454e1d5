"""What reading a document costs: `Patch.prefill` (read and compress, kvzip's
reconstruction included) per configuration against the unpatched model's
prefill of the same tokens (mlx-lm's own cache, 2,048-token steps), in one
run: median seconds of interleaved repeats, and mx's peak memory while reading
above what was in use before (the weights excluded). Every configuration holds
20% of the prompt's full KV once it is read (`pricing.held_options`); `auto` is
what `veloxpatch compress --max-kv-bytes 20%` picks for that prompt, and `auto
generate` what `veloxpatch generate` picks, reading it through mlx-lm's generate
(one token generated).

    .venv/bin/python scripts/bench_compress.py --contexts 2000,8000 --repeats 3 \\
        --out scripts/results/bench_compress.json

`--before FILE` adds an earlier run's ratios (the same script run at an older
commit) beside this one's in the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from veloxpatch import blas

blas.preload()

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.models import cache as mlx_cache  # noqa: E402

import veloxpatch  # noqa: E402
from veloxpatch import auto, pricing  # noqa: E402
from veloxpatch.errors import OptionError  # noqa: E402
from veloxpatch.eval.runinfo import run_info, write_results  # noqa: E402
from veloxpatch.prose import prose_tokens  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_markdown import mb, table, write_beside  # noqa: E402

# the scorer the package ships for the embedded model (what auto runs)
SCORER = str(
    Path(__file__).resolve().parents[1]
    / "veloxpatch/caches/shipped/llama-660c26220b179a47/kvzap.safetensors"
)
SHARE = 0.2
STEP = 2048  # mlx-lm's prefill_step_size
ARMS = {
    "kvzip": {},
    "kvzip 4-bit r32": {"kv_bits": 4, "kv_residual": 32},
    "kvzip 4-bit r0": {"kv_bits": 4, "kv_residual": 0},
    "kvzap 4-bit r0": {"kv_bits": 4, "kv_residual": 0, "scorer": SCORER},
    "snapkv": {},
    "auto": None,  # compress's pick at 20% for this prompt
    "auto generate": None,  # generate's pick, read by mlx-lm's generate
}


def unpatched(model, ids) -> float:
    caches = mlx_cache.make_prompt_cache(model)
    start = time.perf_counter()
    for a in range(0, len(ids), STEP):
        model(mx.array(ids[a : a + STEP])[None], cache=caches)
        mx.eval([c.state for c in caches])
    return time.perf_counter() - start


def compressed(model, tokenizer, algo, options, ids) -> float:
    with veloxpatch.patched(model, algo, **options) as patch:
        start = time.perf_counter()
        caches = patch.prefill(ids, tokenizer=tokenizer, chunk=STEP)
        mx.eval([c.state for c in caches])
        return time.perf_counter() - start


def generated(model, tokenizer, algo, options, ids) -> float:
    with veloxpatch.patched(model, algo, tokenizer=tokenizer, **options):
        start = time.perf_counter()
        mlx_lm.generate(model, tokenizer, ids, max_tokens=1, prefill_step_size=STEP)
        return time.perf_counter() - start


def measured(fn, *args) -> tuple[float, int]:
    """(seconds, mx peak above what was in use before)."""
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    seconds = fn(*args)
    return seconds, mx.get_peak_memory() - before


STATED = {}  # (context, "auto") -> the peak auto's line states


def arm_options(model, name: str, n: int):
    """(algorithm, options) of an arm for an n-token prompt."""
    if name.startswith("auto"):
        path = "generate" if name == "auto generate" else "compress"
        choice = auto.choose(model, f"{SHARE:.0%}", path, n_tokens=n)
        print(f"{n:>6} {choice.line()}", flush=True)
        STATED[n, name] = choice.peak_bytes
        return choice.algo, choice.options
    algo = name.split()[0]
    size = int(SHARE * pricing.full_bytes(model, n))
    return algo, pricing.held_options(model, algo, size, ARMS[name])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="2000,8000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--before", default=None, help="an earlier run's JSON")
    ap.add_argument("--out", default="scripts/results/bench_compress.json")
    args = ap.parse_args()
    names = [a.strip() for a in args.arms.split(",")]
    if unknown := sorted(set(names) - set(ARMS)):
        ap.error(f"--arms: unknown {', '.join(unknown)}; known: {', '.join(ARMS)}")
    info = run_info()
    model, tokenizer = veloxpatch.load()
    rows = []
    for n in [int(x) for x in args.contexts.split(",")]:
        ids = prose_tokens(tokenizer, n, "evaluation")
        unpatched(model, ids[:64])  # warm-up
        arms = {}
        for name in names:
            try:
                arms[name] = arm_options(model, name, n)
            except OptionError as e:  # an older commit without it
                print(f"{n:>6} {name:<18} skipped: {e}", flush=True)
        # an arm that runs what an earlier one runs (auto's pick) shares its runs
        runs, timed = {"unpatched": []}, []
        for name, run in arms.items():
            gen = name == "auto generate"  # read another way: never shared
            first = next(
                k for k, r in arms.items() if r == run and (k == "auto generate") == gen
            )
            runs[name] = runs[first] if first != name else []
            timed += [name] if first == name else []
        for _ in range(args.repeats):  # interleaved, so drift hits every arm
            runs["unpatched"].append(measured(unpatched, model, ids))
            for name in timed:
                algo, options = arms[name]
                read = generated if name == "auto generate" else compressed
                runs[name].append(measured(read, model, tokenizer, algo, options, ids))
        base_s = statistics.median(s for s, _ in runs["unpatched"])
        base_peak = statistics.median(p for _, p in runs["unpatched"])
        for name, got in runs.items():
            seconds = statistics.median(s for s, _ in got)
            peak = statistics.median(p for _, p in got)
            algo, options = arms.get(name, ("unpatched", {}))
            rows.append(
                {
                    "context": n,
                    "arm": name,
                    "algo": algo,
                    "options": options,
                    "seconds": [s for s, _ in got],
                    "peaks": [p for _, p in got],
                    "median_s": seconds,
                    "vs_prefill": seconds / base_s,
                    "peak_bytes": peak,
                    "peak_vs_prefill": peak / base_peak,
                    "stated_peak_bytes": STATED.get((n, name)),
                }
            )
            print(
                f"{n:>6} {name:<18} {seconds:7.2f} s {seconds / base_s:5.2f}x "
                f"peak {peak / 1e6:7.1f} MB {peak / base_peak:5.2f}x",
                flush=True,
            )
    res = {"run": info, "config": vars(args), "table": rows}
    if args.before:
        res["before"] = json.loads(Path(args.before).read_text())
    write_results(args.out, res)
    write_markdown(args.out, res)


def write_markdown(out, res: dict) -> Path:
    before = {
        (r["context"], r["arm"]): r for r in res.get("before", {}).get("table", [])
    }
    then = res.get("before", {}).get("run", {}).get("git_commit")
    rows = []
    for r in res["table"]:
        old = before.get((r["context"], r["arm"]))
        rows.append(
            [
                r["context"],
                r["arm"],
                f"{r['median_s']:.1f}",
                f"{r['vs_prefill']:.2f}x",
                "" if old is None else f"{old['vs_prefill']:.2f}x",
                mb(r["peak_bytes"]),
                f"{r['peak_vs_prefill']:.2f}x",
                "" if old is None else f"{old['peak_vs_prefill']:.2f}x",
                mb(r.get("stated_peak_bytes")),
            ]
        )
    head = ["tokens", "configuration", "read s", "x prefill", f"x prefill at {then}"]
    head += [
        "peak MB",
        "x prefill's peak",
        f"x peak at {then}",
        "auto's stated peak MB",
    ]
    if then is None:  # no earlier run: its columns left out
        head = [h for i, h in enumerate(head) if i not in (4, 7)]
        rows = [[c for i, c in enumerate(r) if i not in (4, 7)] for r in rows]
    body = [
        "Reading a document and compressing it to 20% of its full KV (`Patch."
        "prefill`), against the unpatched model's prefill of the same tokens in "
        "the same run: medians of interleaved repeats; peak: mx's peak above what "
        "was in use before (not the weights).",
        "",
        *table(head, rows),
    ]
    return write_beside(out, res, "What reading a document costs", body, "")


if __name__ == "__main__":
    main()
