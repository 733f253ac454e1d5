"""Comparison arms (mlx-lm's caches, veloxquant's) on a tiny unpatched model."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.errors import OptionError, PatchStateError
from veloxpatch.eval.arms import Arm, takes_budget
from veloxpatch.eval.peers import (
    PEER_ALGOS,
    generation_kwargs,
    held_rows,
    mlx_caches,
    quantizer,
    veloxquant_available,
    veloxquant_caches,
)
from veloxpatch.eval.sessions import Prefills, arm_caches, prefill_head


def last_logits(model, caches, ids, quantized=None):
    """Chunked prefill (the harness's), then the last token's logits."""
    ids = ids.tolist()
    after = quantizer("quantized", quantized) if quantized else None
    prefill_head(model, caches, ids[:-1], prefill_step_size=16, after_chunk=after)
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


def test_quantized_is_mlx_lm_kv_bits_from_token_zero():
    # head_dim 32: mx.quantize needs group sizes of 32, 64 or 128.
    model = tiny_model("llama", head_dim=32)
    ids = prompt_tokens(50)
    ref = last_logits(model, mlx_caches(model, "unpatched", {}), ids)
    err = {}
    for bits in (8, 4):
        options = {"kv_bits": bits, "group_size": 32}
        arm = Arm("mlx.quantized", options)
        with arm_caches(model, arm, ids[:-1].tolist(), None, 16) as (caches, _):
            assert all(type(c) is QuantizedKVCache and c.bits == bits for c in caches)
            ours = [lp for _, lp in generate_step(ids[-1:], model, prompt_cache=caches)]
        # the oracle: mlx-lm's own kv_bits with quantized_kv_start=0
        theirs = generate_step(
            ids, model, prefill_step_size=16, **generation_kwargs("quantized", options)
        )
        theirs = [lp for _, lp in theirs]
        assert len(ours) == len(theirs) == 256
        for a, b in zip(ours[:8], theirs[:8]):
            assert mx.array_equal(a, b)
        caches = mlx_caches(model, "quantized", options)
        err[bits] = mx.abs(last_logits(model, caches, ids, options) - ref).max().item()
    assert 0 < err[8] < 0.02 * mx.abs(ref).max().item()
    assert err[4] > err[8]


def test_shared_prefills_equal_direct_ones():
    model = tiny_model("llama", head_dim=32)
    head = prompt_tokens(40).tolist()
    arms = [
        Arm("unpatched"),
        Arm("mlx.quantized", {"kv_bits": 4, "group_size": 32}),
        Arm("mlx.rotating", {"budget": 16}),
    ]
    if veloxquant_available():
        arms += [Arm(f"veloxquant.{a}", {"budget": 16, **x}) for a, x in VQ]
    prefills = Prefills(model, head, arms)
    for arm in arms:
        with arm_caches(model, arm, head, prefills) as (shared, was_shared):
            a = model(mx.array([[7]]), cache=shared)
        with arm_caches(model, arm, head, None, 64) as (direct, _):
            b = model(mx.array([[7]]), cache=direct)
        assert was_shared == (arm.algo != "mlx.rotating"), arm.label
        assert mx.array_equal(a, b), arm.label
        assert [held_rows(c) for c in shared] == [held_rows(c) for c in direct]


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
    budgeted = {a for a in veloxpatch.algos() if takes_budget(a)}
    # adakv: another algorithm of the same name there; the others: none
    none = {"adakv", "expected_attention", "kvzip", "kvzap"}
    assert set(PEER_ALGOS) == budgeted - none


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
