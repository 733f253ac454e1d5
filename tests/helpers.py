"""Shared test helpers: run mlx-lm's own generation loop and collect logprobs."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generate_step


def greedy(model, prompt, n: int = 16, prefill_step_size: int = 7, prompt_cache=None):
    """Greedy tokens and the full logprob rows through mlx_lm.generate_step."""
    toks, rows = [], []
    steps = generate_step(
        prompt,
        model,
        max_tokens=n,
        prefill_step_size=prefill_step_size,
        prompt_cache=prompt_cache,
    )
    for tok, logprobs in steps:
        toks.append(tok)
        rows.append(logprobs)
    return toks, mx.stack(rows)


def max_abs(a: mx.array, b: mx.array) -> float:
    return mx.abs(a - b).max().item()
