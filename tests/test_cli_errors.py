"""Every bad input of every subcommand: exit status 2, exactly one line on stderr
(`veloxpatch: error: ...`), no traceback, nothing written, and the error before
the model loads (or, for what needs the tokenizer, before any work).

Runs in-process through click's CliRunner, `models.load` replaced by a recorder;
two real subprocess runs cover undecodable bytes on stdin and in argv.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from veloxpatch.cli import main
from veloxpatch.loading import models

ROOT = Path(__file__).resolve().parents[1]
AR = "--arms snapkv --out r.json"  # a valid arm and results file, for eval and bench
CAL = "calibrate --out c.safetensors"

# (command line, message): the error must come before models.load is called
BEFORE_LOAD = [
    ("generate --max-tokens 0", "--max-tokens must be at least 1, got 0"),
    ("generate --max-tokens -3", "--max-tokens must be at least 1, got -3"),
    ("generate --max-tokens many", "--max-tokens must be an integer, got 'many'"),
    ("generate --temp -1", "--temp must be a finite number >= 0, got -1"),
    ("generate --temp nan", "--temp must be a finite number >= 0, got nan"),
    ("generate --temp inf", "--temp must be a finite number >= 0, got inf"),
    ("generate --temp warm", "--temp must be a number, got 'warm'"),
    ("generate --algo streaming_llm --budget -5", "budget must be >= 1, got -5"),
    ("generate --algo knorm --budget 64 --algo-arg budget=32", "budget given twice"),
    (
        "generate --algo knorm --algo-arg sinks=2 --algo-arg sinks=3",
        "option 'sinks' given twice",
    ),
    (
        "generate --algo pyramidkv --algo-arg beta=nan",
        "beta must be a finite number",
    ),
    ("generate --algo knorm --algo-arg sinks", "expected KEY=VALUE"),
    ("generate --algo nope", "unknown algorithm 'nope'"),
    ("generate --model ''", "--model must not be empty"),
    ("generate --prompt '  '", "empty prompt"),
    (
        "generate --prompt 'caf\udce9'",
        "--prompt is not valid UTF-8 (byte 0xe9 at character 3)",
    ),
    ("generate --max-token 3", "No such option '--max-token'"),
    ("generat", "No such command 'generat'"),
    ("list --verbos", "No such option '--verbos'"),
    ("adapter-check Attention", "expected module.Class, got 'Attention'"),
    (
        "adapter-check mlx_lm.models.llama.Nope",
        "module mlx_lm.models.llama has no class Nope",
    ),
    ("adapter-check", "Missing argument 'MODULE.CLASS'"),
    ("calibrate --force", "--force is for --out (the cache's file is replaced)"),
    # kvzap with no scorer named, none in the calibration cache (conftest gives
    # every test an empty one) and none shipped (the test below empties it)
    *(
        (line, "has none; make it with `veloxpatch calibrate --algo kvzap`")
        for line in (
            "generate --algo kvzap --budget 64",
            "compress --context short.txt --algo kvzap --out c.safetensors",
            "serve --algo kvzap --budget 64",
            "eval --arms kvzap --out r.json",
        )
    ),
    (f"{CAL} --text /missing.txt", "'/missing.txt' is not a file"),
    (f"{CAL} --text adir", "'adir' is a directory"),
    (
        f"{CAL} --text latin1.txt",
        "--text latin1.txt is not UTF-8 text (byte 0xe9 at offset 3)",
    ),
    (
        "calibrate --out /missing_dir/x.safetensors",
        "--out is in a folder that does not exist: /missing_dir",
    ),
    ("calibrate --out adir", "--out names a directory: adir"),
    ("eval --arms snapkv --out new/", "--out names a directory: new/"),
    ("calibrate --out calib", "--out must end in .safetensors"),
    (
        "calibrate --out exists.safetensors",
        "exists.safetensors exists (--out); pass --force to overwrite it",
    ),
    (f"{CAL} --tokens 0", "--tokens must be at least 1, got 0"),
    (f"{CAL} --seed -1", "--seed must be at least 0, got -1"),
    (f"{CAL} --algo snapkv", "calibration exists for qfilters, a2ats, kvzap only"),
    (
        f"{CAL} --algo a2ats --codebook-size 0",
        "--codebook-size must be at least 1, got 0",
    ),
    (
        f"{CAL} --algo a2ats --tokens 100 --codebook-size 200",
        "--codebook-size must be at most 100",
    ),
    (
        f"{CAL} --algo a2ats --tokens 30000 --codebook-size 20000",
        "--codebook-size must be at most 16,384",
    ),
    (
        f"{CAL} --algo a2ats --far-position -1",
        "far_position must be >= 0 and <= 2147483647, got -1",
    ),
    (f"{CAL} --codebook-size 256", "--codebook-size is for a2ats, not qfilters"),
    (f"{CAL} --target kvzip", "--target is for kvzap, not qfilters"),
    (f"{CAL} --algo kvzap --target plus", "Invalid value for '--target'"),
    ("eval --arms snapkv --out adir", "--out names a directory: adir"),
    (
        "eval --arms snapkv --out /missing_dir/r.json",
        "--out is in a folder that does not exist",
    ),
    (
        "eval --arms snapkv --out exists.json",
        "exists.json exists (--out); pass --force",
    ),
    (f"eval {AR} --plot exists.png", "exists.png exists (--plot); pass --force"),
    (f"eval {AR} --plot adir", "--plot names a directory: adir"),
    (f"eval {AR} --plot r.json --force", "--out and --plot name the same file"),
    (f"eval {AR} --context -5", "--context above 80 tokens, got -5"),
    (f"eval {AR} --tasks ppl --context -5", "--context must be at least 2, got -5"),
    (f"eval {AR} --cases 0", "--cases must be at least 1, got 0"),
    (f"eval {AR} --segments 0", "--segments must be at least 1, got 0"),
    (f"eval {AR} --continuation 0", "--continuation must be at least 1, got 0"),
    (
        f"eval {AR} --prefill-step-size 0",
        "--prefill-step-size must be at least 1, got 0",
    ),
    (
        f"eval {AR} --tasks passkey --segments 4",
        "--segments is not read by --tasks passkey",
    ),
    (f"eval {AR} --tasks ppl --search 768", "--search is not read by --tasks ppl"),
    (
        f"eval {AR} --tasks ppl --decode-lead-in",
        "--decode-lead-in is not read by --tasks ppl",
    ),
    (
        f"eval {AR} --search 1024,768",
        "--search must list budgets in increasing order, got 1024,768",
    ),
    (f"eval {AR} --search 0", "--search must be comma-separated integers"),
    (
        f"eval {AR} --protocol agnostic --decode-lead-in",
        "--decode-lead-in needs --protocol aware",
    ),
    (f"eval {AR} --tasks speed", "unknown task(s) ['speed']"),
    (f"eval {AR} --text latin1.txt", "is not UTF-8 text"),
    ("eval --arms , --out r.json", "--arms names no arm"),
    ("eval --arms snapkv,snapkv --out r.json", "--arms names snapkv twice"),
    ("eval --arms snapkv:window=0 --out r.json", "window"),
    (
        f"eval {AR} --budgets 0",
        "--budgets must be comma-separated integers, each at least 1",
    ),
    (f"eval {AR} --budgets 64,lots", "--budgets must be comma-separated integers"),
    (f"eval {AR} --budgets 64,64", "--budgets lists 64 twice"),
    (
        "eval --arms snapkv:budget=64 --out r.json --budgets 32",
        "--budgets applies to no arm",
    ),
    ("eval --arms nope --out r.json --budgets 32", "unknown algorithm 'nope'"),
    (
        f"bench {AR} --contexts 0",
        "--contexts must be comma-separated integers, each at least 1",
    ),
    (f"bench {AR} --contexts 100,-5", "--contexts must be comma-separated integers"),
    (f"bench {AR} --contexts ,", "--contexts must be comma-separated integers"),
    (f"bench {AR} --contexts 100,100", "--contexts lists 100 twice"),
    (f"bench {AR} --repeats 0", "--repeats must be at least 1, got 0"),
    (f"bench {AR} --decode-tokens 0", "--decode-tokens must be at least 1, got 0"),
    (
        f"bench {AR} --prefill-step-size 0",
        "--prefill-step-size must be at least 1, got 0",
    ),
    (f"bench {AR} --text /missing.txt", "is not a file"),
    ("bench --arms snapkv --out adir", "--out names a directory: adir"),
    (
        "bench --arms snapkv --out exists.json",
        "exists.json exists (--out); pass --force",
    ),
    ("bench --arms mlx.quantized:kv_bits=7 --out r.json", "kv_bits"),
    ("serve --algo nope", "unknown algorithm 'nope'"),
    ("serve --algo snapkv --budget 8 --algo-arg budget=4", "budget given twice"),
    ("serve --algo snapkv --budget 0", "budget must be >= 1, got 0"),
    ("serve --kv-cap 3XB", "--kv-cap must be a size"),
    ("serve --algo full --max-kv-bytes 2GB", "the server's cap is --kv-cap"),
    ("serve --algo snapkv --max-kv-bytes 3XB", "max_kv_bytes must be a size"),
    (
        "serve --algo snapkv --max-kv-bytes 1MB --algo-arg max_kv_bytes=2MB",
        "max_kv_bytes given twice",
    ),
    ("serve --read-timeout 0", "--read-timeout"),
    ("serve --max-requests 0", "--max-requests"),
    ("serve --kv-bits 4", "--kv-bits: mlx-lm's --kv-bits swaps in"),
    ("serve --draft-model m", "speculative decoding is not supported"),
    ("serve --kv-bit 4", "unrecognized arguments: --kv-bit 4"),  # no abbreviations
    ("serve --draft m", "unrecognized arguments: --draft m"),
    ("serve --port notaport", "argument --port: invalid int value: 'notaport'"),
    ("serve --no-such-flag 3", "unrecognized arguments: --no-such-flag 3"),
    (
        "serve --algo snapkv --compress-system-prompt",
        "--compress-system-prompt: snapkv has no question-agnostic pass",
    ),
    ("serve --prompt-cache-disk-bytes 1GB", "needs --prompt-cache-dir"),
    (
        "serve --prompt-cache-dir d --prompt-cache-disk-bytes 3XB",
        "--prompt-cache-disk-bytes must be a size",
    ),
]


class FakeTokenizer:
    """One token per word; no chat template. Enough for the checks that need
    the text's token count, and nothing more: any real work fails loudly."""

    def encode(self, text, add_special_tokens=True):
        return text.split()


# (command line, message): the error comes after the load, before any work (the
# loaded "model" is a bare object: any work on it raises AttributeError)
AFTER_LOAD = [
    ("generate --prompt hi --chat", "--chat: the model has no chat template"),
    (
        f"{CAL} --text short.txt --tokens 500",
        "--text short.txt has 50 tokens, fewer than the 500 needed",
    ),
    # the default --tokens is the algorithm's: 4,096, kvzap's 16,384
    (f"{CAL} --text short.txt", "fewer than the 4,096 needed"),
    (f"{CAL} --algo kvzap --text short.txt", "fewer than the 16,384 needed"),
    (
        f"eval {AR} --text short.txt --context 200",
        "--text short.txt has 50 tokens, fewer than the 120 needed",
    ),
    (f"eval {AR} --tasks ppl --context 10000000", "fewer than the 10,000,256 needed"),
    (f"bench {AR} --contexts 100,10000000", "fewer than the 10,000,000 needed"),
]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A folder with one file or folder of each kind the cases name."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    for name in ("exists.json", "exists.safetensors", "exists.png"):
        (tmp_path / name).write_text("keep")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 au lait")
    (tmp_path / "short.txt").write_text(" ".join(["word"] * 50))
    return tmp_path


def snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
        for p in sorted(folder.rglob("*"))
    }


def invoke(args, monkeypatch, loaded=None):
    calls = []

    def load(*a, **k):
        calls.append(a)
        if loaded is None:
            pytest.fail(f"the model loaded before the error: {args}")
        return loaded

    monkeypatch.setattr(models, "load", load)
    return CliRunner().invoke(main, args, prog_name="veloxpatch"), calls


def check_one_line(res, message):
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert "Traceback" not in res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("veloxpatch: error: "), lines[0]
    assert message in lines[0], lines[0]


@pytest.mark.parametrize("line,message", BEFORE_LOAD, ids=[c[0] for c in BEFORE_LOAD])
def test_bad_input_is_one_line_before_the_model_loads(
    line, message, workdir, monkeypatch, tmp_path
):
    from veloxpatch.caches import calibration_files as calibration_format

    monkeypatch.setattr(calibration_format, "SHIPPED", tmp_path / "shipped")
    before = snapshot(workdir)
    res, calls = invoke(shlex.split(line), monkeypatch)
    check_one_line(res, message)
    assert not calls
    assert snapshot(workdir) == before  # nothing written, nothing overwritten


@pytest.mark.parametrize("line,message", AFTER_LOAD, ids=[c[0] for c in AFTER_LOAD])
def test_what_needs_the_tokenizer_fails_before_any_work(
    line, message, workdir, monkeypatch
):
    before = snapshot(workdir)
    fake = (object(), FakeTokenizer())
    res, calls = invoke(shlex.split(line), monkeypatch, loaded=fake)
    check_one_line(res, message)
    assert len(calls) == 1
    assert snapshot(workdir) == before


def test_force_lets_an_existing_output_be_overwritten(workdir, monkeypatch):
    # the checks pass with --force: the run goes on to load the model
    for line in (
        "calibrate --out exists.safetensors --force",
        "eval --arms snapkv --out exists.json --force",
        "bench --arms snapkv --out exists.json --force",
    ):
        fake = (object(), FakeTokenizer())
        res, calls = invoke(shlex.split(line), monkeypatch, loaded=fake)
        assert calls, (line, res.output)


def test_an_unwritable_output_folder_is_refused(workdir, monkeypatch):
    folder = workdir / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    if os.access(folder, os.W_OK):  # root writes anyway: a folder nobody can
        if not Path("/proc").is_dir():
            pytest.skip("running as root, and no /proc to try")
        folder = Path("/proc")
    before = snapshot(workdir)
    res, calls = invoke(
        ["bench", "--arms", "snapkv", "--out", f"{folder}/r.json"], monkeypatch
    )
    check_one_line(res, "--out cannot be written (")
    assert snapshot(workdir) == before and not calls


def test_an_error_raised_during_work_is_one_line(workdir, monkeypatch):
    from veloxpatch.loading.gguf import ModelLoadError

    def load(*a, **k):
        raise ModelLoadError("first line\nsecond line")

    monkeypatch.setattr(models, "load", load)
    res = CliRunner().invoke(main, ["generate", "--prompt", "hi"])
    check_one_line(res, "first line second line")


def test_undecodable_stdin_is_one_line(monkeypatch):
    res, calls = invoke(["generate"], monkeypatch)
    check_one_line(res, "empty prompt")
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("loaded"))
    res = CliRunner().invoke(main, ["generate"], input=b"caf\xe9")
    check_one_line(res, "stdin is not valid UTF-8 (byte 0xe9 at offset 3)")


def run_cli(args, stdin=b""):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "veloxpatch.cli", *args],
        input=stdin,
        capture_output=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args,stdin,message",
    [
        (["generate"], b"caf\xe9 au lait", "stdin is not valid UTF-8 (byte 0xe9"),
        (
            ["generate", "--prompt", os.fsdecode(b"caf\xe9")],
            b"",
            "--prompt is not valid UTF-8 (byte 0xe9 at character 3)",
        ),
    ],
    ids=["stdin", "argv"],
)
def test_non_utf8_bytes_in_a_real_process(args, stdin, message):
    out = run_cli(args, stdin)
    assert out.returncode == 2, out.stderr
    assert out.stdout == b""
    lines = out.stderr.decode().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
