"""Shared test helpers: run mlx-lm's own generation loop and collect logprobs;
mlx's peak memory in the steps after a prompt."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from tiny import prompt_tokens, tiny_model

import veloxpatch


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


def rel(a, b) -> float:
    """Largest absolute difference over b's largest magnitude (float64)."""
    a, b = np.array(a, np.float64), np.array(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def step_peak(
    layers: int, algo: str, opts: dict, steps: int = 1, prompt: int = 1200
) -> int:
    """mlx's largest peak above what was held, over `steps` decode calls after
    a `prompt`-token prompt on a tiny llama of `layers` layers, driven as
    mlx-lm's generate_step does: prefill chunks of 256 with the caches' state
    evaluated after each, the last token alone, then each step's token alone,
    evaluating only the token (what a call changes in a cache is evaluated by
    the call that reads it, unless the cache evaluates it itself)."""

    model = tiny_model("llama", head_dim=32, num_hidden_layers=layers)
    ids = prompt_tokens(prompt)[None]
    worst = 0
    with veloxpatch.patched(model, algo, **opts) as patch:
        caches = patch.make_cache()
        for start in range(0, prompt - 1, 256):
            model(ids[:, start : min(start + 256, prompt - 1)], cache=caches)
            mx.eval([c.state for c in caches])
        y = model(ids[:, prompt - 1 :], cache=caches)[:, -1:].argmax(-1)
        for _ in range(steps):
            mx.eval(y)
            gc.collect()
            mx.reset_peak_memory()
            before = mx.get_active_memory()
            y = model(y, cache=caches)[:, -1:].argmax(-1)
            mx.eval(y)
            worst = max(worst, mx.get_peak_memory() - before)
    return worst
