"""Whether `kv_rotate="query_basis"` (quantized.py) beats the channel scaling
of `kv_rotate="query"`: on SmolLM2's own keys and queries, the attention that
later queries give 2-bit keys stored each way, with nearest rounding and with
kv_round="query"'s feedback.

Per prose segment, the model reads `--context` + `--continuation` tokens in
one call (`key_rounding_study.probe_layers`). Keys 1 .. (whole groups before the
continuation) are quantized as kivi stores them (groups of 32, the sink
dense), the basis and the rounding from the context's pre-RoPE queries moved
by the rope to the next 512 positions, the scales from the context's queries
at their own positions (as the cache sets them). Reported: KL(exact ||
quantized) of the continuation queries' attention per query head, mean over
layers and heads (values exact: keys only).

    .venv/bin/python scripts/studies/key_basis_study.py --segments 2 \\
        --text licenses-calibration --out scripts/studies/results/key_basis_study.json
"""

from __future__ import annotations

import argparse

from veloxpatch import blas

blas.preload()

import mlx.core as mx  # noqa: E402
from key_rounding_study import (  # noqa: E402
    GROUP,
    SINKS,
    attention_kl,
    probed_segments,
    second_moment,
    segment_means,
    write_study,
)

from veloxpatch.caches.quantized import (  # noqa: E402
    QuantizedStore,
    future_moment,
    rotation_signs,
)

ARMS = {  # name -> (keys mapped to the basis, rounded with feedback)
    "query scale, nearest": (False, False),
    "query scale, round": (False, True),
    "query basis, nearest": (True, False),
    "query basis, round": (True, True),
}


def stored_keys(keys, power, moment, layer, bits, basis, rounds):
    """Post-RoPE keys [1, H, n, D] as kivi holds them: the sink exact, whole
    groups after it dequantized, the rest exact."""
    heads, n = keys.shape[1], keys.shape[2]
    m = SINKS + (n - SINKS) // GROUP * GROUP
    signs = rotation_signs(heads, keys.shape[3], layer)
    store = QuantizedStore(
        (bits,) * heads, GROUP, signs, query_aware=not basis, basis=basis
    )
    store.rounds = rounds
    store.query_power, store.query_moment = power, moment
    store.append(keys[:, :, SINKS:m], keys[:, :, SINKS:m])
    dk, _ = store.dequantize(mx.float32)
    return mx.concatenate([keys[:, :, :SINKS], dk, keys[:, :, m:]], axis=2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--segments", type=int, default=2)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--text", default="licenses-calibration")
    ap.add_argument("--out", default="scripts/studies/results/key_basis_study.json")
    args = ap.parse_args()

    c = args.context
    per_segment = []
    for seg, seen in probed_segments(args):
        kl = {name: [] for name in ARMS}
        for layer, (q, q_pre, k, rope, scale) in sorted(seen.items()):
            heads = k.shape[1]
            power = mx.diagonal(second_moment(q[:, :, :c], heads), axis1=-2, axis2=-1)
            moment = future_moment(rope, c, second_moment(q_pre, heads))
            for name, (basis, rounds) in ARMS.items():
                held = stored_keys(
                    k[:, :, :c], power, moment, layer, args.bits, basis, rounds
                )
                held = mx.concatenate([held, k[:, :, c:]], axis=2)
                kl[name].append(attention_kl(q[:, :, c:], k, held, c, scale))
        per_segment.append(segment_means(seg, kl))
    write_study(args, per_segment, "arm")


if __name__ == "__main__":
    main()
