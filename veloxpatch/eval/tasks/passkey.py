"""Passkey retrieval: a five-digit key hidden in prose, asked at the end."""

from __future__ import annotations

from dataclasses import dataclass

from ..agnostic import run_agnostic_case
from ..passkey import make_cases
from ..runner import run_case, summarize
from ..text import check_length, prose_length
from .base import EvalTask, check_protocol, check_text, require

# make_case spends about this many tokens on the instructions, needle and question
TEMPLATE_TOKENS = 80


@dataclass
class PasskeyTask(EvalTask):
    name = "passkey"
    summary = "passkey accuracy (Wilson interval, by depth) per arm"
    progress_label = "passkey cases"

    context: int = 1500
    cases: int = 20
    seed: int = 0
    text: str = "evaluation"
    prefill_step_size: int = 2048
    protocol: str = "aware"  # or "agnostic": compressed before any question

    def __post_init__(self):
        check_protocol(self.protocol)
        require(
            self.context > TEMPLATE_TOKENS,
            f"passkey needs --context above {TEMPLATE_TOKENS} tokens, "
            f"got {self.context}",
        )
        require(self.cases >= 1, f"--cases must be at least 1, got {self.cases}")
        require(self.prefill_step_size >= 1, "--prefill-step-size must be positive")
        check_text(self.text)

    def check_fits(self, tokenizer) -> None:
        # each case reads context - TEMPLATE_TOKENS tokens of prose
        total = prose_length(tokenizer, self.text)
        check_length(total, self.context - TEMPLATE_TOKENS, self.text)

    def steps(self) -> int:
        return self.cases

    def run(self, model, tokenizer, arms, tick) -> dict:
        """Raw rows and the per-arm table (accuracy, Wilson interval, by depth)."""
        rows = []
        agnostic = self.protocol == "agnostic"
        cases = make_cases(
            tokenizer,
            self.cases,
            self.context,
            seed=self.seed,
            text_split=self.text,
            agnostic=agnostic,
        )
        run = run_agnostic_case if agnostic else run_case
        for case in cases:
            rows += run(model, tokenizer, case, arms, self.prefill_step_size)
            tick()
        return {"table": summarize(rows, arms), "raw": rows}

    def summary_lines(self, result: dict) -> list[str]:
        lines = [f"{'passkey':<40} {'acc':>5} {'k/n':>7}  wilson95      KV MB"]
        for t in result["table"]:
            lo, hi = t["wilson95"]
            lines.append(
                f"{t['arm']:<40} {t['accuracy']:5.2f} {t['correct']:>3}/{t['cases']:<3}"
                f"  [{lo:.2f}, {hi:.2f}]  {t['kv_mb']:6.2f}"
            )
        return lines
