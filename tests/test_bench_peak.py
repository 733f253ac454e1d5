"""Peak memory as a measure: `eval.bench.measure` splits the prefill's peak from
the decode's (tiny models), `veloxpatch bench` prints both with the chunk size,
scripts/bench_memory.py's arms parse and its runs are recorded (failures too),
and the results doc's section renders from a small synthetic file."""

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny import VOCAB, prompt_tokens, tiny_model

from veloxpatch.errors import OptionError
from veloxpatch.eval import bench
from veloxpatch.eval.arms import parse_arm, split_arms
from veloxpatch.memory import full_rows

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_memory as bm  # noqa: E402

CONTEXT = 384


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def ids(n=CONTEXT):
    return prompt_tokens(n).tolist()


def test_prefill_and_decode_peaks_are_measured_apart(model):
    # One chunk of the whole prompt materialises chunk x context scores per
    # layer; chunks of 16 do not. The decode holds the same KV either way.
    whole = bench.measure(model, parse_arm("unpatched"), ids(), 3, CONTEXT, rss=True)
    small = bench.measure(model, parse_arm("unpatched"), ids(), 3, 16, rss=True)
    for m in (whole, small):
        assert m["decoded"] == 3 and m["prefill_seconds"] > 0
        assert m["prefill_peak_bytes"] >= m["kv_bytes_prefill_end"] > 0
        assert m["decode_peak_bytes"] >= m["kv_bytes"] > 0
        top = max(m["prefill_peak_bytes"], m["decode_peak_bytes"])
        assert m["peak_memory_bytes"] == m["active_before_bytes"] + top
        if sys.platform.startswith("linux"):
            assert m["peak_rss_prefill_mb"] >= m["rss_before_mb"] > 0
            assert m["peak_rss_decode_mb"] > 0
    # the prefill's scores are not counted in the decode's peak
    assert whole["prefill_peak_bytes"] > 2 * whole["decode_peak_bytes"]
    assert whole["prefill_peak_bytes"] > 2 * small["prefill_peak_bytes"]
    assert whole["decode_peak_bytes"] == pytest.approx(
        small["decode_peak_bytes"], rel=0.2
    )


def test_budgeted_arm_holds_less_in_both_phases(model):
    full = bench.measure(model, parse_arm("unpatched"), ids(), 2, 32)
    snap = parse_arm("snapkv:budget=32,window=8,compress=chunks,chunk=32")
    cut = bench.measure(model, snap, ids(), 2, 32)
    assert cut["kv_bytes"] < full["kv_bytes"] / 4
    assert cut["decode_peak_bytes"] < full["decode_peak_bytes"] / 2
    assert cut["prefill_peak_bytes"] < full["prefill_peak_bytes"]
    # the most held at once: budget + chunk rows against the whole prompt, which
    # the prompt-end mode holds until the prompt ends
    row = full["kv_bytes_prefill_end"] / full_rows(CONTEXT)  # mlx-lm allocates ahead
    assert full["kv_peak_bytes"] == full["kv_bytes_prefill_end"]
    queries = 3 * 4 * 8 * 16 * 4  # its window's queries: layers, heads, D, fp32
    assert cut["kv_peak_bytes"] <= 1.1 * (32 + 32) * row + queries  # + positions
    assert cut["kv_peak_bytes"] > cut["kv_bytes_prefill_end"]
    end = bench.measure(model, parse_arm("snapkv:budget=32,window=8"), ids(), 2, 32)
    assert end["kv_peak_bytes"] == CONTEXT * row + queries > 4 * end["kv_bytes"]


class _Tokenizer:
    """Enough of a tokenizer for prose_tokens."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % VOCAB for c in text]


def test_bench_prints_prefill_and_decode_peaks_with_the_chunk(
    model, tmp_path, monkeypatch
):
    from veloxpatch.cli import main
    from veloxpatch.loading import models

    monkeypatch.setattr(models, "load", lambda *a, **k: (model, _Tokenizer()))
    out = tmp_path / "b.json"
    args = ["bench", "--arms", "streaming_llm:budget=32", "--contexts", "64,128"]
    args += ["--repeats", "1", "--decode-tokens", "2", "--prefill-step-size", "48"]
    res = CliRunner().invoke(main, args + ["--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "prefill chunk 48 tokens" in res.output
    header = next(line for line in res.output.splitlines() if "ctx" in line)
    for column in ("KV MB", "prefill pk", "decode pk", "peak MB", "ratio"):
        assert column in header
    data = json.loads(out.read_text())
    assert data["config"]["prefill_step_size"] == 48
    assert len(data["table"]) == 4
    for t in data["table"]:
        assert t["prefill_step_size"] == 48
        assert t["prefill_peak_bytes"] > 0 and t["decode_peak_bytes"] > 0
        assert t["peak_memory_bytes"] > t["prefill_peak_bytes"]  # weights in it
    assert all("prefill_peak_bytes" in r for r in data["raw"])


def test_default_arms_cover_every_budgeted_algorithm_and_parse():
    from veloxpatch.caches import ALGORITHMS
    from veloxpatch.eval.arms import takes_budget

    arms = bm.default_arms(256)
    assert arms[:3] == [
        "unpatched",
        "mlx.rotating:budget=256",
        "mlx.quantized:kv_bits=4",
    ]
    for name in ALGORITHMS:  # kvzap needs its scorer file: given by the user
        want = takes_budget(name) and name != "kvzap"
        assert (f"{name}:budget=256" in arms) == want
    assert "snapkv:budget=256,compress=chunks" in arms
    assert "full" not in arms and "kivi" not in " ".join(arms)
    assert bm.check_arms(arms) == arms
    # options pass through as written (labels sort them)
    text = "snapkv:budget=512,compress=chunks,chunk=256,unpatched"
    assert bm.check_arms(split_arms(text)) == [
        "snapkv:budget=512,chunk=256,compress=chunks",
        "unpatched",
    ]
    with pytest.raises(OptionError):
        bm.check_arms(["snapkv:budget=512,bogus=1"])
    with pytest.raises(SystemExit):
        bm.check_arms(["unpatched", "unpatched"])


def test_contexts_and_prefill_step_arguments():
    args = bm.parse_args(["--contexts", "2048,4096", "--prefill-step", "512"])
    assert args.context_list == [2048, 4096] and args.prefill_step_size == 512
    assert bm.parse_args(["--context", "4000"]).context_list == [4000]  # as before
    assert bm.parse_args([]).prefill_step_size == 2048  # mlx-lm's default
    with pytest.raises(SystemExit):
        bm.parse_args(["--contexts", ""])


def _row(arm, context, prefill, decode, kv, step=512):
    m = {
        "active_before_bytes": 500_000_000,
        "prefill_peak_bytes": prefill,
        "decode_peak_bytes": decode,
        "kv_bytes": kv,
        "kv_bytes_prefill_end": kv,
        "kv_peak_bytes": kv if "chunks" in arm or "budget" not in arm else 2 * kv,
        "decoded": 4,
        "prefill_seconds": 2.5,
        "prefill_tok_per_s": context / 2.5,
        "decode_tok_per_s": 10.0,
        "rss_before_mb": 700.0,
        "peak_rss_prefill_mb": 900.0,
        "rss_decode_start_mb": 880.0,
        "peak_rss_decode_mb": 890.0,
    }
    loaded = {"weights_bytes": 499_000_000, "rss_after_load_mb": 700.0}
    return bm.row_of(arm, context, step, m, loaded)


def _results():
    rows = []
    for context in (2048, 16384):
        s = context / 2048
        rows += [
            _row("unpatched", context, int(300e6 * s), int(100e6 * s), int(90e6 * s)),
            _row("snapkv:budget=512", context, int(400e6 * s), 20e6, 12e6),
            _row(
                "snapkv:budget=512,chunk=256,compress=chunks", context, 60e6, 20e6, 12e6
            ),
        ]
    rows.append({"arm": "kvzip:budget=512", "context": 16384, "error": "Err: a|b"})
    config = {
        "arms": "unpatched,snapkv:budget=512,snapkv:budget=512,compress=chunks",
        "contexts": "2048,16384",
        "decode_tokens": 4,
        "prefill_step_size": 512,
        "text": "evaluation",
        "out": "scripts/results/bench_memory_peak.json",
    }
    run = {"git_commit": "abc1234", "time_utc": "2026-01-01T00:00:00Z"}
    return {"run": run, "config": config, "rows": rows}


def test_runs_are_recorded_failures_too_and_plotted(tmp_path, monkeypatch):
    res = _results()
    by = {(r["arm"], r["context"]): r for r in res["rows"]}
    run_child = bm.run_child
    monkeypatch.setattr(bm, "run_child", lambda arm, args, context: by[arm, context])
    monkeypatch.setattr("veloxpatch.eval.runinfo.run_info", lambda: res["run"])
    out = tmp_path / "peak.json"
    arms = "unpatched,snapkv:budget=512,kvzip:budget=512"
    bm.main(["--arms", arms, "--contexts", "16384", "--out", str(out)])
    data = json.loads(out.read_text())
    assert [r["arm"] for r in data["rows"]] == split_arms(arms)
    assert "error" in data["rows"][-1]
    svg = (tmp_path / "peak.svg").read_text()
    assert svg.startswith("<svg") and "snapkv:budget=512" in svg
    assert "kvzip" not in svg  # failed runs are not drawn

    # a child that dies is a row with its error, not the end of the benchmark
    class Done:
        returncode, stdout, stderr = -9, "", "Traceback...\nMemoryError: boom"

    monkeypatch.setattr(bm.subprocess, "run", lambda *a, **k: Done)
    args = bm.parse_args(["--prefill-step", "512"])
    row = run_child("unpatched", args, 4096)
    assert row == {
        "arm": "unpatched",
        "context": 4096,
        "prefill_step_size": 512,
        "error": "exit -9: MemoryError: boom",
    }


def test_add_runs_only_what_the_file_lacks(tmp_path, monkeypatch):
    res = _results()
    by = {(r["arm"], r["context"]): r for r in res["rows"]}
    for context in (2048, 16384):
        by["kvzip:budget=512", context] = _row("kvzip:budget=512", context, 9, 9, 9)
    ran = []

    def run_child(arm, args, context):
        ran.append((arm, context))
        return by[arm, context]

    monkeypatch.setattr(bm, "run_child", run_child)
    monkeypatch.setattr("veloxpatch.eval.runinfo.run_info", lambda: res["run"])
    out = tmp_path / "peak.json"
    out.write_text(json.dumps(res))
    arms = "unpatched,kvzip:budget=512"
    argv = ["--arms", arms, "--contexts", "2048,16384", "--out", str(out)]
    argv += ["--decode-tokens", "4", "--plot", "none"]
    bm.main(argv + ["--prefill-step", "512", "--add"])
    assert ran == [("kvzip:budget=512", 2048), ("kvzip:budget=512", 16384)]
    data = json.loads(out.read_text())
    assert len(data["rows"]) == len(res["rows"]) + 1  # the failed run done again
    assert not any("error" in r for r in data["rows"])
    assert data["config"]["added"][0]["contexts"] == "2048,16384"
    with pytest.raises(SystemExit, match="prefill_step_size 512, not 256"):
        bm.main(argv + ["--prefill-step", "256", "--add"])


def test_plot_has_one_line_per_arm_and_chunk_size():
    svg = bm.plot_svg(_results())
    assert svg.count("<polyline") == 2 * 3  # two panels, three arms drawn
    assert "prefill chunk 512" in svg and "16,384" in svg


def test_markdown_table_beside_the_results(tmp_path):
    out = tmp_path / "bench_memory_peak.json"
    text = bm.write_markdown(out, _results()).read_text()
    assert "--prefill-step 512" in text and "--contexts 2048,16384" in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == 7
    assert rows[0].startswith("| `unpatched` | 2,048 | 512 | 300.0 | 100.0 | 90.0 |")
    failed = next(r for r in rows if "failed" in r)
    assert "a\\|b" in failed  # escaped: one cell
    assert failed.count("|") - failed.count("\\|") == rows[0].count("|")


def test_long_prompt_markdown(tmp_path):
    import long_prompt

    rows = [
        dict(arm=a, prompt_tokens=16384, peak_bytes=p, kv_held_bytes=k)
        | dict(prefill_tok_s=100.0, seconds=10.0, command="x", reply="y")
        for a, p, k in (("unpatched", 900e6, 780e6), ("snapkv_chunks", 60e6, 20e6))
    ]
    config = dict(tokens=16384, prefill_step=512, chunk=256, max_kv_bytes="24MB")
    config |= dict(arms="unpatched,snapkv_chunks", out="x.json", max_tokens=16)
    run = {"git_commit": "abc1234", "time_utc": "2026-01-01T00:00:00Z"}
    res = {"run": run, "config": config, "table": rows}
    text = long_prompt.write_markdown(tmp_path / "lp.json", res).read_text()
    assert "| `snapkv_chunks` | 16,384 | 60.0 | 20.0 | 100.0 |" in text
    assert "--max-kv-bytes 24MB" in text and "--chunk 256" in text
