"""KL of quantized rows against full precision on SmolLM2 (`veloxpatch/caches/
kv_quant.py`: each width's default recipe, or `recipe=` to compare).

Per prose segment: prefill `--context` tokens, then teacher-force
`--continuation` tokens one per call; mean KL(full || arm) and greedy agreement
of each arm, its KV bytes, the tok/s of that teacher-forced decode (one token
per call, flushes included) and the time of one flush (quantizing `group` rows
of every KV head of a layer).

    .venv/bin/python scripts/studies/quantizer_kl.py --context 2000 --continuation 256 \
        --segments 2 --arms kivi:bits=2,kivi:bits=2,recipe=kivi --text evaluation
"""

from __future__ import annotations

import argparse
import statistics
import time

from veloxpatch import blas

blas.preload()

import mlx.core as mx  # noqa: E402

import veloxpatch  # noqa: E402
from veloxpatch.caches import quantized  # noqa: E402
from veloxpatch.eval.arms import Arm, parse_arm, split_arms  # noqa: E402
from veloxpatch.eval.metrics import (  # noqa: E402
    agreement_and_kl,
    perplexity,
    teacher_forced,
)
from veloxpatch.eval.runinfo import run_info, write_results  # noqa: E402
from veloxpatch.eval.sessions import arm_caches  # noqa: E402
from veloxpatch.memory import kv_bytes  # noqa: E402
from veloxpatch.prose import prose_segments  # noqa: E402


def flush_ms(bits: int, group: int = 32, repeats: int = 200) -> float:
    """Median ms to quantize one flush of keys (transposed) and values:
    3 KV heads, `group` rows, head dim 64 (SmolLM2's layer)."""
    k = mx.random.normal((1, 3, group, 64))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(*quantized.minmax_quantize(k.swapaxes(-1, -2), group, bits)[:2])
        mx.eval(*quantized.minmax_quantize(k, group, bits)[:2])
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def timed_logprobs(model, arm, context, cont):
    """(log-probabilities, KV bytes, decode tok/s) of one arm."""
    with arm_caches(model, arm, context[:-1]) as (caches, _):
        logits = model(mx.array([context[-1:]]), cache=caches)[0, -1]
        t0 = time.perf_counter()
        lp = teacher_forced(model, caches, logits, cont)
        rate = len(cont) / (time.perf_counter() - t0)
        return lp, kv_bytes(caches), rate


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--segments", type=int, default=1)
    ap.add_argument("--arms", default="kivi:bits=2,kivi:bits=3,kivi:bits=4")
    ap.add_argument("--text", default="evaluation", help="or licenses-evaluation")
    ap.add_argument("--out", default="scripts/studies/results/quantizer_kl.json")
    args = ap.parse_args()
    info = run_info()
    model, tokenizer = veloxpatch.load()
    arms = [parse_arm(t) for t in split_arms(args.arms)]
    stretches = prose_segments(
        tokenizer, args.context, args.continuation, args.segments, args.text
    )
    rows = []
    for seg, (context, cont) in enumerate(stretches):
        ref, _, _ = timed_logprobs(model, Arm("full"), context, cont)
        for arm in arms:
            lp, kv, rate = timed_logprobs(model, arm, context, cont)
            agree, kl = agreement_and_kl(lp, ref)
            row = dict(segment=seg, arm=arm.label, kl=kl)
            row["perplexity"] = perplexity(lp, cont)
            rows.append({**row, "agreement": agree, "kv_bytes": kv})
            rows[-1]["decode_tok_per_s"] = rate
            print(
                f"{seg} {arm.label:<24} KL {kl:.5f} agree {agree:.3f} {rate:.1f} tok/s",
                flush=True,
            )
    table = []
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm.label]
        bits = arm.options.get("bits", arm.options.get("kv_bits", 2))
        group = arm.options.get("group", arm.options.get("kv_group", 32))
        table.append(
            {
                "arm": arm.label,
                "kl": statistics.mean(r["kl"] for r in mine),
                "agreement": statistics.mean(r["agreement"] for r in mine),
                "perplexity": statistics.mean(r["perplexity"] for r in mine),
                "kv_bytes": mine[0]["kv_bytes"],
                "decode_tok_per_s": statistics.median(
                    r["decode_tok_per_s"] for r in mine
                ),
                "flush_ms": flush_ms(bits, group),
            }
        )
    for t in table:
        print(
            f"{t['arm']:<24} KL {t['kl']:.5f} "
            f"agree {t['agreement']:.3f} {t['decode_tok_per_s']:.1f} tok/s "
            f"flush {t['flush_ms']:.3f} ms"
        )
    result = {"run": info, "config": vars(args), "table": table, "raw": rows}
    write_results(args.out, result)


if __name__ == "__main__":
    main()
