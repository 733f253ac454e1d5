"""mlx-lm's internals, behind one door (veloxpatch/mlx_lm_internals.py): every
pin matches the installed mlx-lm (an upgrade fails loudly here), and a changed
internal or attention class stops `apply` with one error naming it, before the
model is touched."""

import ast
import importlib
import inspect
import re
from pathlib import Path

import mlx_lm
import pytest
from mlx_lm import server as mlx_server
from mlx_lm.models import llama
from tiny import tiny_model

import veloxpatch
from veloxpatch import mlx_lm_internals as door
from veloxpatch import patcher
from veloxpatch.api import patch_of
from veloxpatch.errors import MlxLmChangedError, UnsupportedModelError

ROOT = Path(__file__).resolve().parents[1]
mlx_generate = importlib.import_module("mlx_lm.generate")  # not the function


@pytest.fixture
def fresh_check():
    """The door's check computed anew in this test, and again after it."""
    door.changes.cache_clear()
    yield
    door.changes.cache_clear()


def changed_source(monkeypatch, obj):
    """Make inspect.getsource report an edited source for `obj` only."""
    real = inspect.getsource

    def getsource(o):
        source = real(o)
        return source + "# edited\n" if inspect.unwrap(o) is obj else source

    monkeypatch.setattr(inspect, "getsource", getsource)


def assert_untouched(model):
    assert patch_of(model) is None
    assert "make_cache" not in vars(model)
    assert not hasattr(llama.Attention.__dict__["__call__"], "__wrapped__")


# ---- the pins ---------------------------------------------------------------------
@pytest.mark.parametrize("entry", door.INTERNALS, ids=lambda e: e.name)
def test_pin_matches_installed_mlx_lm(entry):
    assert entry.difference() is None, (
        f"{entry.name} changed in mlx-lm {mlx_lm.__version__}: re-check that "
        f"{entry.relied_on}, then update its pin (python -m "
        "veloxpatch.mlx_lm_internals prints them)"
    )


def test_pins_were_read_from_the_required_mlx_lm():
    assert mlx_lm.__version__ == door.CHECKED_WITH
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"{door.REQUIREMENT}"' in pyproject


def test_check_passes_and_is_computed_once(fresh_check, monkeypatch):
    door.check()
    monkeypatch.setattr(inspect, "getsource", pytest.fail)  # no second look
    door.check()


def test_main_prints_the_pins(capsys, fresh_check):
    assert door.main() == 0
    out = capsys.readouterr().out
    assert "mlx_lm.generate.generate_step: matches" in out


# ---- a changed internal stops apply ----------------------------------------------
def test_a_changed_source_stops_apply_naming_it(fresh_check, monkeypatch):
    changed_source(monkeypatch, mlx_generate.generate_step)
    model = tiny_model("llama")
    with pytest.raises(MlxLmChangedError) as e:
        veloxpatch.apply(model, "snapkv", budget=16)
    message = str(e.value)
    assert "mlx_lm.generate.generate_step (source changed)" in message
    assert f"differs from {door.CHECKED_WITH}" in message
    assert "speculative_generate_step" not in message  # only what changed
    assert_untouched(model)
    assert isinstance(e.value, UnsupportedModelError)  # the CLI's one-line errors


def test_every_change_is_named_in_one_error(fresh_check, monkeypatch):
    def speculative_generate_step(prompt, model):  # no kv_bits local
        pass

    monkeypatch.setattr(
        mlx_generate, "speculative_generate_step", speculative_generate_step
    )
    monkeypatch.delattr(mlx_server, "_run_http_server")
    model = tiny_model("llama")
    with pytest.raises(MlxLmChangedError) as e:
        veloxpatch.apply(model, "full")
    message = str(e.value)
    assert re.search(
        r"mlx_lm\.generate\.speculative_generate_step \(signature is now "
        r"\(prompt, model\), was \(prompt, .*\), has no local 'kv_bits', "
        r"source changed\)",
        message,
    )
    assert "mlx_lm.server._run_http_server (not found)" in message
    assert_untouched(model)


def test_server_parser_checks_before_running_main(fresh_check, monkeypatch):
    ran = []
    monkeypatch.setattr(mlx_server, "main", lambda: ran.append(1))
    with pytest.raises(MlxLmChangedError, match=r"mlx_lm\.server\.main \("):
        door.server_parser()
    assert ran == []  # a main that does not parse first would start a server


def test_server_parser_is_mlx_lms():
    parser = door.server_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {"--port", "--prompt-cache-size", "--kv-bits", "--model"} <= flags


# ---- the adapters' attention classes, checked at apply time ----------------------
def test_a_changed_attention_source_stops_apply(monkeypatch):
    call = llama.Attention.__dict__["__call__"]
    changed_source(monkeypatch, call)
    monkeypatch.setattr(patcher, "_CHECKED", {})  # checked earlier in this process
    model = tiny_model("llama")
    with pytest.raises(MlxLmChangedError) as e:
        veloxpatch.apply(model, "full")
    message = str(e.value)
    assert "mlx_lm.models.llama.Attention.__call__" in message
    assert ": source changed." in message
    assert "python -m model_adapters.check mlx_lm.models.llama.Attention" in message
    assert_untouched(model)


def test_a_changed_attention_signature_stops_apply(monkeypatch):
    original = llama.Attention.__dict__["__call__"]

    def __call__(self, x, mask=None, cache=None, extra=None):
        return original(self, x, mask, cache)

    monkeypatch.setattr(llama.Attention, "__call__", __call__)
    model = tiny_model("llama")
    with pytest.raises(MlxLmChangedError, match="signature is now .*extra=None"):
        veloxpatch.apply(model, "full")
    assert patch_of(model) is None


def test_an_unchanged_attention_class_is_checked_once(monkeypatch):
    model = tiny_model("llama")
    veloxpatch.apply(model, "full").restore()
    monkeypatch.setattr(inspect, "getsource", pytest.fail)
    veloxpatch.apply(model, "full").restore()


# ---- the door is the only way in ------------------------------------------------
def python_files():
    for package in ("veloxpatch", "model_adapters"):
        yield from sorted((ROOT / package).rglob("*.py"))


def test_no_other_module_imports_a_private_mlx_lm_name():
    found = []
    for path in python_files():
        if path.name == "mlx_lm_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "mlx_lm"
            ):
                found += [
                    f"{path.relative_to(ROOT)}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                ]
    assert found == []


def test_only_the_door_reads_frame_locals_or_mocks_mlx_lm():
    found = []
    for path in python_files():
        if path.name == "mlx_lm_internals.py":
            continue
        text = path.read_text()
        found += [
            f"{path.relative_to(ROOT)}: {word}"
            for word in ("f_locals", "f_back", "mock.patch", "setattr(mlx_cache")
            if word in text
        ]
    assert found == []


def test_the_door_is_a_leaf():
    # it imports mlx-lm and veloxpatch's errors only, so anything may import it
    tree = ast.parse((ROOT / "veloxpatch" / "mlx_lm_internals.py").read_text())
    ours = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level or node.module.startswith(("veloxpatch", "model_adapters")):
                ours.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            ours.update(
                a.name
                for a in node.names
                if a.name.startswith(("veloxpatch", "model_adapters"))
            )
    assert ours == {".errors"}
