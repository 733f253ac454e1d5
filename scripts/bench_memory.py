"""Process peak memory during a long decode, per arm, each arm in its own process.

Every arm prefills the same `--context` prose tokens through mlx-lm's
generate_step (prefill chunks of 2048), then decodes `--decode-tokens` greedy
tokens. When the first token is out, mlx's buffer cache is cleared and the
process's peak resident set (VmHWM, reset through /proc/self/clear_refs) and
mlx's peak allocation are reset, so the peaks reported are those of the decode
alone; the prefill's transient attention buffers do not count. Both include the
weights (`weights_mb`). `unpatched` is mlx-lm with the model's own
caches; `mlx.quantized:kv_bits=B` is mlx-lm's kv_bits path (start 0).

    .venv/bin/python scripts/bench_memory.py --context 4000 --decode-tokens 512
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

ARMS = (
    "unpatched,full,kivi:bits=2,kivi:bits=4,mlx.quantized:kv_bits=4,"
    "snapkv:budget=512,snapkv:budget=512,kv_bits=4"
)


def status_mb(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def measure(arm_text: str, context: int, decode: int) -> dict:
    """Run in a child process: one arm, one prefill, one long decode."""
    from veloxpatch import blas

    blas.preload()
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.generate import generate_step

    import veloxpatch
    from veloxpatch.eval.arms import parse_arm
    from veloxpatch.eval.text import prose_tokens
    from veloxpatch.memory import kv_bytes

    arm = parse_arm(arm_text)
    model, tokenizer = veloxpatch.load()
    ids = prose_tokens(tokenizer, context, "evaluation")
    kwargs, patch = {}, None
    if arm.algo == "mlx.quantized":
        kwargs = dict(kv_bits=arm.options["kv_bits"], quantized_kv_start=0)
        caches = model.make_cache()
    elif arm.algo == "unpatched":
        caches = model.make_cache()
    else:
        patch = veloxpatch.apply(model, arm.algo, **arm.options)
        caches = model.make_cache()
    mx.eval(model.parameters())
    weights = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    loaded = status_mb("VmRSS")
    steps = generate_step(
        mx.array(ids), model, max_tokens=decode + 1, prompt_cache=caches, **kwargs
    )
    next(steps)  # prefill done, first token out
    mx.clear_cache()  # hand the prefill's freed buffers back to the system
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    mx.reset_peak_memory()
    start_rss = status_mb("VmRSS")
    t0 = time.perf_counter()
    n = sum(1 for _ in steps)
    seconds = time.perf_counter() - t0
    result = dict(
        arm=arm.label,
        context=context,
        decoded=n,
        weights_mb=round(weights / 2**20, 1),
        rss_after_load_mb=round(loaded, 1),
        rss_decode_start_mb=round(start_rss, 1),
        peak_rss_decode_mb=round(status_mb("VmHWM"), 1),
        mlx_peak_decode_mb=round(mx.get_peak_memory() / 2**20, 1),
        kv_mb_end=round(kv_bytes(caches) / 2**20, 2),
        decode_tok_s=round(n / seconds, 2),
    )
    if patch is not None:
        patch.restore()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default=ARMS)
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--decode-tokens", type=int, default=512)
    ap.add_argument("--out", default="scripts/results/bench_memory.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.context, args.decode_tokens)))
        return

    from veloxpatch.eval.arms import split_arms
    from veloxpatch.eval.runinfo import run_info, write_results

    info = run_info()
    rows = []
    for arm in split_arms(args.arms):
        cmd = [sys.executable, __file__, "--child", arm]
        cmd += ["--context", str(args.context)]
        cmd += ["--decode-tokens", str(args.decode_tokens)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        r = rows[-1]
        print(
            f"{r['arm']:<32} peak RSS {r['peak_rss_decode_mb']:8.1f} MB "
            f"(start {r['rss_decode_start_mb']:.1f}) mlx peak "
            f"{r['mlx_peak_decode_mb']:7.1f} MB  KV {r['kv_mb_end']:6.2f} MB  "
            f"{r['decode_tok_s']:.2f} tok/s",
            flush=True,
        )
    config = dict(vars(args))
    config.pop("child")
    write_results(args.out, {"run": info, "config": config, "rows": rows})
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
