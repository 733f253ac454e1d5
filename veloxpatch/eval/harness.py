"""`veloxpatch eval`: passkey accuracy, perplexity and agreement of any arms.

Every arm is written `NAME[:key=value,...]`; ours replay one dense prefill per
case, peers (`unpatched`, `mlx.rotating`, `mlx.quantized`, `veloxquant.ALGO`)
prefill directly. Results keep every raw row next to the summary tables.
"""

from __future__ import annotations

import statistics

from ..errors import OptionError
from .metrics import evaluate_continuation
from .passkey import make_cases
from .runner import run_case, summarize
from .text import prose_length, prose_tokens

TASKS = ("passkey", "ppl", "agreement")


def parse_tasks(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown or not tasks:
        raise OptionError(f"unknown task(s) {unknown}; valid: {', '.join(TASKS)}")
    return tasks


def passkey(model, tokenizer, arms, *, context, cases, seed, text, step, tick):
    """Raw rows and the per-arm table (accuracy, Wilson interval, by depth)."""
    rows = []
    for case in make_cases(tokenizer, cases, context, seed=seed, text_split=text):
        rows += run_case(model, tokenizer, case, arms, step)
        tick()
    return rows, summarize(rows, arms)


def continuation(
    model, tokenizer, arms, *, context, length, segments, text, step, tick
):
    """Raw rows and per-arm means of perplexity, agreement and KL against full,
    over `segments` stretches of prose spread over the text."""
    total = prose_length(tokenizer, text)
    span = context + length
    if span > total:
        raise OptionError(f"the text has {total} tokens, fewer than {span} needed")
    stride = (total - span) // max(1, segments - 1) if segments > 1 else 0
    rows = []
    for seg in range(segments):
        ids = prose_tokens(tokenizer, span, text, start=seg * stride)
        for res in evaluate_continuation(
            model, arms, ids[:context], ids[context:], step
        ):
            rows.append({"segment": seg, **res.as_dict()})
        tick()
    table = []
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm.label]
        table.append(
            {
                "arm": arm.label,
                "family": arm.family,
                "algo": arm.algo,
                "budget": arm.options.get("budget"),
                "perplexity": statistics.mean(r["perplexity"] for r in mine),
                "agreement": statistics.mean(r["agreement"] for r in mine),
                "kl": statistics.mean(r["kl"] for r in mine),
                "kv_mb": statistics.mean(r["kv_bytes"] for r in mine) / 1e6,
            }
        )
    return rows, table


def format_tables(results: dict) -> str:
    """The printed summary: one line per arm and task."""
    lines = []
    if "passkey" in results:
        lines.append(f"{'passkey':<40} {'acc':>5} {'k/n':>7}  wilson95      KV MB")
        for t in results["passkey"]["table"]:
            lo, hi = t["wilson95"]
            lines.append(
                f"{t['arm']:<40} {t['accuracy']:5.2f} {t['correct']:>3}/{t['cases']:<3}"
                f"  [{lo:.2f}, {hi:.2f}]  {t['kv_mb']:6.2f}"
            )
    if "continuation" in results:
        lines.append(
            f"\n{'continuation':<40} {'ppl':>8} {'agree':>6} {'KL':>7}   KV MB"
        )
        for t in results["continuation"]["table"]:
            lines.append(
                f"{t['arm']:<40} {t['perplexity']:8.3f} {t['agreement']:6.3f} "
                f"{t['kl']:7.4f} {t['kv_mb']:7.2f}"
            )
    return "\n".join(lines)
