"""The calibration cache ($VELOXPATCH_HOME): `calibrate` without a file writes
this model's there, the options naming no file find it, a file of another
model or a damaged one is never used, and kvzap without one says the command
that makes it. conftest points VELOXPATCH_HOME at an empty folder per test."""

import io
import logging
import shutil

import mlx.core as mx
import pytest
from click.testing import CliRunner
from tiny import prompt_tokens, tiny_model, tiny_scorer

import veloxpatch
from model_adapters.base import fingerprint
from veloxpatch.caches.calibration_files import home, home_path
from veloxpatch.caches.io import load_cache, save_cache
from veloxpatch.calibration.run import Progress
from veloxpatch.cli import main
from veloxpatch.errors import OptionError
from veloxpatch.loading import models


class ByteTokenizer:
    """Enough of a tokenizer for calibration prose on a tiny model."""

    def encode(self, text, add_special_tokens=False):
        return [b % 97 for b in text.encode()]


A2ATS = dict(codebook_size=8, far_position=64)


def calibrate(model, algo, **options):
    options = A2ATS | options if algo == "a2ats" else options
    return veloxpatch.calibrate(model, ByteTokenizer(), algo, tokens=64, **options)


def in_home(model, algo, source) -> str:
    """`source` copied where `calibrate` writes `algo`'s file for `model`."""
    path = home_path(algo, fingerprint(model))
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, path)
    return str(path)


def warnings_of(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "veloxpatch.calibration" and r.levelno >= logging.WARNING
    ]


def test_the_cache_is_veloxpatch_home_and_a_folder_per_model(
    calibration_home, monkeypatch
):
    assert home() == calibration_home
    a, b = tiny_model("llama"), tiny_model("llama", seed=1)
    pa, pb = home_path("kvzap", fingerprint(a)), home_path("kvzap", fingerprint(b))
    assert pa.parent.parent == pb.parent.parent == calibration_home
    assert pa.parent != pb.parent and pa.name == pb.name == "kvzap.safetensors"
    assert pa.parent.name.startswith("llama-")
    monkeypatch.delenv("VELOXPATCH_HOME")
    monkeypatch.setenv("HOME", "/nowhere")
    assert str(home()) == "/nowhere/.cache/veloxpatch"


@pytest.mark.parametrize("algo", ["qfilters", "a2ats"])
def test_calibrate_without_out_writes_the_file_the_options_then_find(
    algo, capsys, caplog
):
    model = tiny_model("llama")
    calibrate(model, algo)
    path = home_path(algo, fingerprint(model))
    assert path.is_file()
    err = capsys.readouterr().err
    assert f"calibrate {algo}: 64/64 tokens read" in err
    assert f"/{len(model.layers)} layers fitted" in err
    assert f"calibrate {algo}: wrote {path}" in err
    key, extra = (
        ("codebook", dict(far_position=64))
        if algo == "a2ats"
        else ("filters", dict(budget=12, window=2))
    )
    with caplog.at_level(logging.INFO, "veloxpatch.calibration"):
        with veloxpatch.patched(model, algo, **extra) as patch:
            assert getattr(patch.options, key) == str(path)
            assert patch.options.loaded is not None
            out = model(prompt_tokens(30)[None])
    assert bool(mx.isfinite(out).all().item())
    assert any(str(path) in r.getMessage() for r in caplog.records)
    # out=False: nothing written (a re-run would replace the file)
    path.unlink()
    calibrate(model, algo, out=False)
    assert not path.exists()


def test_a_codebook_for_another_far_position_is_skipped(caplog):
    model = tiny_model("llama")
    calibrate(model, "a2ats")  # b = 64
    with veloxpatch.patched(model, "a2ats", far_position=128) as patch:
        assert patch.options.codebook is None and patch.options.loaded is None
    (line,) = warnings_of(caplog)
    assert "far_position 64, not 128" in line


def test_kvzap_finds_this_models_scorer_and_saved_caches_carry_it(tmp_path):
    model = tiny_model("llama")
    path = in_home(model, "kvzap", tiny_scorer(model))
    with veloxpatch.patched(model, "kvzap", budget=8, sinks=2, window=2) as patch:
        assert patch.options.scorer == path
        caches = patch.make_cache()
        model(prompt_tokens(40)[None], cache=caches)
        save_cache(tmp_path / "c.safetensors", caches)
        # another budget binds its options again: with the same file
        assert patch.make_cache(max_kv_size=16)[0].options.scorer == path
    loaded = load_cache(tmp_path / "c.safetensors")
    assert all(c.options.scorer == path for c in loaded)
    assert mx.array_equal(loaded[0].keys, caches[0].keys)


def test_another_models_file_is_never_picked_up(caplog):
    model, other = tiny_model("llama"), tiny_model("llama", seed=1)
    in_home(other, "kvzap", tiny_scorer(other))  # in the other model's folder
    with pytest.raises(OptionError, match="veloxpatch calibrate --algo kvzap"):
        veloxpatch.apply(model, "kvzap", budget=64)
    assert not warnings_of(caplog)
    # copied into this model's folder: refused as another model's, and skipped
    in_home(model, "kvzap", tiny_scorer(other))
    with pytest.raises(OptionError, match="veloxpatch calibrate --algo kvzap"):
        veloxpatch.apply(model, "kvzap", budget=64)
    (line,) = warnings_of(caplog)
    assert "calibrated for another model" in line
    assert veloxpatch.unpatch(model) is False  # nothing was patched


def test_a_damaged_file_is_skipped_with_one_line(caplog, tmp_path):
    model = tiny_model("llama")
    calibrate(model, "qfilters")
    path = home_path("qfilters", fingerprint(model))
    data = bytearray(path.read_bytes())
    data[-8:] = b"\xff" * 8  # inside the arrays: the checksum catches it
    path.write_bytes(bytes(data))
    with veloxpatch.patched(model, "qfilters", budget=12, window=2) as patch:
        assert patch.options.filters is None  # the prompt's own queries, as before
    (line,) = warnings_of(caplog)
    assert str(path) in line and "\n" not in line


def test_kvzap_without_a_scorer_is_one_line_naming_the_command():
    model = tiny_model("llama")
    with pytest.raises(OptionError) as e:
        veloxpatch.apply(model, "kvzap", budget=64)
    message = str(e.value)
    assert "\n" not in message
    assert message.endswith("make it with `veloxpatch calibrate --algo kvzap`")
    assert str(home_path("kvzap", fingerprint(model)).parent) in message
    assert veloxpatch.unpatch(model) is False


def test_progress_says_the_time_left_then_done():
    out = io.StringIO()
    p = Progress("kvzap", tokens=100, layers=2, stream=out, every=0)
    p.read(25)
    p.read(75)
    p.fitted()
    p.fitted()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("calibrate kvzap: 25/100 tokens read, ")
    assert lines[0].endswith(" s left")
    assert lines[1].startswith("calibrate kvzap: 100/100 tokens read, ")
    assert lines[1].endswith(", done")
    assert lines[2].startswith("calibrate kvzap: 1/2 layers fitted, ")
    assert lines[3].endswith(", done")


def test_cli_calibrate_without_out_writes_into_the_cache(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(models, "load", lambda *a, **k: (model, ByteTokenizer()))
    path = home_path("qfilters", fingerprint(model))
    args = ["calibrate", "--algo", "qfilters", "--tokens", "64"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert f"wrote {path}:" in res.stdout
    assert "calibrate qfilters: 64/64 tokens read" in res.stderr
    first = path.read_bytes()
    # a re-run replaces it (another seed: other queries, other filters)
    res = CliRunner().invoke(main, [*args, "--seed", "1"])
    assert res.exit_code == 0, res.output
    assert path.read_bytes() != first
    assert [p.name for p in path.parent.iterdir()] == ["qfilters.safetensors"]


def test_a_shipped_file_is_found_after_the_cache(monkeypatch, tmp_path):
    """The package's own files (`caches/shipped/`, the embedded model's
    kvzap scorer) are found when the cache has none; the cache's wins."""
    from veloxpatch.caches import calibration_files as calibration_format

    model = tiny_model("llama")
    monkeypatch.setattr(calibration_format, "SHIPPED", tmp_path)
    with pytest.raises(OptionError, match="veloxpatch calibrate --algo kvzap"):
        veloxpatch.apply(model, "kvzap")
    shipped = tmp_path / home_path("kvzap", fingerprint(model)).parent.name
    shipped.mkdir()
    shutil.copyfile(tiny_scorer(model), shipped / "kvzap.safetensors")
    with veloxpatch.patched(model, "kvzap") as patch:
        assert patch.options.scorer == str(shipped / "kvzap.safetensors")
    mine = in_home(model, "kvzap", tiny_scorer(model, seed=1))
    with veloxpatch.patched(model, "kvzap") as patch:
        assert patch.options.scorer == mine


@pytest.mark.smollm
def test_the_embedded_model_finds_its_shipped_kvzap_scorer():
    model, _ = models.load()
    with veloxpatch.patched(model, "kvzap", budget=64) as patch:
        assert "/caches/shipped/" in patch.options.scorer
