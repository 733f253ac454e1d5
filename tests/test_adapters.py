"""Every adapter target still exists in the installed mlx-lm, with the call
signature and source the adapter was written against: an upgrade fails loudly."""

import inspect
import subprocess
import sys
from pathlib import Path

import mlx_lm
import pytest

from model_adapters import ADAPTERS, supported_model_types
from model_adapters.base import call_source_sha256
from veloxpatch import patcher

TARGETS = sorted({t for a in ADAPTERS for t in a.targets}, key=lambda t: t.key)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.key)
def test_target_matches_installed_mlx_lm(target):
    cls = target.resolve()
    call = cls.__dict__["__call__"]
    assert str(inspect.signature(call)) == target.signature
    assert call_source_sha256(cls) == target.source_sha256, (
        f"{target.key}.__call__ changed in mlx-lm {mlx_lm.__version__}: re-check the "
        "adapter against the new source, then update its hash"
    )
    assert patcher.check_target(target) is cls


def test_supported_types():
    expected = {"llama", "mistral", "ministral3", "mistral3"}
    expected |= {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}
    assert set(supported_model_types()) == expected


def test_pinned_minor_version():
    major, minor = (int(x) for x in mlx_lm.__version__.split(".")[:2])
    assert (major, minor) == (0, 32)


def test_check_prints_the_pins_of_a_target(capsys):
    from model_adapters import check, llama

    assert check.main(["mlx_lm.models.llama.Attention"]) == 0
    out = capsys.readouterr().out
    assert f'source_sha256="{llama.ATTENTION.source_sha256}",' in out
    assert "pinned by adapter(s) llama, mistral: matches" in out
    pins = eval(f"dict(\n{out})")  # pasted as call arguments, the comment line too
    assert pins == dict(
        signature=llama.ATTENTION.signature,
        source_sha256=llama.ATTENTION.source_sha256,
    )


def test_check_reports_a_stale_pin(capsys, monkeypatch):
    import dataclasses

    from model_adapters import check, llama

    stale = dataclasses.replace(llama.ATTENTION, source_sha256="0" * 64)
    monkeypatch.setattr(check, "ADAPTERS", (_adapter_with(stale),))
    assert check.main(["mlx_lm.models.llama.Attention"]) == 1
    assert "differs in source_sha256" in capsys.readouterr().out


def _adapter_with(target):
    from model_adapters import Adapter

    class Stale(Adapter):
        name = "stale"
        targets = (target,)

    return Stale()


@pytest.mark.parametrize(
    "arg, msg",
    [
        ("no_such_module.Attention", "cannot import no_such_module"),
        ("mlx_lm.models.llama.Nope", "has no class Nope"),
        ("mlx_lm.models.llama.ModelArgs", "defines no __call__"),
        ("Attention", "expected module.Class"),
    ],
)
def test_check_rejects_bad_input_in_one_line(arg, msg, capsys):
    from model_adapters import check

    assert check.main([arg]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1


def test_check_runs_as_a_module():
    def check(arg):
        return subprocess.run(
            [sys.executable, "-m", "model_adapters.check", arg],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).parents[1],  # this checkout's model_adapters
        )

    good = check("mlx_lm.models.qwen3.Attention")
    assert good.returncode == 0, good.stderr
    assert "pinned by adapter(s) qwen: matches" in good.stdout
    bad = check("nope.Nope")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("model_adapters.check: cannot import nope")


def test_check_as_a_veloxpatch_command():
    from click.testing import CliRunner

    from veloxpatch.cli import main

    res = CliRunner().invoke(main, ["adapter-check", "mlx_lm.models.llama.Attention"])
    assert res.exit_code == 0 and "llama, mistral: matches" in res.output
    res = CliRunner().invoke(main, ["adapter-check", "mlx_lm.models.llama.Nope"])
    assert res.exit_code == 2 and "has no class Nope" in res.output
