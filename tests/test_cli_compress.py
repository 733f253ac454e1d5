"""`veloxpatch compress` then `veloxpatch generate --cache`: one compressed
context, several questions."""

import shutil
from pathlib import Path
from pydoc_data.topics import topics

import pytest
from click.testing import CliRunner
from conftest import smollm

from veloxpatch.cli import main


def run(*args):
    return CliRunner().invoke(main, list(args))


@smollm
def test_compress_once_then_ask_twice(tmp_path):
    ctx = tmp_path / "ctx.txt"
    ctx.write_text(topics["assert"][:2000])
    out = tmp_path / "ctx.safetensors"
    made = run("compress", "--context", str(ctx), "--budget", "48", "--out", str(out))
    assert made.exit_code == 0, made.output
    assert "compressed by kvzip" in made.output and out.exists()
    for question in ("What does assert do?", "When is AssertionError raised?"):
        got = run(
            "generate", "--cache", str(out), "--prompt", question, "--max-tokens", "8"
        )
        assert got.exit_code == 0, got.output
        assert "[kvzip]" in got.output and "KV held" in got.output


@smollm
def test_a_cache_asked_from_another_directory_finds_its_scorer(tmp_path, monkeypatch):
    # the scorer was named relative to where compress ran
    scorer = (
        Path(__file__).parents[1] / "scripts/results/smollm2_kvzap_linear.safetensors"
    )
    shutil.copy(scorer, tmp_path / "s.safetensors")
    (tmp_path / "ctx.txt").write_text(topics["assert"][:1000])
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    made = run(
        "compress", "--context", "ctx.txt", "--algo", "kvzap", "--budget", "48",
        "--algo-arg", "scorer=s.safetensors", "--out", "ctx.safetensors",
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    monkeypatch.chdir(tmp_path / "elsewhere")
    ask = ["--prompt", "Why?", "--max-tokens", "4"]
    got = run("generate", "--cache", "../ctx.safetensors", *ask)
    assert got.exit_code == 0, got.output
    assert "[kvzap]" in got.output


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--algo", "snapkv"], "--algo"),
        (["--max-kv-bytes", "1MB"], "--max-kv-bytes"),
        (["--budget", "32", "--algo-arg", "kv_bits=2"], "--budget, --algo-arg"),
    ],
)
def test_cache_decides_the_algorithm(tmp_path, flags, named):
    # the flags the user gave are named, whichever they are (the file's
    # algorithm is not the default `full` the options would be checked against)
    f = tmp_path / "c.safetensors"
    f.write_bytes(b"x")
    got = run("generate", "--cache", str(f), *flags, "--prompt", "q")
    assert got.exit_code == 2
    assert got.output.strip().splitlines() == [
        f"veloxpatch: error: --cache gives the algorithm and its options; drop {named}"
    ]


def test_compress_refuses_a_non_utf8_context(tmp_path):
    ctx = tmp_path / "ctx.txt"
    ctx.write_bytes(b"caf\xe9")
    got = run(
        "compress", "--context", str(ctx), "--out", str(tmp_path / "o.safetensors")
    )
    assert got.exit_code == 2 and "not valid UTF-8" in got.output
    assert not (tmp_path / "o.safetensors").exists()
