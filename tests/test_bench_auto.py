"""scripts/bench_auto.py: its cases state one fact once and ask it in other
words, and a tiny run writes the table in the auto table's format."""

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import smollm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_auto  # noqa: E402

ROW_KEYS = {
    "algo", "kv_bits", "fraction", "anchor", "n", "correct", "by_text",
    "budget_median", "kv_bytes_median", "prefill_s_median",
    "prefill_peak_bytes_median", "error",
}  # fmt: skip
TOP_KEYS = {
    "command", "commit", "model", "context_tokens", "texts", "cases_per_text",
    "fractions", "protocols", "rows",
}  # fmt: skip


def four_grams(text: str) -> set:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i : i + 4]) for i in range(len(words) - 3)}


def test_templates_paraphrase_and_answer():
    import random

    for fact_t, question, key, fillers in bench_auto.TEMPLATES:
        rng = random.Random(0)
        values = {k: f(rng) for k, f in fillers.items()}
        fact = fact_t.format(**values)
        assert not four_grams(fact) & four_grams(question), (fact, question)
        assert bench_auto.norm(str(values[key])) in bench_auto.norm(fact)


def test_correct_normalises_commas_and_spaces():
    case = bench_auto.Case("evaluation", 0, 0, 0.5, "", "", "4813", "")
    assert case.correct("It holds 4,813 boxes.")
    assert case.correct("4 813")
    assert not case.correct("4,812")


def test_bad_arguments_are_one_line_errors(capsys):
    for argv in (["--only", "nope"], ["--fractions", "0.2,1.5"], ["--cases", "0"]):
        with pytest.raises(SystemExit) as exit_:
            bench_auto.parse_args(argv)
        assert exit_.value.code == 2
        assert argv[0] in capsys.readouterr().err.strip().splitlines()[-1]


@smollm
def test_cases_state_the_fact_once_and_ask_it_in_other_words():
    from veloxpatch.loading.models import load

    _, tokenizer = load()
    cases = bench_auto.make_cases(tokenizer, 6, 600)
    assert {c.template for c in cases} == set(range(len(bench_auto.TEMPLATES)))
    for case in cases:
        ids = bench_auto.prompts(tokenizer, case)
        prompt = tokenizer.decode(ids["prompt"])
        assert prompt.count(case.fact) == 1
        assert case.question in prompt.split(case.fact)[1]
        assert not four_grams(case.fact) & four_grams(case.question)
        # the document the `after` protocol reads holds the fact, not the question
        document = tokenizer.decode(ids["document"])
        assert case.fact in document and case.question not in document
        assert 550 <= len(ids["prompt"]) <= 650
    again = bench_auto.make_cases(tokenizer, 6, 600)
    assert [c.body for c in again] == [c.body for c in cases]


@pytest.mark.slow
@smollm
def test_a_tiny_run_writes_the_contracts_table(tmp_path):
    out, table = tmp_path / "bench_auto.json", tmp_path / "auto_table.json"
    bench_auto.main(
        [
            "--cases", "1", "--context", "300", "--only", "streaming_llm",
            "--fractions", "0.35", "--out", str(out), "--table", str(table),
        ]
    )  # fmt: skip
    res = json.loads(table.read_text())
    assert set(res) == TOP_KEYS
    assert res["texts"] == ["evaluation", "licenses"]
    assert res["protocols"] == ["prompt", "after", "chat"]
    (row,) = res["rows"]
    assert set(row) == ROW_KEYS
    assert (row["algo"], row["kv_bits"], row["fraction"]) == ("streaming_llm", 16, 0.35)
    assert row["anchor"] is False and row["error"] is None and row["n"] == 2
    assert set(row["correct"]) == set(bench_auto.PROTOCOLS)
    assert set(row["by_text"]) == {"evaluation", "licenses"}
    for p in bench_auto.PROTOCOLS:
        assert row["correct"][p] == sum(t[p] for t in row["by_text"].values())
    assert row["budget_median"] > 0 and row["kv_bytes_median"] > 0
    assert row["prefill_s_median"] > 0 and row["prefill_peak_bytes_median"] > 0
    assert out.with_suffix(".md").is_file()


def test_only_names_one_configuration_and_merging_keeps_residuals_apart():
    picked = bench_auto.configs([0.2], {"kvzip 4-bit r32"})
    assert [(c.algo, c.kv_bits, c.kv_residual) for c in picked] == [("kvzip", 4, 32)]
    assert len(bench_auto.configs([0.2], {"kvzip"})) == 3  # 16, 4 r32, 4 r0
    old = [{"algo": "kvzip", "kv_bits": 4, "fraction": 0.2, "n": 8}]
    new = [{"algo": "kvzip", "kv_bits": 4, "kv_residual": 32, "fraction": 0.2, "n": 8}]
    assert bench_auto.merged(old, new) == old + new
    again = [{**new[0], "n": 9}]
    assert bench_auto.merged(old + new, again) == old + again
