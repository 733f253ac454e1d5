"""Teacher-forced quality metrics of a patched model against the uncompressed one.

The context is prefilled in chunks of `prefill_step_size` (its last token alone,
as mlx-lm does), then the continuation is fed one token per call, so eviction
during decode happens exactly as in generation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import mlx.core as mx

from ..memory import kv_bytes
from .agnostic import compress
from .arms import Arm, chosen
from .sessions import Prefills, arm_caches


def teacher_forced(model, caches, logits, continuation) -> mx.array:
    """Log-probabilities [T, V]: `logits` predicts continuation[0], then each
    continuation token is fed alone (decode-time eviction as in generation)."""
    rows = [logits - mx.logsumexp(logits)]
    mx.eval(rows[-1])
    for tok in continuation[:-1]:
        logits = model(mx.array([[tok]]), cache=caches)[0, -1]
        rows.append(logits - mx.logsumexp(logits))
        mx.eval(rows[-1])
    return mx.stack(rows).astype(mx.float32)


def arm_logprobs(
    model,
    arm: Arm,
    context,
    continuation,
    prefill_step_size=2048,
    prefills=None,
    agnostic=None,
):
    """(log-probabilities, KV bytes held at the end) of one arm. `prefills` (a
    sessions.Prefills of context[:-1]) shares the prefill between arms.
    `agnostic` (tokenizer, kvzip scores by options): context[:-1] is compressed
    as `Patch.prefill` does, before the last context token is fed."""
    with arm_caches(model, arm, context[:-1], prefills, prefill_step_size) as (
        caches,
        _,
    ):
        if agnostic is not None:
            tokenizer, scores = agnostic
            compress(model, tokenizer, arm, caches, context[:-1], scores)
        logits = model(mx.array([context[-1:]]), cache=caches)[0, -1]
        lp = teacher_forced(model, caches, logits, continuation)
        kv = kv_bytes(caches)
    return lp, kv


def perplexity(logprobs: mx.array, continuation) -> float:
    nll = -mx.take_along_axis(logprobs, mx.array(continuation)[:, None], axis=1)
    return math.exp(nll.mean().item())


def agreement_and_kl(logprobs: mx.array, reference: mx.array) -> tuple[float, float]:
    """Top-1 agreement with the reference's greedy tokens and mean KL(ref || arm)."""
    kl = position_kl(logprobs, reference).mean().item()
    return agreement(logprobs, reference), kl


def agreement(logprobs: mx.array, reference: mx.array) -> float:
    return (mx.argmax(logprobs, -1) == mx.argmax(reference, -1)).mean().item()


def position_kl(logprobs: mx.array, reference: mx.array) -> mx.array:
    """KL(ref || arm) at every continuation position [T]."""
    return (mx.exp(reference) * (reference - logprobs)).sum(-1)


def kl_profile(kl: mx.array) -> dict[str, float]:
    """Mean of the per-position KL [T] over positions [0, 8), [8, 32), [32, 64),
    [64, 128), ... : how the loss moves as generation goes on (early: the
    compressed context alone; later: what decode-time eviction kept)."""
    edges = [0, 8, 32]
    while edges[-1] < kl.shape[0]:
        edges.append(edges[-1] * 2)
    edges = sorted({min(e, kl.shape[0]) for e in edges})
    return {f"{a}-{b}": kl[a:b].mean().item() for a, b in zip(edges, edges[1:])}


@dataclass
class ContinuationResult:
    arm: str
    algo: str
    options: dict
    context_tokens: int
    continuation_tokens: int
    prefill_step_size: int
    perplexity: float
    agreement: float
    kl: float
    kv_bytes: int
    shared_prefill: bool
    kl_profile: dict = field(default_factory=dict)
    chose: str | None = None  # what an auto arm ran for this context

    def as_dict(self):
        return asdict(self)


def evaluate_continuation(
    model, arms, context, continuation, prefill_step_size=2048, tokenizer=None
):
    """Perplexity, agreement and KL against `full` of every arm on one
    context/continuation. A context within one prefill chunk is prefilled once
    per kind of arm and shared (exact, see sessions.Prefills). With `tokenizer`
    the question-agnostic protocol: the context is compressed before any
    continuation token (kvzip by its reconstruction pass)."""
    prefills = Prefills(model, context[:-1], arms, prefill_step_size)
    agnostic = None if tokenizer is None else (tokenizer, {})
    reference, reference_kv = arm_logprobs(
        model, Arm("full"), context, continuation, prefill_step_size, prefills
    )
    results = []
    path, n = (
        ("generate", len(context))
        if agnostic is None
        else ("compress", len(context) - 1)
    )
    for arm in arms:
        use = chosen(model, arm, n, path)  # as that path would for this context
        if arm.algo == "full" and not arm.options:
            lp, kv = reference, reference_kv  # the reference is this arm
        else:
            lp, kv = arm_logprobs(
                model, use, context, continuation, prefill_step_size, prefills, agnostic
            )
        kl_at = position_kl(lp, reference)
        results.append(
            ContinuationResult(
                arm.label,
                arm.algo,
                dict(arm.options),
                len(context),
                len(continuation),
                prefill_step_size,
                perplexity(lp, continuation),
                agreement(lp, reference),
                kl_at.mean().item(),
                kv,
                prefills.single,
                kl_profile(kl_at),
                None if use is arm else use.label,
            )
        )
    return results
