"""kvzap on the embedded SmolLM2: calibrated through the CLI on the calibration
prose, then used inside mlx-lm's own generate functions and the CLI."""

import mlx.core as mx
import pytest
from click.testing import CliRunner
from conftest import smollm
from helpers import greedy
from mlx_lm import stream_generate

import veloxpatch
from veloxpatch.cli import main
from veloxpatch.prose import prose_tokens


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    """A linear scorer calibrated on 512 tokens of calibration prose (2 segments
    of 256, one held out): enough to check the path, not to measure quality."""
    path = tmp_path_factory.mktemp("kvzap") / "s.safetensors"
    args = ["calibrate", "--algo", "kvzap", "--tokens", "512", "--out", str(path)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert (
        "linear surrogates of kvzip+ scores, from 2 segments of 256 tokens (1 held out"
        in res.output
    )
    return str(path)


@smollm
def test_kvzap_keeping_everything_is_the_full_cache(loaded, scorer):
    model, tokenizer = loaded
    prompt = mx.array(prose_tokens(tokenizer, 300, start=7000))
    ref, _ = greedy(model, prompt, n=12, prefill_step_size=128)
    opts = dict(scorer=scorer, threshold=-1e6)  # nothing scores under it
    with veloxpatch.patched(model, "kvzap", **opts) as patch:
        caches = patch.make_cache()
        toks, _ = greedy(
            model, prompt, n=12, prefill_step_size=128, prompt_cache=caches
        )
    assert toks == ref
    assert all(c.kept_fraction() == 1.0 for c in caches)


@smollm
def test_kvzap_compresses_inside_stream_generate(loaded, scorer):
    model, tokenizer = loaded
    text = tokenizer.decode(prose_tokens(tokenizer, 700, start=20000))
    with veloxpatch.patched(model, "kvzap", scorer=scorer, budget=128) as patch:
        caches = patch.make_cache()
        out = list(
            stream_generate(
                model,
                tokenizer,
                text,
                max_tokens=8,
                prompt_cache=caches,
                prefill_step_size=256,
            )
        )
    assert out[-1].prompt_tokens >= 690
    shares = [c.share for c in caches]
    assert sum(shares) <= 128 * len(caches)  # the model-wide choice
    assert all(c.rows <= c.share + 32 for c in caches)  # + the decode window
    kept = [c.kept_fraction() for c in caches]  # layers get unequal shares
    assert sum(kept) / len(kept) < 0.4 and max(shares) > min(shares)


@smollm
def test_generate_prints_how_much_the_threshold_kept(scorer):
    args = ["generate", "--algo", "kvzap", "--algo-arg", f"scorer={scorer}"]
    args += ["--algo-arg", "threshold=-9", "--max-tokens", "4"]
    res = CliRunner().invoke(main, [*args, "--prompt", "The history of tea " * 60])
    assert res.exit_code == 0, res.output
    assert "of pairs" in res.output and "[kvzap]" in res.output
