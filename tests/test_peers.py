"""Comparison arms (mlx-lm's caches, veloxquant's) on a tiny unpatched model."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.errors import OptionError, PatchStateError
from veloxpatch.eval.peers import (
    PEER_ALGOS,
    held_rows,
    mlx_caches,
    veloxquant_available,
    veloxquant_caches,
)
from veloxpatch.eval.sessions import prefill_head


def last_logits(model, caches, ids):
    """Chunked prefill (the harness's), then the last token's logits."""
    ids = ids.tolist()
    prefill_head(model, caches, ids[:-1], prefill_step_size=16)
    return model(mx.array([ids[-1:]]), cache=caches)[0, -1]


def test_unpatched_reproduces_plain_logits():
    model = tiny_model("llama")
    ids = prompt_tokens(40)
    caches = mlx_caches(model, "unpatched", {})
    assert all(type(c) is KVCache for c in caches)
    got = last_logits(model, caches, ids)
    assert mx.allclose(got, model(ids[None])[0, -1], atol=1e-5)


def test_rotating_holds_at_most_budget():
    model = tiny_model("llama")
    caches = mlx_caches(model, "rotating", {"budget": 16})
    last_logits(model, caches, prompt_tokens(60))
    for c in caches:
        assert isinstance(c, RotatingKVCache) and c.keep == 4 and c.offset == 60
        assert c.keys.shape[2] <= 16 and held_rows(c) == 16


def test_quantized_close_to_unpatched():
    # head_dim 32: mx.quantize needs group sizes of 32, 64 or 128.
    model = tiny_model("llama", head_dim=32)
    ids = prompt_tokens(50)
    ref = last_logits(model, mlx_caches(model, "unpatched", {}), ids)
    err = {}
    for bits in (8, 4):
        caches = mlx_caches(model, "quantized", {"kv_bits": bits, "group_size": 32})
        assert all(type(c) is QuantizedKVCache and c.bits == bits for c in caches)
        err[bits] = mx.abs(last_logits(model, caches, ids) - ref).max().item()
    assert 0 < err[8] < 0.02 * mx.abs(ref).max().item()
    assert err[4] > err[8]  # quantized from the first token on


@pytest.mark.parametrize(
    "kind, options",
    [
        ("windowed", {}),
        ("unpatched", {"budget": 4}),
        ("rotating", {"budget": 4, "sinks": 4}),
        ("rotating", {}),
        ("quantized", {"kv_bits": 7}),
        ("quantized", {"kv_bits": 4, "group_size": 16}),
    ],
)
def test_mlx_option_errors(kind, options):
    with pytest.raises(OptionError):
        mlx_caches(tiny_model("llama"), kind, options)


def test_no_peer_for_adakv_or_full_and_patched_models_refused():
    model = tiny_model("llama")
    for algo in ("adakv", "full", "nonesuch"):
        with pytest.raises(OptionError, match="no veloxquant equivalent"):
            veloxquant_caches(model, algo, {"budget": 16})
    with veloxpatch.patched(model, "full"):
        with pytest.raises(PatchStateError):
            mlx_caches(model, "unpatched", {})
    assert set(PEER_ALGOS) == set(veloxpatch.algos()) - {"adakv", "full"}


# --- veloxquant-mlx (optional) ---------------------------------------------------

PROMPT, DECODE, BUDGET = 50, 5, 16
VQ = [
    ("snapkv", {}),
    ("h2o", {"recent": 6}),  # its default grace (16) + 4 sinks leave none at 16
    ("tova", {}),
    ("streaming_llm", {}),
]


@pytest.fixture
def vq():
    pytest.importorskip("veloxquant_mlx")
    assert veloxquant_available()


@pytest.mark.parametrize("algo, extra", VQ)
def test_veloxquant_caches_evict_in_generation(vq, algo, extra):
    model = tiny_model("llama")
    assert "make_cache" not in model.__dict__
    caches = veloxquant_caches(model, algo, {"budget": BUDGET, **extra})
    assert "make_cache" not in model.__dict__  # the model is as it was
    assert type(caches[0]).__module__.startswith("veloxquant_mlx")
    ids = prompt_tokens(PROMPT)
    steps = generate_step(ids, model, prompt_cache=caches, max_tokens=DECODE)
    assert len(list(steps)) == DECODE
    for c in caches:
        # generate_step feeds each token back before yielding it
        assert c.offset == PROMPT + DECODE  # the position RoPE reads
        rows = held_rows(c)
        # snapkv compresses the prompt chunk only; the last prompt token and
        # the decoded ones are appended.
        assert rows == (BUDGET + DECODE + 1 if algo == "snapkv" else BUDGET)


def test_veloxquant_restores_an_instance_make_cache(vq):
    model = tiny_model("llama")

    def own():
        return []

    model.make_cache = own
    caches = veloxquant_caches(model, "knorm", {"budget": BUDGET})
    assert model.__dict__["make_cache"] is own and len(caches) == 3


def test_veloxquant_option_mapping_and_errors(vq):
    model = tiny_model("llama")
    pyramid = veloxquant_caches(model, "pyramidkv", {"budget": BUDGET})
    budgets = [c.layer_budget for c in pyramid]
    assert budgets == sorted(budgets, reverse=True) and sum(budgets) == 3 * BUDGET
    streaming = veloxquant_caches(model, "streaming_llm", {"budget": 8, "sinks": 2})
    prefill_head(model, streaming, prompt_tokens(30).tolist())
    assert [held_rows(c) for c in streaming] == [8, 8, 8]  # sinks in the budget
    for algo, options in [
        ("h2o", {"budget": BUDGET}),  # would fail only at its first update
        ("tova", {"budget": 4}),
        ("snapkv", {"budget": BUDGET, "kernel": 7}),  # no counterpart
        ("snapkv", {"budget": BUDGET, "snap_budget": 8}),
        ("knorm", {}),
    ]:
        with pytest.raises(OptionError):
            veloxquant_caches(model, algo, options)
    assert "make_cache" not in model.__dict__
