"""`veloxpatch bench`: prefill and decode speed, KV bytes and peak memory of any
arms at several context lengths, against unpatched mlx-lm in the same run.

Every arm prefills for real (no replay: prefill speed is what is measured)
through mlx-lm's generate_step; repeats interleave the arms in a rotating order
and the tables report medians, and the median of per-repeat ratios.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

from ..memory import kv_bytes
from . import peers
from .arms import Arm
from .sessions import arm_caches, mlx_kind
from .text import check_length, prose_length, prose_tokens

BASELINE = Arm("unpatched")


def measure(model, arm: Arm, ids, decode_tokens: int, step: int) -> dict:
    """One generation: prefill tok/s (to the first token), decode tok/s after it,
    KV bytes held at the end and the peak memory of the process meanwhile."""
    kind = mlx_kind(arm)
    # mlx.quantized: mlx-lm itself converts the caches (kv_bits, start 0)
    extra = peers.generation_kwargs(kind, arm.options) if kind else {}
    with arm_caches(model, arm, [], None, step) as (caches, _):
        mx.eval([c.state for c in caches if getattr(c, "keys", None) is not None])
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        steps = generate_step(
            mx.array(ids),
            model,
            max_tokens=decode_tokens + 1,
            prompt_cache=caches,
            prefill_step_size=step,
            **extra,
        )
        next(steps)
        t1 = time.perf_counter()
        n = sum(1 for _ in steps)
        t2 = time.perf_counter()
        return {
            "prefill_tok_per_s": len(ids) / (t1 - t0),
            "decode_tok_per_s": n / (t2 - t1) if n else float("nan"),
            "kv_bytes": kv_bytes(caches),
            "peak_memory_bytes": mx.get_peak_memory(),
        }


def run(
    model,
    tokenizer,
    arms,
    contexts,
    *,
    repeats=3,
    decode_tokens=32,
    step=2048,
    text="evaluation",
    tick=lambda: None,
):
    """Raw measurements and the per (context, arm) table of medians and ratios.
    A text too short for the longest context is refused before anything runs."""
    check_length(prose_length(tokenizer, text), max(contexts, default=0), text)
    arms = [BASELINE] + [a for a in arms if a.label != BASELINE.label]
    raw = []
    for context in contexts:
        ids = prose_tokens(tokenizer, context, text)
        for r in range(repeats):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            for arm in order:
                m = measure(model, arm, ids, decode_tokens, step)
                raw.append({"context": context, "repeat": r, "arm": arm.label, **m})
            tick()
    return raw, summarize(raw, arms, contexts)


def summarize(raw, arms, contexts) -> list[dict]:
    table = []
    for context in contexts:
        base = {
            r["repeat"]: r
            for r in raw
            if r["context"] == context and r["arm"] == BASELINE.label
        }
        for arm in arms:
            mine = [r for r in raw if r["context"] == context and r["arm"] == arm.label]
            row = {
                "context": context,
                "arm": arm.label,
                "algo": arm.algo,
                "budget": arm.options.get("budget"),
            }
            for key in ("prefill_tok_per_s", "decode_tok_per_s"):
                row[key] = statistics.median(m[key] for m in mine)
                row[key.replace("tok_per_s", "ratio")] = statistics.median(
                    m[key] / base[m["repeat"]][key] for m in mine
                )
            row["kv_bytes"] = statistics.median(m["kv_bytes"] for m in mine)
            row["peak_memory_bytes"] = statistics.median(
                m["peak_memory_bytes"] for m in mine
            )
            table.append(row)
    return table


def format_table(table) -> str:
    lines = [
        f"{'ctx':>6} {'arm':<34} {'prefill':>8} {'ratio':>6} {'decode':>7} "
        f"{'ratio':>6} {'KV MB':>8} {'peak MB':>8}"
    ]
    for t in table:
        lines.append(
            f"{t['context']:>6} {t['arm']:<34} {t['prefill_tok_per_s']:8.1f} "
            f"{t['prefill_ratio']:6.2f} {t['decode_tok_per_s']:7.2f} "
            f"{t['decode_ratio']:6.2f} {t['kv_bytes'] / 1e6:8.1f} "
            f"{t['peak_memory_bytes'] / 1e6:8.1f}"
        )
    return "\n".join(lines)
