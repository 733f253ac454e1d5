"""The question-agnostic passkey protocol: each context (with its needle) is
prefilled and compressed with no question; then each question is asked on an
independent copy of the same compressed context, and every answer is scored.

Prefills are shared as in the aware protocol (one captured dense prefill per
context, replayed into each of our arms; one mlx-lm prefill for `unpatched` and
`mlx.quantized`). kvzip's reconstruction scores do not depend on the budget or
on how rows are then chosen (`CHOICE`), so arms that differ only in those share
one reconstruction pass.
"""

from __future__ import annotations

import mlx.core as mx

from ..caches.base import VeloxCache
from ..caches.phase import share_phase
from ..context import copy_cache
from ..memory import kv_bytes
from .arms import chosen
from .passkey import AgnosticCase
from .runner import answer, case_row
from .sessions import Prefills, arm_caches

# options that choose rows from what `finish_context` found (kvzip's
# reconstruction scores), or decode after it: arms differing only in these
# share one pass
CHOICE = ("budget", "max_kv_bytes", "floor", "recent", "tail", "layerwise", "window")


def run_agnostic_case(
    model, tokenizer, case: AgnosticCase, arms, prefill_step_size=2048, max_tokens=12
) -> list[dict]:
    rows = []
    contexts = compressed(model, tokenizer, case, arms, prefill_step_size)
    for arm, use, caches, held, shared in contexts:
        answers = [
            answer(model, tokenizer, q, copy_cache(caches), max_tokens)
            for q in case.questions
        ]
        for i, text in enumerate(answers):
            row = case_row(arm, case, text, held, prefill_step_size, shared, use)
            rows.append(row | {"question": i, "protocol": "agnostic"})
    return rows


def compressed(model, tokenizer, case: AgnosticCase, arms, prefill_step_size=2048):
    """Each arm's compressed context, in turn: (arm, the configuration it ran
    as, caches, bytes held, shared prefill), the caches live until the next
    arm's. Ask each question on a copy (`copy_cache`)."""
    prefills = Prefills(model, case.context, arms, prefill_step_size)
    scores: dict = {}  # kvzip options but CHOICE -> per layer reconstruction scores
    for arm in arms:
        use = chosen(model, arm, len(case.context), "compress")
        with arm_caches(model, use, case.context, prefills, prefill_step_size) as (
            caches,
            shared,
        ):
            compress(model, tokenizer, use, caches, case.context, scores)
            yield arm, use, caches, kv_bytes(caches), shared


def compress(model, tokenizer, arm, caches, context, scores: dict) -> None:
    """End the context's prompt: what `Patch.prefill` does after its prefill.
    Replayed caches were built one by one: they get one prompt phase first,
    so a model-wide choice (kvzip's) sees every layer."""
    share_phase(caches)
    ours = [c for c in caches if isinstance(c, VeloxCache)]
    if ours:
        key = repr(sorted((k, v) for k, v in arm.options.items() if k not in CHOICE))
        newest = context[ours[0].offset - len(context) :]
        found = scores.get(key)
        scores[key] = type(ours[0]).finish_context(
            model, caches, newest, tokenizer, reuse=found
        )
    for c in caches:
        close = getattr(c, "close_prompt", None)
        if close is not None:  # ours; mlx-lm's caches have no prompt end
            close()
    mx.eval([c.state for c in caches])
