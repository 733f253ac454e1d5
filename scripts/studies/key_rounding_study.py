"""Which query moment `kv_round="query"` should weigh (quantized.py): on
SmolLM2's own keys and queries, the attention that later queries give 2-bit
keys rounded with error feedback under each choice of H, against nearest
rounding.

Per prose segment, the model reads `--context` + `--continuation` tokens in
one call (a probe keeps every layer's queries and keys). Keys 1 .. (whole
groups before the continuation) are quantized as kivi stores them
(`kv_rotate="query"`: scaled by the context's queries, rotated, per channel in
groups of 32, the sink dense), with H:

- nearest: no feedback (kv_round="nearest");
- own positions: the context's post-RoPE queries at their own positions;
- newest: the context's newest `--newest` post-RoPE queries;
- rope-moved: the context's pre-RoPE queries moved by the rope to each of the
  next 512 positions (what kv_round="query" does);
- oracle: the continuation's own queries (the best any H can do).

Reported: KL(exact || quantized) of the continuation queries' attention per
query head, mean over layers and heads (values exact: keys only).

    .venv/bin/python scripts/studies/key_rounding_study.py --segments 2 \
        --out scripts/studies/results/key_rounding_study.json
"""

from __future__ import annotations

import argparse

from veloxpatch import blas

blas.preload()

import mlx.core as mx  # noqa: E402

from veloxpatch.caches.quantized import (  # noqa: E402
    QuantizedStore,
    future_moment,
    rotation_signs,
)
from veloxpatch.eval.runinfo import run_info, write_results  # noqa: E402
from veloxpatch.loading import models  # noqa: E402
from veloxpatch.probe import run_probe  # noqa: E402
from veloxpatch.prose import prose_segments  # noqa: E402

GROUP, SINKS = 32, 1
CHOICES = ("nearest", "own positions", "newest", "rope-moved", "oracle")


def per_kv_head(q: mx.array, heads: int) -> mx.array:
    """Queries [1, Hq, n, D] -> [1, heads, Hq / heads * n, D]."""
    _, hq, n, d = q.shape
    return q.reshape(1, heads, hq // heads * n, d)


def second_moment(q: mx.array, heads: int) -> mx.array:
    g = per_kv_head(q.astype(mx.float32), heads)
    return g.swapaxes(-1, -2) @ g / g.shape[2]


def attention_kl(q, keys, quantized, offset: int, scale: float) -> float:
    """Mean KL over query heads and queries [1, Hq, m, D] at positions offset..
    of the causal attention on exact keys against quantized ones."""
    hq, heads, n = q.shape[1], keys.shape[1], keys.shape[2]
    rep = hq // heads
    logits = []
    for k in (keys, quantized):
        k = mx.repeat(k.astype(mx.float32), rep, axis=1)
        s = (q.astype(mx.float32) @ k.swapaxes(-1, -2)) * scale
        pos = mx.arange(n)[None] <= (offset + mx.arange(q.shape[2]))[:, None]
        logits.append(mx.where(pos, s, -mx.inf))
    lp, lq = (x - mx.logsumexp(x, axis=-1, keepdims=True) for x in logits)
    p = mx.exp(lp)
    kl = mx.where(p > 0, p * (lp - mx.where(p > 0, lq, 0.0)), 0.0).sum(-1)
    return kl.mean().item()


def quantized_keys(keys, power, moment, layer, bits):
    """The keys (post-RoPE, [1, H, n, D]) as kivi with kv_rotate="query" holds
    them, rounded with `moment` (None: nearest): the sink exact, whole groups
    after it dequantized, the rest exact."""
    heads, n = keys.shape[1], keys.shape[2]
    m = SINKS + (n - SINKS) // GROUP * GROUP
    signs = rotation_signs(heads, keys.shape[3], layer)
    store = QuantizedStore((bits,) * heads, GROUP, signs, query_aware=True)
    store.rounds = moment is not None
    store.query_power, store.query_moment = power, moment
    store.append(keys[:, :, SINKS:m], keys[:, :, SINKS:m])
    dk, _ = store.dequantize(mx.float32)
    return mx.concatenate([keys[:, :, :SINKS], dk, keys[:, :, m:]], axis=2)


def probe_layers(model, ids, context: int) -> dict:
    """Layer -> (post-RoPE queries, the context's pre-RoPE queries, post-RoPE
    keys, rope, softmax scale) of `ids` read in one call."""
    seen = {}

    def keep(s):
        q_pre = s.q_pre if s.query_scale is None else s.q_pre * s.query_scale
        seen[s.layer] = (s.q, q_pre[:, :, :context], s.k, s.rope, s.scale)
        mx.eval(s.q, s.k)

    run_probe(model, ids, keep, chunk=len(ids))
    return seen


def probed_segments(args):
    """(segment, `probe_layers` of its context + continuation) for each prose
    segment of `args` (context, continuation, segments, text)."""
    model, tokenizer = models.load()
    segs = prose_segments(
        tokenizer, args.context, args.continuation, args.segments, args.text
    )
    for seg, (context, cont) in enumerate(segs):
        yield seg, probe_layers(model, context + cont, args.context)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--segments", type=int, default=2)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--newest", type=int, default=512)
    ap.add_argument("--text", default="evaluation")
    ap.add_argument("--out", default="scripts/studies/results/key_rounding_study.json")
    args = ap.parse_args()

    c = args.context
    per_segment = []
    for seg, seen in probed_segments(args):
        kl = {name: [] for name in CHOICES}
        for layer, (q, q_pre, k, rope, scale) in sorted(seen.items()):
            heads = k.shape[1]
            ctx_q, later_q = q[:, :, :c], q[:, :, c:]
            power = mx.diagonal(second_moment(ctx_q, heads), axis1=-2, axis2=-1)
            moments = {
                "nearest": None,
                "own positions": second_moment(ctx_q, heads),
                "newest": second_moment(ctx_q[:, :, -args.newest :], heads),
                "rope-moved": future_moment(rope, c, second_moment(q_pre, heads)),
                "oracle": second_moment(later_q, heads),
            }
            keys = k[:, :, :c]
            full_k = k
            for name, moment in moments.items():
                held = quantized_keys(keys, power, moment, layer, args.bits)
                held = mx.concatenate([held, full_k[:, :, c:]], axis=2)
                kl[name].append(attention_kl(later_q, full_k, held, c, scale))
        per_segment.append(segment_means(seg, kl))
    write_study(args, per_segment, "moment")


def segment_means(seg: int, kl: dict) -> dict:
    """A segment's record: each choice's KL by layer and its mean (printed)."""
    means = {name: sum(v) / len(v) for name, v in kl.items()}
    print(seg, {k: round(v, 5) for k, v in means.items()}, flush=True)
    return {"segment": seg, "kl": means, "kl_by_layer": kl}


def write_study(args, per_segment: list, label: str) -> None:
    """The results file: each choice's KL averaged over the segments, the
    choices under `label`, the segments' records after."""
    names = per_segment[0]["kl"]
    table = [
        {label: name, "kl": sum(s["kl"][name] for s in per_segment) / len(per_segment)}
        for name in names
    ]
    write_results(
        args.out,
        {
            "run": run_info(),
            "config": vars(args),
            "table": table,
            "segments": per_segment,
        },
    )


if __name__ == "__main__":
    main()
