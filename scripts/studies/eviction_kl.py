"""What evicting quantized rows costs: KL against full and KV bytes of eviction
arms with and without `kv_bits`, and with the compaction of holes (evicted
quantized rows, masked until then; `veloxpatch/caches/kv_bits.py`) set to
never (masking only: exact values, bytes grow), lazy (the default: holes up to
rows / HOLE_SHARE) and eager (holes up to one group).

On SmolLM2, per prose segment: prefill `--context` tokens, teacher-force
`--continuation` tokens one per call (eviction during decode as in generation).

    .venv/bin/python scripts/studies/eviction_kl.py --context 2000 --continuation 256
"""

from __future__ import annotations

import argparse
import statistics

from veloxpatch import blas

blas.preload()

from quantizer_kl import timed_logprobs  # noqa: E402  (scripts/)

import veloxpatch  # noqa: E402
from veloxpatch.caches import kv_bits  # noqa: E402
from veloxpatch.eval.arms import Arm, parse_arm, split_arms  # noqa: E402
from veloxpatch.eval.metrics import agreement_and_kl  # noqa: E402
from veloxpatch.eval.runinfo import run_info, write_results  # noqa: E402
from veloxpatch.prose import prose_segments  # noqa: E402

# holes allowed before compaction: max(group, rows // share)
COMPACTION = {"never": 1e-12, "lazy": kv_bits.HOLE_SHARE, "eager": 10**9}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--segments", type=int, default=1)
    ap.add_argument(
        "--arms",
        default="h2o:budget=256,snapkv:budget=256,tova:budget=256",
        help="eviction arms; each runs without kv_bits and with --kv-bits",
    )
    ap.add_argument("--kv-bits", type=int, default=4)
    ap.add_argument("--compaction", default="never,lazy,eager")
    ap.add_argument("--out", default="scripts/studies/results/eviction_kl.json")
    args = ap.parse_args()
    info = run_info()
    model, tokenizer = veloxpatch.load()
    arms = [parse_arm(t) for t in split_arms(args.arms)]
    modes = args.compaction.split(",")
    stretches = prose_segments(
        tokenizer, args.context, args.continuation, args.segments
    )
    rows = []
    for seg, (context, cont) in enumerate(stretches):
        ref, _, _ = timed_logprobs(model, Arm("full"), context, cont)
        for arm in arms:
            quant = Arm(arm.algo, {**arm.options, "kv_bits": args.kv_bits})
            runs = [(arm, "-")] + [(quant, mode) for mode in modes]
            for a, mode in runs:
                kv_bits.HOLE_SHARE = COMPACTION.get(mode, kv_bits.HOLE_SHARE)
                lp, kv, rate = timed_logprobs(model, a, context, cont)
                agree, kl = agreement_and_kl(lp, ref)
                rows.append(
                    dict(segment=seg, arm=a.label, compaction=mode, kl=kl)
                    | dict(agreement=agree, kv_bytes=kv, decode_tok_per_s=rate)
                )
                print(
                    f"{seg} {a.label:<34} {mode:<6} KL {kl:.5f} agree {agree:.3f} "
                    f"KV {kv / 1e6:.2f} MB {rate:.1f} tok/s",
                    flush=True,
                )
    kv_bits.HOLE_SHARE = COMPACTION["lazy"]
    table = []
    for key in dict.fromkeys((r["arm"], r["compaction"]) for r in rows):
        mine = [r for r in rows if (r["arm"], r["compaction"]) == key]
        table.append(
            {"arm": key[0], "compaction": key[1]}
            | {
                k: statistics.mean(r[k] for r in mine)
                for k in ("kl", "agreement", "kv_bytes", "decode_tok_per_s")
            }
        )
    for t in table:
        print(
            f"{t['arm']:<34} {t['compaction']:<6} KL {t['kl']:.5f} "
            f"agree {t['agreement']:.3f} KV {t['kv_bytes'] / 1e6:.2f} MB"
        )
    result = {"run": info, "config": vars(args), "table": table, "raw": rows}
    write_results(args.out, result)


if __name__ == "__main__":
    main()
