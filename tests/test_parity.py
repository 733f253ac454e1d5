"""Patched `full` is the unpatched model, bit for bit, on every adapter."""

import mlx.core as mx
import pytest
from helpers import greedy, max_abs
from mlx_lm.generate import speculative_generate_step
from tiny import ARCHS, prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.caches.full import FullCache


@pytest.mark.parametrize("arch", ARCHS)
def test_full_is_bit_identical(arch):
    model = tiny_model(arch)
    prompt = prompt_tokens(45)
    ref_toks, ref_lp = greedy(model, prompt, n=20, prefill_step_size=7)
    # Rows differ step to step, so matching them all is not a trivial check.
    assert max_abs(ref_lp[1:], ref_lp[:-1]) > 1e-2
    with veloxpatch.patched(model, algo="full") as patch:
        caches = patch.make_cache()
        toks, lp = greedy(model, prompt, n=20, prefill_step_size=7, prompt_cache=caches)
    assert toks == ref_toks
    assert max_abs(lp, ref_lp) == 0.0
    # The veloxpatch path really ran (not the passthrough): full caches hold rows
    # (mlx-lm feeds every generated token, including the last one it yields).
    ours = [c for c in caches if isinstance(c, FullCache)]
    assert ours and all(c.rows == c.offset == 45 + 20 for c in ours)


def test_sliding_layers_keep_mlx_lm_cache():
    from mlx_lm.models.cache import RotatingKVCache

    model = tiny_model("mistral_swa")
    with veloxpatch.patched(model, algo="full") as patch:
        caches = patch.make_cache()
    kinds = [type(c) for c in caches]
    assert kinds == [RotatingKVCache, FullCache, RotatingKVCache]
    assert caches[0].max_size == 8


def test_ministral3_attn_scale_is_active():
    # Guard for the parity test above: the query scale differs from 1 in range.
    from mlx_lm.models.ministral3 import _get_llama_4_attn_scale

    s = _get_llama_4_attn_scale(45, 0, 0.5, 16)
    assert mx.abs(s - 1).max().item() > 0.3


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "ministral3"])
def test_half_precision_tokens_and_cache_dtype(arch, dtype):
    model = tiny_model(arch, dtype=dtype)
    prompt = prompt_tokens(40)
    ref_toks, _ = greedy(model, prompt, n=16)
    with veloxpatch.patched(model, algo="full") as patch:
        caches = patch.make_cache()
        toks, _ = greedy(model, prompt, n=16, prompt_cache=caches)
    assert toks == ref_toks
    assert all(c.keys.dtype == dtype and c.values.dtype == dtype for c in caches)


def test_speculative_decoding_same_tokens():
    model = tiny_model("llama", seed=0)
    draft = tiny_model("llama", seed=3, num_hidden_layers=1)
    prompt = prompt_tokens(30)

    def run():
        steps = speculative_generate_step(
            prompt, model, draft, num_draft_tokens=3, max_tokens=24, prefill_step_size=8
        )
        return [(tok, accepted) for tok, _, accepted in steps]

    ref = run()
    with veloxpatch.patched(model, algo="full"), veloxpatch.patched(draft, algo="full"):
        got = run()
    assert [t for t, _ in got] == [t for t, _ in ref]
    # Some drafts were rejected, so trim() really ran on the full caches.
    assert not all(a for _, a in ref)
