"""Passkey retrieval: a five-digit key hidden in prose, asked at the end."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import OptionError
from ...prose import check_length, prose_length
from ..agnostic import run_agnostic_case
from ..arms import Arm
from ..passkey import make_cases
from ..runner import run_case, smallest_budget, summarize
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
    # the answer's lead-in fed as answer tokens, so lookahead compresses before
    # the first digit is predicted (aware protocol only)
    decode_lead_in: bool = False
    # budgets tried, in order, for families under 90% of full at every budget
    search: tuple[int, ...] = ()

    def __post_init__(self):
        check_protocol(self.protocol)
        require(
            self.context > TEMPLATE_TOKENS,
            f"passkey needs --context above {TEMPLATE_TOKENS} tokens, "
            f"got {self.context}",
        )
        require(self.cases >= 1, f"--cases must be at least 1, got {self.cases}")
        require(self.prefill_step_size >= 1, "--prefill-step-size must be positive")
        require(
            not (self.decode_lead_in and self.protocol == "agnostic"),
            "--decode-lead-in needs --protocol aware (agnostic questions come "
            "after the compression anyway)",
        )
        self.search = tuple(self.search)
        listed = ",".join(map(str, self.search))
        require(
            all(isinstance(b, int) and b >= 1 for b in self.search),
            f"--search must be budgets of at least 1, got {listed}",
        )
        require(
            list(self.search) == sorted(set(self.search)),
            f"--search must list budgets in increasing order, got {listed}",
        )
        check_text(self.text)

    def check_fits(self, tokenizer) -> None:
        # each case reads context - TEMPLATE_TOKENS tokens of prose
        total = prose_length(tokenizer, self.text)
        check_length(total, self.context - TEMPLATE_TOKENS, self.text)

    def steps(self) -> int:
        # at most: each search budget reruns every case (the search may stop early)
        return self.cases * (1 + len(self.search))

    def run(self, model, tokenizer, arms, tick) -> dict:
        """Raw rows, the per-arm table (accuracy, Wilson interval, by depth) and
        the smallest budget per family keeping 90% of full's accuracy."""
        agnostic = self.protocol == "agnostic"
        cases = make_cases(
            tokenizer,
            self.cases,
            self.context,
            seed=self.seed,
            text_split=self.text,
            agnostic=agnostic,
        )
        if self.decode_lead_in and not all(c.lead_in for c in cases):
            raise OptionError(
                "--decode-lead-in: this model's prompt has no separable lead-in"
            )

        def run_all(some_arms) -> list[dict]:
            rows = []
            for case in cases:
                if agnostic:
                    rows += run_agnostic_case(
                        model, tokenizer, case, some_arms, self.prefill_step_size
                    )
                else:
                    rows += run_case(
                        model,
                        tokenizer,
                        case,
                        some_arms,
                        self.prefill_step_size,
                        decode_lead_in=self.decode_lead_in,
                    )
                tick()
            return rows

        arms = list(arms)
        rows = run_all(arms)
        for budget in self.search:
            more = _search_arms(summarize(rows, arms), arms, budget)
            if not more:
                break
            rows += run_all(more)
            arms += more
        table = summarize(rows, arms)
        return {
            "table": table,
            "smallest_budget_for_90pct_of_full": _smallest(table),
            "raw": rows,
        }

    def summary_lines(self, result: dict) -> list[str]:
        lines = [f"{'passkey':<40} {'acc':>5} {'k/n':>7}  wilson95      KV MB"]
        for t in result["table"]:
            lo, hi = t["wilson95"]
            lines.append(
                f"{t['arm']:<40} {t['accuracy']:5.2f} {t['correct']:>3}/{t['cases']:<3}"
                f"  [{lo:.2f}, {hi:.2f}]  {t['kv_mb']:6.2f}"
            )
        lines += [f"{t['arm']} ran {t['ran']}" for t in result["table"] if t["ran"]]
        smallest = result.get("smallest_budget_for_90pct_of_full")
        if smallest:
            lines.append(f"smallest budget keeping 90% of full: {smallest}")
        return lines


def _full_accuracy(table) -> float | None:
    return next((t["accuracy"] for t in table if t["arm"] == "full"), None)


def _smallest(table) -> dict:
    """{family: smallest budget at >= 90% of full, or None} for the families
    that have budgets (empty without a `full` row to compare with)."""
    full = _full_accuracy(table)
    if full is None:
        return {}
    families = sorted(
        {t["family"] for t in table if t["budget"] is not None and t["algo"] != "full"}
    )
    return {f: smallest_budget(table, f, full) for f in families}


def _search_arms(table, arms, budget: int) -> list[Arm]:
    """Each family still under 90% of full, at `budget`: its largest-budget arm
    with the budget replaced (none where the family already ran at `budget` or
    above)."""
    missing = [f for f, b in _smallest(table).items() if b is None]
    more = []
    for family in missing:
        mine = [a for a in arms if a.family == family and "budget" in a.options]
        top = max(mine, key=lambda a: a.options["budget"], default=None)
        if top is not None and top.options["budget"] < budget:
            more.append(Arm(top.algo, {**top.options, "budget": budget}))
    return more
