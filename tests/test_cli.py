"""The click CLI: listing, generation stats, and one-line user errors."""

from click.testing import CliRunner
from conftest import smollm

from veloxpatch.cli import main


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


def test_list_shows_algorithms_and_architectures():
    out = run("list", "--verbose")
    assert out.exit_code == 0
    for word in ("full", "streaming_llm", "knorm", "qwen3_moe", "ministral3", "BLAS:"):
        assert word in out.output
    assert "lookahead=0" in out.output  # options with their defaults
    assert "lookahead=k waits" in run("list").output  # the trade-off, also short


def test_unknown_algorithm_is_one_line_exit_2():
    out = run("generate", "--algo", "nope", "--prompt", "hi")
    assert out.exit_code == 2
    lines = out.output.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("veloxpatch: error: unknown algorithm 'nope'; ")
    assert "available: full, a2ats, adakv" in lines[0]


def test_bad_option_is_one_line_exit_2():
    out = run("generate", "--algo", "knorm", "--budget", "3", "--prompt", "hi")
    assert out.exit_code == 2 and "budget (3) must exceed" in out.output
    out = run("generate", "--algo", "knorm", "--algo-arg", "window", "--prompt", "x")
    assert out.exit_code == 2 and "KEY=VALUE" in out.output
    assert "Traceback" not in out.output


def test_missing_model_is_one_line_exit_2(tmp_path):
    out = run("generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "hi")
    assert out.exit_code == 2 and len(out.output.strip().splitlines()) == 1


@smollm
def test_generate_streams_and_prints_stats():
    out = run(
        "generate",
        "--algo",
        "streaming_llm",
        "--budget",
        "24",
        "--max-tokens",
        "12",
        input="What is the capital of France?",
    )
    assert out.exit_code == 0, out.output
    text, stats = out.output.strip().rsplit("\n", 1)
    assert text.strip()
    assert stats.startswith("[streaming_llm] prompt 37 tok | generated 12 tok")
    assert "prefill" in stats and "decode" in stats
    held = int(stats.split("KV held ")[1].split(" B")[0].replace(",", ""))
    full = int(stats.split("full KV ")[1].split(" B")[0].replace(",", ""))
    assert held < full  # 24 rows of 49 tokens (fp32, positions included)
