"""scripts/quality_*.py are `veloxpatch eval` with their own defaults (no
harness of their own), passkey's --search, and the results doc reading both
schemas. No model loads here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from veloxpatch.errors import OptionError
from veloxpatch.eval.arms import Arm
from veloxpatch.eval.passkey import PasskeyCase
from veloxpatch.eval.tasks import PasskeyTask
from veloxpatch.eval.tasks import passkey as task_mod

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.mark.parametrize(
    "script,defaults",
    [
        ("quality_passkey.py", ["passkey", "default: 30", "keyformer"]),
        ("quality_ppl.py", ["ppl", "default: 2000", "full,streaming_llm,knorm"]),
    ],
)
def test_scripts_are_eval_with_their_defaults(script, defaults):
    done = subprocess.run(
        [sys.executable, f"scripts/{script}", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    # the script's usage, then eval's options showing the script's defaults
    assert f"scripts/{script}" in done.stdout
    assert "Usage: veloxpatch eval" in done.stdout
    for opt in ("--search", "--decode-lead-in", "--protocol", "--max-kv-bytes"):
        assert opt in done.stdout
    for text in defaults:
        assert text in done.stdout
    source = (ROOT / "scripts" / script).read_text()
    assert "argparse" not in source and "summarize" not in source


def test_a_script_checks_like_eval(tmp_path, monkeypatch):
    import quality_passkey

    from veloxpatch.loading import models

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(SystemExit) as done:
        quality_passkey.main(["--segments", "3", "--out", str(tmp_path / "r.json")])
    assert done.value.code == 2  # typed, not read by passkey: refused


def test_search_retries_families_under_90pct_until_they_reach_it(monkeypatch):
    """Fake answers: snapkv is right from budget 768 on, tova never, full always."""
    ran = []
    cases = [PasskeyCase([1, 2, 3], "12345", d, i) for i, d in enumerate((0.1, 0.9))]
    monkeypatch.setattr(task_mod, "make_cases", lambda *a, **k: cases)

    def run_case(model, tokenizer, case, arms, step, decode_lead_in=False):
        ran.append([a.label for a in arms])
        return [
            {
                "arm": a.label,
                "correct": a.algo == "full"
                or (a.algo == "snapkv" and a.options["budget"] >= 768),
                "depth": case.depth,
                "kv_bytes": 1,
            }
            for a in arms
        ]

    monkeypatch.setattr(task_mod, "run_case", run_case)
    arms = [Arm("full")] + [
        Arm(algo, {"budget": b}) for algo in ("snapkv", "tova") for b in (256, 512)
    ]
    ticks = []
    task = PasskeyTask(context=200, cases=2, search=(768, 1024, 2048))
    res = task.run(None, None, arms, tick=lambda: ticks.append(1))
    assert res["smallest_budget_for_90pct_of_full"] == {"snapkv": 768, "tova": None}
    # 768: both; 1024 and 2048: tova only (snapkv reached 90% of full)
    assert (
        ran[2:]
        == [["snapkv:budget=768", "tova:budget=768"]] * 2
        + [["tova:budget=1024"]] * 2
        + [["tova:budget=2048"]] * 2
    )
    assert len(ticks) == 8 <= task.steps()
    labels = [t["arm"] for t in res["table"]]
    assert labels[-1] == "tova:budget=2048" and len(res["raw"]) == 2 * len(labels)


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(search=(1024, 768)), "--search must list budgets in increasing order"),
        (dict(search=(768, 768)), "--search must list budgets in increasing order"),
        (dict(search=(0,)), "--search must be budgets of at least 1"),
        (dict(decode_lead_in=True, protocol="agnostic"), "--decode-lead-in needs"),
    ],
)
def test_passkey_task_checks_search_and_decode_lead_in(options, message):
    with pytest.raises(OptionError, match=message):
        PasskeyTask(**options)


def test_decode_lead_in_without_a_lead_in_is_refused_before_any_arm(monkeypatch):
    cases = [PasskeyCase([1, 2, 3], "12345", 0.5, 0, lead_in=0)]
    monkeypatch.setattr(task_mod, "make_cases", lambda *a, **k: cases)
    monkeypatch.setattr(task_mod, "run_case", lambda *a, **k: pytest.fail("ran"))
    task = PasskeyTask(context=200, cases=1, decode_lead_in=True)
    with pytest.raises(OptionError, match="no separable lead-in"):
        task.run(None, None, [Arm("full")], tick=lambda: None)


def test_a_script_writes_its_table_beside_its_results(tmp_path, monkeypatch):
    import eval_script

    from veloxpatch import cli

    out = tmp_path / "r.json"
    passkey = {"table": [_passkey_row("full", None, 3), _passkey_row("tova", 128, 1)]}
    res = {"run": {"git_commit": "abc1234"}, "config": {"tasks": "passkey"}}

    def fake_main(argv, **kw):
        out.write_text(json.dumps(res | {"passkey": passkey}))

    monkeypatch.setattr(cli, "main", fake_main)
    eval_script.run_eval("doc", {"out": "unused.json"}, ["--out", str(out)], False)
    text = out.with_suffix(".md").read_text()
    assert "veloxpatch eval \\\n    --tasks passkey" in text
    assert "| arm | 128 | no budget |" in text
    assert "| `tova` | 1/4 (2.0) |  |" in text and "| `full` |  | 3/4 (2.0) |" in text


def _passkey_row(family, budget, correct):
    return dict(family=family, budget=budget, correct=correct, cases=4, kv_mb=2.0)
