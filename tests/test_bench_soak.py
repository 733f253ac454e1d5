"""scripts/bench_soak.py: the summary's arithmetic (percentiles, RSS at the
quarters, flatness after warm-up, what counts as unexpected), and a run of a
few seconds with one user against a stand-in server (tests/soak_fake_server.py):
every kind of request made and answered as expected, the samples taken, the
server's process group gone afterwards, the table written."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_soak as bs  # noqa: E402


def test_percentile_interpolates_between_ranks():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert bs.percentile(xs, 50) == pytest.approx(2.5)
    assert bs.percentile(xs, 90) == pytest.approx(3.7)
    assert bs.percentile(xs, 99) == pytest.approx(3.97)
    assert bs.percentile(xs, 0) == 1.0
    assert bs.percentile(xs, 100) == 4.0
    assert bs.percentile([7.0], 99) == 7.0
    assert bs.percentile([], 50) is None


def _samples(rss):
    return [{"t": 10.0 * i, "rss_bytes": v} for i, v in enumerate(rss)]


def test_flatness_counts_only_samples_after_warmup():
    s = _samples([100, 500, 1000, 1050, 1080, 1000])
    f = bs.flatness(s, warmup_s=20)
    assert (f["max"], f["min"]) == (1080, 1000)
    assert f["ratio"] == pytest.approx(1.08)
    assert f["flat"] is True
    assert bs.flatness(s, warmup_s=10)["flat"] is False  # 1080 / 500
    assert bs.flatness(s, warmup_s=100)["ratio"] is None


def test_value_at_takes_the_last_sample_before():
    s = _samples([100, 200, 300])
    assert bs.value_at(s, 15, "rss_bytes") == 200
    assert bs.value_at(s, 20, "rss_bytes") == 300
    assert bs.value_at(s, 1e9, "rss_bytes") == 300
    assert bs.value_at([{"t": 5.0, "rss_bytes": 9}], 1, "rss_bytes") == 9


def test_summary_statuses_quarters_and_unexpected():
    samples = _samples([100, 200, 300, 310, 305, 300, 320, 330, 300])
    records = [
        {"kind": "new", "status": 200, "ttft_s": 1.0},
        {"kind": "followup", "status": 200, "ttft_s": 3.0},
        {"kind": "retry", "status": 200, "ttft_s": 2.0, "same_text": True},
        {"kind": "retry", "status": 503, "ttft_s": None},
        {"kind": "disconnect", "status": "ConnectionResetError", "ttft_s": None},
        {"kind": "bad", "status": 400, "ttft_s": None},
        {"kind": "bad", "status": 200, "ttft_s": None},
    ]
    s = bs.summarize(samples, records, seconds=80)
    assert s["requests"] == 7
    assert s["statuses"] == {"200": 4, "503": 1, "ConnectionResetError": 1, "400": 1}
    assert s["statuses_by_kind"]["bad"] == {"400": 1, "200": 1}
    assert s["unexpected"] == 3  # the 503, the reset and the bad request's 200
    assert s["ttft_s"]["p50"] == pytest.approx(2.0)
    assert s["ttft_s_p50_by_kind"]["followup"] == 3.0
    assert s["retries_same_text"] == "1/1"
    assert [q["rss_bytes"] for q in s["rss_at"]] == [300, 305, 320, 300]
    assert [q["minutes"] for q in s["rss_at"]] == [0.33, 0.67, 1.0, 1.33]
    assert s["rss_after_warmup"]["ratio"] == pytest.approx(330 / 300)
    assert s["rss_max_bytes"] == 330


def test_bad_options_are_refused(capsys):
    for argv in (
        ["--users", "0"],
        ["--minutes", "0"],
        ["--doc-tokens-min", "900", "--doc-tokens-max", "300"],
        ["--serve-args", "--algo kvzip --port 9"],
        ["--text", "calibration"],
    ):
        with pytest.raises(SystemExit) as e:
            bs.parse_args(argv)
        assert e.value.code == 2
    assert "--host or --port" in capsys.readouterr().err


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (reparented, not yet reaped)."""
    try:
        return "State:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True


@pytest.mark.slow  # the soak script end to end: research tooling
def test_a_short_run_against_a_stand_in_server(tmp_path):
    args = bs.parse_args(
        ["--users", "1", "--minutes", "0.05", "--sample-s", "0.5"]
        + ["--doc-tokens-min", "50", "--doc-tokens-max", "100", "--drain-s", "5"]
        + ["--request-timeout", "10", "--start-timeout", "20"]
    )
    port = bs.free_port()
    fake = [sys.executable, str(ROOT / "tests" / "soak_fake_server.py"), str(port)]
    row = bs.soak(fake, port, args, tmp_path / "server.log")

    kinds = {r["kind"] for r in row["records"]}
    assert kinds == set(bs.KINDS)  # the seeded mix reaches every kind
    assert row["unexpected"] == 0, row["statuses"]
    assert set(row["statuses_by_kind"]["bad"]) == {"400"}
    done, total = map(int, row["retries_same_text"].split("/"))
    assert done == total > 0
    assert row["ttft_s"]["p50"] is not None
    assert len(row["samples"]) >= 3
    assert all(s["rss_bytes"] > 0 for s in row["samples"])
    assert {s["prompt_cache_bytes"] for s in row["samples"]} == {2000}
    assert row["unfinished_at_end"] == 0

    # the group (timeout and the server under it) is gone
    pids = [
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit() and f"soak_fake_server.py\0{port}" in _cmdline(p)
    ]
    deadline = time.time() + 5
    while pids and not all(_gone(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids)
    assert bs.health(port) is None

    out = tmp_path / "bench_soak.json"
    res = {"run": {}, "command": "bench_soak.py", "config": {}, "table": []}
    res["table"].append({"arm": "fake", "users": 1, **row})
    bs.write_plot(out, res)
    json.dumps(res)  # what write_results writes
    md = bs.write_markdown(out, res).read_text()
    assert "| `fake` | 1 | 0 |" in md
    if "skipped" in res["plot"]:
        assert "matplotlib" in md
    else:
        assert out.with_suffix(".png").is_file()


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def test_a_second_run_joins_only_a_file_with_the_same_settings(tmp_path, capsys):
    config = {k: v for k, v in vars(bs.parse_args([])).items() if k != "add"}
    path = tmp_path / "bench_soak.json"
    path.write_text(json.dumps({"config": config, "table": [{"arm": "a"}]}))
    assert bs.added_to(path, config)["table"] == [{"arm": "a"}]
    with pytest.raises(SystemExit) as e:
        bs.added_to(path, {**config, "minutes": 5})
    assert e.value.code == 2
    assert "minutes 20" in capsys.readouterr().err
