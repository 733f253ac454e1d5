"""The `generate` stats line: "KV held" and "full KV" count the same way
(allocated rows on both sides), so a short prompt never reports more held
than a full cache would hold."""

import pytest
from click.testing import CliRunner
from conftest import smollm
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from tiny import prompt_tokens, tiny_model

import veloxpatch
import veloxpatch.cli
from veloxpatch.memory import full_kv_bytes, kv_bytes

ALGOS = {
    "full": {},
    "streaming_llm": dict(budget=12, sinks=2),
    "snapkv": dict(budget=16, window=4),
    "kivi": dict(bits=8, residual=4),
    "a2ats": dict(window=8, sinks=2),
}


def run(model, prompt, caches, step):
    for _ in generate_step(
        prompt, model, max_tokens=4, prompt_cache=caches, prefill_step_size=step
    ):
        pass


@pytest.mark.parametrize("arch", ["llama", "mistral_swa"])
@pytest.mark.parametrize("n,step", [(20, 2048), (300, 2048), (600, 256)])
def test_full_kv_is_what_mlx_lm_own_caches_hold(arch, n, step):
    model = tiny_model(arch, head_dim=32)  # kivi quantizes groups of 32
    prompt = prompt_tokens(n)
    theirs = make_prompt_cache(model)  # unpatched: mlx-lm's own caches
    run(model, prompt, theirs, step)
    for algo, options in ALGOS.items():
        with veloxpatch.patched(model, algo=algo, **options) as patch:
            ours = patch.make_cache()
            run(model, prompt, ours, step)
        assert full_kv_bytes(ours) == kv_bytes(theirs), algo
        if algo == "full":  # the same rows, counted the same way
            assert kv_bytes(ours) == full_kv_bytes(ours)
        else:
            assert kv_bytes(ours) <= full_kv_bytes(ours), algo


@smollm
def test_stats_line_of_full_reports_held_equal_to_full(loaded, monkeypatch):
    from veloxpatch.loading import models

    monkeypatch.setattr(models, "load", lambda *a, **k: loaded)
    res = CliRunner().invoke(
        veloxpatch.cli.main,
        ["generate", "--algo", "full", "--max-tokens", "2", "--prompt", "Hi"],
    )
    assert res.exit_code == 0, res.output
    stats = res.stderr.strip().splitlines()[-1]
    held = int(stats.split("KV held ")[1].split(" B")[0].replace(",", ""))
    full = int(stats.split("full KV ")[1].split(" B")[0].replace(",", ""))
    assert held == full > 0  # a short prompt: 256 allocated rows on both sides
