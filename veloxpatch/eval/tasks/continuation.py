"""Teacher-forced continuation after a compressed context: perplexity, greedy
agreement and KL against `full`. The task names `ppl` and `agreement` both run
it: one pass gives every metric, so asking for both costs one run."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ...prose import check_length, prose_length, prose_segments
from ..arms import ran
from ..metrics import evaluate_continuation
from .base import EvalTask, check_protocol, check_text, require


@dataclass
class ContinuationTask(EvalTask):
    name = "continuation"
    summary = "perplexity, agreement and KL against full after a compressed context"
    progress_label = "continuations"

    context: int = 1500
    continuation: int = 256
    segments: int = 2
    text: str = "evaluation"
    prefill_step_size: int = 2048
    protocol: str = "aware"  # "agnostic": the context compressed on its own

    def __post_init__(self):
        check_protocol(self.protocol)
        require(self.context >= 2, f"--context must be at least 2, got {self.context}")
        require(
            self.continuation >= 1,
            f"--continuation must be at least 1, got {self.continuation}",
        )
        require(
            self.segments >= 1, f"--segments must be at least 1, got {self.segments}"
        )
        require(self.prefill_step_size >= 1, "--prefill-step-size must be positive")
        check_text(self.text)

    def check_fits(self, tokenizer) -> None:
        total = prose_length(tokenizer, self.text)
        check_length(total, self.context + self.continuation, self.text)

    def steps(self) -> int:
        return self.segments

    def run(self, model, tokenizer, arms, tick) -> dict:
        """Raw rows and per-arm means of perplexity, agreement and KL against
        full, over `segments` stretches of prose spread over the text."""
        self.check_fits(tokenizer)
        stretches = prose_segments(
            tokenizer, self.context, self.continuation, self.segments, self.text
        )
        rows = []
        for seg, (context, cont) in enumerate(stretches):
            agnostic = tokenizer if self.protocol == "agnostic" else None
            for res in evaluate_continuation(
                model, arms, context, cont, self.prefill_step_size, agnostic
            ):
                rows.append(
                    {"segment": seg, "protocol": self.protocol, **res.as_dict()}
                )
            tick()
        return {"table": _table(rows, arms), "raw": rows}

    def summary_lines(self, result: dict) -> list[str]:
        lines = [f"{'continuation':<40} {'ppl':>8} {'agree':>6} {'KL':>7}   KV MB"]
        for t in result["table"]:
            lines.append(
                f"{t['arm']:<40} {t['perplexity']:8.3f} {t['agreement']:6.3f} "
                f"{t['kl']:7.4f} {t['kv_mb']:7.2f}"
            )
        return lines + [
            f"{t['arm']} ran {t['ran']}" for t in result["table"] if t["ran"]
        ]


def _table(rows, arms) -> list[dict]:
    table = []
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm.label]
        table.append(
            {
                "arm": arm.label,
                "family": arm.family,
                "algo": arm.algo,
                "budget": arm.options.get("budget"),
                "ran": ran(mine),  # auto's pick
                "perplexity": statistics.mean(r["perplexity"] for r in mine),
                "agreement": statistics.mean(r["agreement"] for r in mine),
                "kl": statistics.mean(r["kl"] for r in mine),
                "kv_mb": statistics.mean(r["kv_bytes"] for r in mine) / 1e6,
                "kl_profile": {
                    k: statistics.mean(r["kl_profile"][k] for r in mine)
                    for k in mine[0].get("kl_profile", {})
                },
            }
        )
    return table
