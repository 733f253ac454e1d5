"""`veloxpatch eval` and `veloxpatch bench` end to end on the embedded model,
small enough to be quick; the metrics themselves are tested in test_eval."""

import json
import sys
from dataclasses import dataclass

import pytest
from click.testing import CliRunner
from conftest import smollm
from tiny import prompt_tokens, tiny_model

from veloxpatch.cli import main
from veloxpatch.eval.metrics import evaluate_continuation
from veloxpatch.eval.tasks import EvalTask


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@smollm
def test_eval_writes_tables_raw_rows_and_reports_skipped(tmp_path, monkeypatch):
    from veloxpatch.eval import peers

    monkeypatch.setattr(peers, "veloxquant_available", lambda: False)
    out = tmp_path / "r.json"
    res = run(
        "eval",
        "--arms",
        "streaming_llm,mlx.rotating,mlx.quantized:kv_bits=8,veloxquant.tova",
        "--budgets",
        "64",
        "--tasks",
        "passkey,ppl",
        "--context",
        300,
        "--cases",
        1,
        "--segments",
        1,
        "--continuation",
        12,
        "--out",
        out,
    )
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    labels = [t["arm"] for t in data["passkey"]["table"]]
    assert labels[0] == "full"  # added as the reference
    assert "streaming_llm:budget=64" in labels and "mlx.rotating:budget=64" in labels
    assert "mlx.quantized:kv_bits=8" in labels  # no budget: not expanded
    assert len(data["passkey"]["raw"]) == len(labels)
    cont = {t["arm"]: t for t in data["continuation"]["table"]}
    assert cont["full"]["kl"] == 0 and cont["full"]["agreement"] == 1
    assert cont["streaming_llm:budget=64"]["kv_mb"] < cont["full"]["kv_mb"]
    assert cont["mlx.rotating:budget=64"]["kv_mb"] < cont["full"]["kv_mb"]
    assert [s["arm"] for s in data["skipped"]] == ["veloxquant.tova:budget=64"]
    assert "skipped veloxquant.tova" in res.output
    assert data["run"]["mlx_lm"] and "passkey" in res.output
    # not a terminal: one progress line per case
    assert "passkey cases: 1/1" in res.output


def test_eval_rejects_bad_arms_before_running(tmp_path):
    out = tmp_path / "r.json"
    for arms, msg in [
        ("nope", "unknown algorithm 'nope'"),
        ("snapkv:window=0", "window"),
        ("mlx.rotating:budget=0", "budget"),
        ("mlx.quantized:kv_bits=7", "kv_bits"),
        ("veloxquant.adakv:budget=64", "no veloxquant equivalent"),
    ]:
        res = run("eval", "--arms", arms, "--out", out)
        assert res.exit_code == 2, (arms, res.output)
        assert msg in res.output.strip().splitlines()[-1]
    res = run("eval", "--arms", "full", "--tasks", "speed", "--out", out)
    assert res.exit_code == 2 and "unknown task" in res.output
    assert not out.exists()


@smollm
@pytest.mark.parametrize("command", ["eval", "bench"])
def test_an_arm_the_model_cannot_hold_fails_before_any_arm_runs(
    tmp_path, monkeypatch, command
):
    # A byte budget's rows depend on the model: checked once it is loaded,
    # before the arms ahead of it (full here) spend their time.
    from veloxpatch.eval import bench
    from veloxpatch.eval.tasks import TASKS

    never = lambda *a, **k: pytest.fail("an arm ran")  # noqa: E731
    for task in TASKS.values():
        monkeypatch.setattr(task, "run", never)
    monkeypatch.setattr(bench, "measure", never)
    out = tmp_path / "r.json"
    res = run(command, "--arms", "full,snapkv:max_kv_bytes=20KB", "--out", out)
    assert res.exit_code == 2, res.output
    assert "max_kv_bytes='20KB' buys" in res.output.strip().splitlines()[-1]
    assert not out.exists()


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    res = run("eval", "--arms", "full", "--out", tmp_path / "r.json", "--plot", "p.png")
    assert res.exit_code == 2
    assert "pip install 'veloxpatch[plot]'" in res.output


@smollm
def test_bench_measures_against_unpatched(tmp_path):
    out = tmp_path / "b.json"
    res = run(
        "bench",
        "--arms",
        "streaming_llm,mlx.rotating",
        "--budgets",
        32,
        "--contexts",
        80,
        "--repeats",
        2,
        "--decode-tokens",
        3,
        "--out",
        out,
    )
    assert res.exit_code == 0, res.output
    table = {t["arm"]: t for t in json.loads(out.read_text())["table"]}
    assert set(table) == {
        "unpatched",
        "streaming_llm:budget=32",
        "mlx.rotating:budget=32",
    }
    assert table["unpatched"]["decode_ratio"] == 1.0
    assert table["streaming_llm:budget=32"]["kv_bytes"] < table["unpatched"]["kv_bytes"]
    assert all(
        t["prefill_tok_per_s"] > 0 and t["peak_memory_bytes"] > 0
        for t in table.values()
    )


def test_eval_checks_task_options_before_loading(tmp_path, monkeypatch):
    from veloxpatch.loading import models

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("loaded"))
    out = tmp_path / "r.json"
    res = run(
        "eval", "--arms", "full", "--tasks", "passkey", "--cases", 0, "--out", out
    )
    assert res.exit_code == 2 and "--cases must be at least 1" in res.output
    assert not out.exists()


@dataclass
class ToyTask(EvalTask):
    """A task as a user would add one: next-token agreement with full after a
    random context on whatever model `eval` loads."""

    name = "toy"
    summary = "greedy agreement with full over a few tokens"
    progress_label = "toy contexts"

    context: int = 1500
    prefill_step_size: int = 2048

    def steps(self):
        return 1

    def run(self, model, tokenizer, arms, tick):
        ids = prompt_tokens(self.context).tolist()
        res = evaluate_continuation(
            model, arms, ids[:-4], ids[-4:], self.prefill_step_size
        )
        tick()
        return {"table": [{"arm": r.arm, "agreement": r.agreement} for r in res]}

    def summary_lines(self, result):
        return ["toy"] + [f"{t['arm']} {t['agreement']:.2f}" for t in result["table"]]


def test_a_new_task_is_one_class_and_one_registry_line(tmp_path, monkeypatch):
    from veloxpatch.eval.tasks import TASKS
    from veloxpatch.loading import models

    monkeypatch.setitem(TASKS, "toy", ToyTask)  # the one line
    monkeypatch.setattr(models, "load", lambda *a, **k: (tiny_model("llama"), None))
    out = tmp_path / "r.json"
    res = run(
        "eval",
        "--arms",
        "streaming_llm:budget=8,sinks=2",
        "--tasks",
        "toy",
        "--context",
        48,
        "--prefill-step-size",
        16,
        "--out",
        out,
    )
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert "passkey" not in data and "continuation" not in data
    table = {t["arm"]: t["agreement"] for t in data["toy"]["table"]}
    assert set(table) == {"full", "streaming_llm:budget=8,sinks=2"}
    assert table["full"] == 1.0
    assert "toy contexts: 1/1" in res.output and "\ntoy\nfull 1.00\n" in res.output
