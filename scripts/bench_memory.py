"""Peak memory per arm and context length, prefill and decode apart, each
(arm, context) in its own process.

Every run prefills `--contexts` prose tokens (evaluation text) through mlx-lm's
generate_step in chunks of `--prefill-step` tokens (mlx-lm's
prefill_step_size; the chunk size is recorded with the results), then decodes
`--decode-tokens` greedy tokens (`veloxpatch.eval.bench.measure`). Reported per
phase: mlx's peak above the memory in use before the prompt (the weights and
the empty caches: `mx.reset_peak_memory()` before, `mx.get_peak_memory()`
after, minus `mx.get_active_memory()` before) and the process's peak resident
set (VmHWM, reset through /proc/self/clear_refs after mlx's buffer cache is
emptied). The prefill runs to the first token out; the decode is the rest.
Also: KV bytes held when the first token is out, at the end and at most at
once (after every attention call, before any cut back), prefill
seconds, decode tok/s.

Arms are written `NAME[:key=value,...]` and passed through as they are:
`unpatched` (mlx-lm's own caches), `mlx.rotating:budget=N` (mlx-lm's
RotatingKVCache of N rows, 4 sinks), `mlx.quantized:kv_bits=B` (mlx-lm's
QuantizedKVCache from the first token: kv_bits with quantized_kv_start=0) and
every veloxpatch algorithm, e.g. `snapkv:budget=512,compress=chunks,chunk=256`.
The default arms are those three and every veloxpatch algorithm with a
budget, at `--budget` rows, plus `compress=chunks` for those that take it.

    .venv/bin/python scripts/bench_memory.py --contexts 2048,4096,8192,16384 \\
        --prefill-step 512 --decode-tokens 32 \\
        --out scripts/results/bench_memory_peak.json

Results are written after every run, so an interrupted benchmark keeps what it
measured; `--plot` (SVG, no plotting library) draws the peaks against context
length, one line per arm, and `--plot-only` redraws it from a results file.
A run that fails (out of memory, an arm refusing a context) is recorded with
its error and the benchmark goes on.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

MB = 2**20
BUDGET = 512
DEFAULT_OUT = "scripts/results/bench_memory_peak.json"


def default_arms(budget: int = BUDGET) -> list[str]:
    """mlx-lm's three, then every veloxpatch algorithm taking a budget at
    `budget` rows (and with compress="chunks" where it has that option), but
    kvzap, which needs its scorer file (`kvzap:budget=512,scorer=FILE`)."""
    from veloxpatch.caches import ALGORITHMS
    from veloxpatch.eval.arms import takes_budget

    arms = ["unpatched", f"mlx.rotating:budget={budget}", "mlx.quantized:kv_bits=4"]
    for name in sorted(ALGORITHMS):
        if not takes_budget(name) or name == "kvzap":  # kvzap: give its scorer file
            continue
        arms.append(f"{name}:budget={budget}")
        if "compress" in ALGORITHMS[name].Options.__dataclass_fields__:
            arms.append(f"{name}:budget={budget},compress=chunks")
    return arms


def check_arms(texts: list[str]) -> list[str]:
    """Parse and validate every arm before anything runs (an unknown name or
    option exits here, not an hour in); the arms' labels."""
    from veloxpatch import api
    from veloxpatch.eval import peers
    from veloxpatch.eval.arms import is_peer, parse_arm

    labels = []
    for text in texts:
        arm = parse_arm(text)
        if is_peer(arm.algo):
            reason = peers.check(arm.algo, dict(arm.options))
            if reason is not None:
                raise SystemExit(f"{arm.label}: {reason}")
        else:
            api.make_options(arm.algo, arm.options)
        labels.append(arm.label)
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise SystemExit(f"--arms names {', '.join(twice)} twice")
    return labels


def row_of(arm: str, context: int, step: int, m: dict, loaded: dict) -> dict:
    """A results row from `bench.measure(..., rss=True)`: bytes as measured,
    MB (2^20) for the resident set, and the decode-only fields of the earlier
    decode benchmark (`mlx_peak_decode_mb`, weights included)."""
    before = m["active_before_bytes"]
    return {
        "arm": arm,
        "context": context,
        "prefill_step_size": step,
        "decoded": m["decoded"],
        "weights_bytes": loaded["weights_bytes"],
        "active_before_bytes": before,
        "prefill_peak_bytes": m["prefill_peak_bytes"],
        "decode_peak_bytes": m["decode_peak_bytes"],
        "kv_bytes_prefill_end": m["kv_bytes_prefill_end"],
        "kv_peak_bytes": m["kv_peak_bytes"],
        "kv_bytes": m["kv_bytes"],
        "prefill_seconds": round(m["prefill_seconds"], 3),
        "prefill_tok_s": round(m["prefill_tok_per_s"], 2),
        "decode_tok_s": round(m["decode_tok_per_s"], 3),
        "rss_after_load_mb": loaded["rss_after_load_mb"],
        "rss_before_prefill_mb": _mb(m.get("rss_before_mb")),
        "peak_rss_prefill_mb": _mb(m.get("peak_rss_prefill_mb")),
        "rss_decode_start_mb": _mb(m.get("rss_decode_start_mb")),
        "peak_rss_decode_mb": _mb(m.get("peak_rss_decode_mb")),
        # as the decode-only benchmark reported them (bench_memory.json)
        "weights_mb": round(loaded["weights_bytes"] / MB, 1),
        "mlx_peak_prefill_mb": round((before + m["prefill_peak_bytes"]) / MB, 1),
        "mlx_peak_decode_mb": round((before + m["decode_peak_bytes"]) / MB, 1),
        "kv_mb_end": round(m["kv_bytes"] / MB, 2),
    }


def _mb(value):
    return None if value is None else round(value, 1)


def child(arm_text: str, context: int, decode: int, step: int) -> dict:
    """Run in a process of its own: one arm, one context."""
    from veloxpatch import blas

    blas.preload()
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import veloxpatch
    from veloxpatch.eval.arms import parse_arm
    from veloxpatch.eval.bench import measure, status_mb
    from veloxpatch.prose import prose_tokens

    arm = parse_arm(arm_text)
    model, tokenizer = veloxpatch.load()
    ids = prose_tokens(tokenizer, context, "evaluation")
    mx.eval(model.parameters())
    weights = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    loaded = {"weights_bytes": weights, "rss_after_load_mb": _mb(status_mb("VmRSS"))}
    try:
        m = measure(model, arm, ids, decode, step, rss=True)
    except Exception as e:  # recorded, and the benchmark goes on
        error = f"{type(e).__name__}: {e}"
        where = {"arm": arm.label, "context": context, "prefill_step_size": step}
        return {**where, "error": error}
    return row_of(arm.label, context, step, m, loaded)


def run_child(arm: str, args, context: int) -> dict:
    cmd = [sys.executable, __file__, "--child", arm, "--contexts", str(context)]
    cmd += ["--decode-tokens", str(args.decode_tokens)]
    cmd += ["--prefill-step", str(args.prefill_step_size)]
    failed = {
        "arm": arm,
        "context": context,
        "prefill_step_size": args.prefill_step_size,
    }
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {**failed, "error": f"timed out after {args.timeout} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {**failed, "error": f"exit {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def report(r: dict) -> str:
    head = f"{r['context']:>6} {r['arm']:<44}"
    if "error" in r:
        return f"{head} FAILED {r['error']}"
    rss = [r.get(k) for k in ("peak_rss_prefill_mb", "peak_rss_decode_mb")]
    rss = "/".join("?" if v is None else f"{v:.0f}" for v in rss)
    return (
        f"{head} prefill peak {r['prefill_peak_bytes'] / 1e6:8.1f} MB "
        f"decode peak {r['decode_peak_bytes'] / 1e6:7.1f} MB "
        f"KV {r['kv_bytes'] / 1e6:7.2f} MB (peak {r['kv_peak_bytes'] / 1e6:.1f})  "
        f"RSS {rss} MB  "
        f"prefill {r['prefill_seconds']:.1f} s  {r['decode_tok_s']:.2f} tok/s"
    )


# ---- the plot: an SVG with no plotting library -------------------------------

PALETTE = (
    "#1f77b4 #ff7f0e #2ca02c #d62728 #9467bd #8c564b #e377c2 #7f7f7f #bcbd22 "
    "#17becf #393b79 #637939 #8c6d31 #843c39 #7b4173 #3182bd"
).split()
PANEL_W, PANEL_H, PAD, LEGEND_W = 430, 330, 58, 300
PANELS = (
    ("prefill_peak_bytes", "prefill peak above the weights"),
    ("decode_peak_bytes", "decode peak above the weights"),
)


def _colour(arm: str, colours: dict) -> str:
    algo = arm.split(":")[0]
    return colours.setdefault(algo, PALETTE[len(colours) % len(PALETTE)])


def _panel(x0, rows, arms, key, title, colours, top) -> list[str]:
    contexts = sorted({r["context"] for r in rows})
    lo, hi = math.log2(contexts[0]), math.log2(contexts[-1])
    inner_w, inner_h = PANEL_W - 1.5 * PAD, PANEL_H - 1.8 * PAD

    def x(c):
        return x0 + PAD + (math.log2(c) - lo) / ((hi - lo) or 1) * inner_w

    def y(v):
        return PANEL_H - PAD - v / top * inner_h

    out = [
        f'<text x="{x0 + PANEL_W / 2}" y="20" text-anchor="middle" '
        f'font-size="14">{title}</text>',
        f'<line x1="{x0 + PAD}" y1="{PANEL_H - PAD}" x2="{x0 + PAD + inner_w}" '
        f'y2="{PANEL_H - PAD}" stroke="black"/>',
        f'<line x1="{x0 + PAD}" y1="{PANEL_H - PAD}" x2="{x0 + PAD}" '
        f'y2="{PANEL_H - PAD - inner_h}" stroke="black"/>',
        f'<text x="{x0 + PAD + inner_w / 2}" y="{PANEL_H - 14}" '
        'text-anchor="middle" font-size="12">context (tokens, log scale)</text>',
        f'<text x="{x0 + 14}" y="{PANEL_H / 2}" text-anchor="middle" font-size="12" '
        f'transform="rotate(-90 {x0 + 14} {PANEL_H / 2})">MB</text>',
    ]
    for c in contexts:
        out.append(
            f'<text x="{x(c):.1f}" y="{PANEL_H - PAD + 14}" text-anchor="middle" '
            f'font-size="10">{c:,}</text>'
        )
    for i in range(5):
        v = top * i / 4
        out.append(
            f'<text x="{x0 + PAD - 4}" y="{y(v) + 3:.1f}" text-anchor="end" '
            f'font-size="10">{v / 1e6:,.0f}</text>'
        )
    for arm in arms:
        pts = sorted(
            (r["context"], r[key]) for r in rows if r["arm"] == arm and key in r
        )
        if not pts:
            continue
        colour = _colour(arm, colours)
        dash = ' stroke-dasharray="5,3"' if "compress=chunks" in arm else ""
        path = " ".join(f"{x(c):.1f},{y(v):.1f}" for c, v in pts)
        out.append(
            f'<polyline points="{path}" fill="none" stroke="{colour}" '
            f'stroke-width="1.8"{dash}><title>{arm}</title></polyline>'
        )
        out += [
            f'<circle cx="{x(c):.1f}" cy="{y(v):.1f}" r="2.5" fill="{colour}">'
            f"<title>{arm} at {c:,}: {v / 1e6:,.1f} MB</title></circle>"
            for c, v in pts
        ]
    return out


def plot_svg(res: dict) -> str:
    """Prefill and decode peaks above the weights against context length, one
    line per arm (dashed: compress=chunks); failed runs are left out."""
    rows = [r for r in res["rows"] if "error" not in r]
    if not rows:
        raise SystemExit("no successful run to plot")
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    top = max(r[k] for r in rows for k, _ in PANELS) * 1.05 or 1
    step = res["config"].get("prefill_step_size")
    colours: dict = {}
    body = []
    for i, (key, title) in enumerate(PANELS):
        title += f" (prefill chunk {step})" if i == 0 and step else ""
        body += _panel(i * PANEL_W, rows, arms, key, title, colours, top)
    lx = len(PANELS) * PANEL_W + 10
    for i, arm in enumerate(arms):
        ly = 40 + i * 16
        dash = ' stroke-dasharray="5,3"' if "compress=chunks" in arm else ""
        body += [
            f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 24}" y2="{ly - 4}" '
            f'stroke="{_colour(arm, colours)}" stroke-width="1.8"{dash}/>',
            f'<text x="{lx + 30}" y="{ly}" font-size="11">{arm}</text>',
        ]
    width = len(PANELS) * PANEL_W + LEGEND_W
    height = max(PANEL_H, 50 + 16 * len(arms))
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" font-family="sans-serif">\n'
        '<rect width="100%" height="100%" fill="white"/>\n'
        + "\n".join(body)
        + "\n</svg>\n"
    )


def write_plot(res: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(plot_svg(res))
    print(f"plot: {path}")


def added_to(path: str, config: dict, run: dict) -> dict:
    """The results in `path`, to which the runs of `config` are added (the same
    prefill chunk and decode length; the added arms and contexts recorded)."""
    res = json.loads(Path(path).read_text())
    old = res["config"]
    for key in ("decode_tokens", "prefill_step_size", "text"):
        if old[key] != config[key]:
            raise SystemExit(f"--add: {path} has {key} {old[key]}, not {config[key]}")
    added = {"arms": config["arms"], "contexts": config["contexts"], "run": run}
    old.setdefault("added", []).append(added)
    failed = [r for r in res["rows"] if "error" in r]  # run again
    res["rows"] = [r for r in res["rows"] if r not in failed]
    return res


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default=None, help="default: see the module's doc")
    ap.add_argument(
        "--budget", type=int, default=BUDGET, help="rows of the default arms"
    )
    ap.add_argument("--contexts", default="2048,4096,8192,16384")
    ap.add_argument(
        "--context", type=int, default=None, help="one context (as --contexts N)"
    )
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument(
        "--prefill-step",
        dest="prefill_step_size",
        type=int,
        default=2048,
        help="mlx-lm's prefill chunk (prefill_step_size)",
    )
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument(
        "--add",
        action="store_true",
        help="add to --out's runs (those measured already are skipped)",
    )
    ap.add_argument(
        "--plot", default=None, help="SVG (default: --out with .svg; 'none': no plot)"
    )
    ap.add_argument("--plot-only", metavar="RESULTS", default=None, help="redraw")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.context is not None:
        args.contexts = str(args.context)
    args.context_list = [int(c) for c in args.contexts.split(",") if c.strip()]
    if not args.context_list or min(args.context_list) < 2:
        ap.error(f"--contexts needs token counts of at least 2, got {args.contexts!r}")
    if args.decode_tokens < 1 or args.prefill_step_size < 1:
        ap.error("--decode-tokens and --prefill-step must be at least 1")
    return args


def write_markdown(out, res: dict):
    """The run's table beside its results file (`.md`): one row per arm and
    context, peaks above the weights."""
    from results_markdown import mb, table, write_beside

    rows = []
    for r in res["rows"]:
        name = [f"`{r['arm']}`", f"{r['context']:,}", r.get("prefill_step_size", "")]
        if "error" in r:
            rows.append(name + ["failed: " + r["error"].splitlines()[0]] + [""] * 4)
            continue
        rows.append(
            name
            + [
                mb(r["prefill_peak_bytes"]),
                mb(r["decode_peak_bytes"]),
                mb(r.get("kv_peak_bytes")),
                r.get("prefill_tok_s", ""),
                r.get("decode_tok_s", ""),
            ]
        )
    head = ["arm", "context", "chunk", "prefill peak MB", "decode peak MB"]
    head += ["KV peak MB", "prefill tok/s", "decode tok/s"]
    title = "Peak memory above the weights, prefill and decode"
    cmd = ".venv/bin/python scripts/bench_memory.py"
    rename = {"prefill_step_size": "prefill_step"}
    return write_beside(out, res, title, table(head, rows), cmd, rename)


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        row = child(
            args.child,
            args.context_list[0],
            args.decode_tokens,
            args.prefill_step_size,
        )
        print(json.dumps(row))
        return
    if args.plot_only:
        res = json.loads(Path(args.plot_only).read_text())
        write_plot(res, args.plot or str(Path(args.plot_only).with_suffix(".svg")))
        return

    from veloxpatch import blas

    blas.preload()
    from veloxpatch.eval.arms import split_arms
    from veloxpatch.eval.runinfo import run_info, write_results

    texts = split_arms(args.arms) if args.arms else default_arms(args.budget)
    arms = check_arms(texts)
    plot = args.plot or str(Path(args.out).with_suffix(".svg"))
    config = {
        "arms": ",".join(arms),
        "contexts": ",".join(map(str, args.context_list)),
        "decode_tokens": args.decode_tokens,
        "prefill_step_size": args.prefill_step_size,
        "text": "evaluation",
        "out": args.out,
    }
    res = {"run": run_info(), "config": config, "rows": []}
    if args.add:
        res = added_to(args.out, config, res["run"])
    done = {(r["arm"], r["context"]) for r in res["rows"] if "error" not in r}
    t0 = time.monotonic() - res.get("seconds", 0)
    for context in args.context_list:
        for arm in arms:
            if (arm, context) in done:
                continue
            row = run_child(arm, args, context)
            res["rows"].append(row)
            res["seconds"] = round(time.monotonic() - t0, 1)
            write_results(args.out, res)  # after every run: a partial file survives
            print(f"{report(row)}  [{res['seconds']:.0f} s]", flush=True)
    write_markdown(args.out, res)
    print(f"results: {args.out}")
    if plot != "none":
        write_plot(res, plot)


if __name__ == "__main__":
    main()
