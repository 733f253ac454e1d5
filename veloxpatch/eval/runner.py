"""Run arms over passkey cases, reusing one dense prefill per case (replay)."""

from __future__ import annotations

import re

import mlx.core as mx
from mlx_lm.generate import generate_step

from ..memory import kv_bytes
from .arms import Arm, chosen, ran
from .passkey import PasskeyCase, wilson
from .sessions import Prefills, arm_caches

DIGITS = re.compile(r"\d{5}")


def answer(model, tokenizer, prompt_tail, caches, max_tokens=12) -> str:
    """Greedy answer through mlx-lm's generate_step, stopping at EOS or once
    five digits in a row have been produced."""
    eos = set(getattr(tokenizer, "eos_token_ids", []) or [])
    out = []
    steps = generate_step(
        mx.array(prompt_tail), model, max_tokens=max_tokens, prompt_cache=caches
    )
    for tok, _ in steps:
        if tok in eos:
            break
        out.append(tok)
        if DIGITS.search(tokenizer.decode(out).replace(" ", "")):
            break
    return tokenizer.decode(out)


def run_case(
    model,
    tokenizer,
    case: PasskeyCase,
    arms,
    prefill_step_size=2048,
    max_tokens=12,
    decode_lead_in=False,
) -> list[dict]:
    """Every arm on one case. When the prompt fits one prefill chunk, arms share
    prefills (sessions.Prefills); otherwise each arm prefills directly.

    With `decode_lead_in` the answer's lead-in ("The secret number is") is not
    part of the prompt: the prompt ends with the question and the lead-in is fed
    token by token as the start of the answer (teacher-forced), as if the model
    had written it; the caches see those calls as answer-time decode steps."""
    lead = case.lead_in if decode_lead_in else 0
    if decode_lead_in and not lead:
        raise ValueError("this case has no separable lead-in")
    split = len(case.prompt) - lead  # the question ends here
    head = case.prompt[: split - 1]
    forced = case.prompt[split - 1 : -1] if lead else []  # fed one token a call
    prefills = Prefills(model, head, arms, prefill_step_size)
    rows = []
    for arm in arms:
        use = chosen(model, arm, len(case.prompt))  # as mlx-lm's generate would
        with arm_caches(model, use, head, prefills, prefill_step_size) as (
            caches,
            shared,
        ):
            for tok in forced:
                model(mx.array([[tok]]), cache=caches)
            text = answer(model, tokenizer, case.prompt[-1:], caches, max_tokens)
            kv = kv_bytes(caches)
        rows.append(
            case_row(arm, case, text, kv, prefill_step_size, shared, use)
            | {"lead_in": "decoded" if lead else "prompt"}
        )
    return rows


def case_row(arm, case, text, kv, prefill_step_size, shared, use=None) -> dict:
    """One answer of one arm on one case, as the results files hold it; `use`:
    the configuration an auto arm chose for this case."""
    chose = {} if use is None or use is arm else {"chose": use.label}
    return chose | {
        "arm": arm.label,
        "family": arm.family,
        "algo": arm.algo,
        "options": dict(arm.options),
        "seed": case.seed,
        "depth": case.depth,
        "key": case.key,
        "context_tokens": len(getattr(case, "prompt", None) or case.context),
        "answer": text,
        "correct": case.correct(text),
        "kv_bytes": kv,
        "prefill_step_size": prefill_step_size,
        "shared_prefill": shared,
    }


def summarize(rows, arms) -> list[dict]:
    table = []
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm.label]
        k, n = sum(r["correct"] for r in mine), len(mine)
        depths = sorted({round(r["depth"], 3) for r in mine})
        table.append(
            {
                "arm": arm.label,
                "family": arm.family,
                "algo": arm.algo,
                "budget": arm.options.get("budget"),
                "ran": ran(mine),  # auto's pick
                "correct": k,
                "cases": n,
                "accuracy": k / n if n else 0.0,
                "wilson95": wilson(k, n),
                # KV held when the answer was done (mean over cases)
                "kv_mb": sum(r["kv_bytes"] for r in mine) / max(1, n) / 1e6,
                "by_depth": {
                    str(d): sum(r["correct"] for r in mine if round(r["depth"], 3) == d)
                    / max(1, sum(1 for r in mine if round(r["depth"], 3) == d))
                    for d in depths
                },
            }
        )
    return table


def smallest_budget(table, family: str, full_accuracy: float, share=0.9):
    """Smallest evaluated budget of an arm family (its label without the budget)
    at or above share x full accuracy."""
    ok = [
        t["budget"]
        for t in table
        if t["family"] == family
        and t["budget"] is not None
        and t["accuracy"] >= share * full_accuracy
    ]
    return min(ok) if ok else None


__all__ = ["Arm", "answer", "run_case", "smallest_budget", "summarize"]
