"""Which layers' quantized keys cost agnostic passkey answers: each answer
teacher-forced as passkey_margin.py reads it (its NLL and margin), on an arm's
compressed context with the arm's keys widened to `--wide` bits in one block
of layers, the rest as the arm holds them; the arm unchanged and full run with
them, on the same answers, so every block pairs with both. The arm and its
blocks are prefilled alike, in one call; the arm again from full's prefill
replayed (as passkey_margin.py's arms read it): the two differ only in float
rounding, so their difference is the noise any block's must exceed.

    .venv/bin/python scripts/studies/passkey_key_layers.py --seeds 52-53 \\
        --arms "kivi:bits=2" \\
        --blocks 0-14,15-24,25-29,0-29 \\
        --out scripts/studies/results/passkey_key_layers.json

`--blocks ""` reads the arm alone, both ways; `--cases 59:2,63:5` reads
those cases instead of whole seeds. One arm (a quantized one:
`kivi` or `kv_bits=`); cases are those of
`veloxpatch eval --tasks passkey --protocol agnostic --cases 10 --seed <seed>`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses

from veloxpatch import blas

blas.preload()

from passkey_margin import add_case_arguments, answer_rows, run_seeds  # noqa: E402
from passkey_recheck import add_arguments, model_and_arms  # noqa: E402

from veloxpatch import api  # noqa: E402
from veloxpatch.caches.base import VeloxCache  # noqa: E402
from veloxpatch.eval.agnostic import compress, compressed  # noqa: E402
from veloxpatch.eval.sessions import prefill_head  # noqa: E402


def layer_block(text: str) -> range:
    """ "15-24" -> layers 15 to 24; "7" -> layer 7."""
    lo, _, hi = text.partition("-")
    return range(int(lo), int(hi or lo) + 1)


def widen_keys(caches, layers, bits: int) -> None:
    """The keys of `layers` quantized at `bits` (each cache's own copy of the
    options: the other layers keep the arm's)."""
    for c in caches:
        if isinstance(c, VeloxCache) and c.layer in layers:
            options = copy.copy(c.options)
            options.quant = dataclasses.replace(options.quant, key_bits=bits)
            c.options = options


@contextlib.contextmanager
def widened_context(model, tokenizer, arm, context, layers, bits):
    """`arm`'s caches after `context`, prefilled and compressed with no
    question, its keys at `bits` in `layers` (the model patched inside)."""
    with api.patched(model, algo=arm.algo, **arm.options) as patch:
        caches = patch.make_cache()
        widen_keys(caches, layers, bits)
        prefill_head(model, caches, context)
        compress(model, tokenizer, arm, caches, context, {})
        yield caches


def case_rows(model, tokenizer, case, arms, blocks, bits) -> list[dict]:
    rows = []

    def ask(label, caches):
        rows.extend(answer_rows(model, tokenizer, case, label, caches))

    for replayed, caches, _, _ in compressed(model, tokenizer, case, arms):
        ask(replayed.label + (" replayed" if replayed.options else ""), caches)
    arm = arms[1]  # unchanged, then each block: all prefilled alike
    for block in [None, *blocks]:
        layers = range(0) if block is None else layer_block(block)
        label = (
            arm.label if block is None else f"{arm.label} keys {bits}-bit in {block}"
        )
        with widened_context(
            model, tokenizer, arm, case.context, layers, bits
        ) as caches:
            ask(label, caches)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_arguments(ap, "52-53")
    ap.add_argument("--blocks", required=True, help="layer blocks, as 0-14,15-24")
    ap.add_argument("--wide", type=int, default=8, help="the widened keys' bits")
    add_arguments(ap, "scripts/studies/results/passkey_key_layers.json")
    args = ap.parse_args()
    model, tokenizer, arms = model_and_arms(args)
    if len(arms) != 2:
        raise SystemExit("passkey_key_layers.py: give one arm")
    blocks = [b for b in args.blocks.split(",") if b]  # "": the arm alone
    run_seeds(
        args,
        tokenizer,
        lambda case: case_rows(model, tokenizer, case, arms, blocks, args.wide),
    )


if __name__ == "__main__":
    main()
