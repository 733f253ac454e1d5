"""`kv_bits=` on eviction algorithms, and head-adaptive widths (also for `kivi`)."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import step_peak
from oracle import oracle_logits, run_patched
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.errors import OptionError

N, CHUNKS = 112, [30, 25, 20]  # prefill chunks, then single-token decode
EVICTION = [
    ("snapkv", dict(budget=48, window=4)),
    ("pyramidkv", dict(budget=48, window=4, beta=4)),
    ("adakv", dict(budget=48, window=4)),
    ("h2o", dict(budget=40, sinks=2)),
    ("tova", dict(budget=40)),
    ("keyformer", dict(budget=40, sinks=1, recent=3)),
    ("streaming_llm", dict(budget=40)),
    ("knorm", dict(budget=40)),
    ("qfilters", dict(budget=80)),
]


def logprobs(x):
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def oracle_error(model, algo, **opts):
    tokens = prompt_tokens(N).tolist()
    patched, masks, caches = run_patched(model, tokens, CHUNKS, algo, **opts)
    dense = oracle_logits(model, tokens, masks)
    return mx.abs(logprobs(patched) - logprobs(dense)).max().item(), masks, caches


@pytest.mark.parametrize("arch", ["llama", "qwen3", "ministral3"])
def test_snapkv_kv_bits_8_against_the_masked_dense_oracle(arch):
    # The oracle attends in full precision to exactly the rows the cache kept;
    # 8-bit storage of those rows moves no log-probability by more than 0.06
    # (the prompt is quantized while it runs, and the keys of the rows kept
    # from broken groups are rounded a second time when the cache compacts).
    model = tiny_model(arch, head_dim=32)
    err, masks, caches = oracle_error(
        model, "snapkv", kv_bits=8, kv_residual=4, **EVICTION[0][1]
    )
    assert err <= 0.06
    assert all(c.quantized > 0 for c in caches)


@pytest.mark.parametrize("algo,opts", EVICTION, ids=lambda x: str(x))
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_eviction_algorithm_composes_with_kv_bits(arch, algo, opts):
    # 0.1, not 0.05: the tiny models' sharpened q/k make 8-bit keys move tiny
    # qwen3's log-probabilities by 0.056 even with no eviction (`kivi`, bits=8).
    model = tiny_model(arch, head_dim=32)
    err, masks, caches = oracle_error(model, algo, kv_bits=8, kv_residual=4, **opts)
    assert err <= 0.1
    causal = np.tril(np.ones((N, N), bool))
    assert sum(int((causal & ~m).sum()) for m in masks) > 0  # evicted
    assert any(c.quantized > 0 for c in caches)  # and quantized
    assert all(c.rows <= c.row_bound() + 32 for c in caches)


def test_two_bits_really_quantizes():
    model = tiny_model("llama", head_dim=32)
    err8, *_ = oracle_error(model, "snapkv", kv_bits=8, kv_residual=4, **EVICTION[0][1])
    err2, *_ = oracle_error(model, "snapkv", kv_bits=2, kv_residual=4, **EVICTION[0][1])
    assert err2 > 0.1 > err8


@pytest.mark.parametrize(
    "opts",
    [
        dict(kv_bits=5),
        dict(kv_bits="4"),
        dict(kv_bits=True),
        dict(kv_bits=4, kv_group=16),
        dict(kv_bits=4, kv_group=64),  # does not divide head dim 32
        dict(kv_bits=4, kv_residual=-1),
        dict(kv_bits="adaptive"),
        dict(kv_bits=4, kv_key_bits=5),
        dict(kv_bits=4, kv_recipe="hadamard"),
        dict(kv_bits=4, kv_rotate="query"),  # retired
        dict(kv_group=64),  # needs kv_bits
    ],
)
def test_option_errors_change_nothing(opts):
    model = tiny_model("llama", head_dim=32)
    with pytest.raises(OptionError):
        veloxpatch.apply(model, "snapkv", budget=64, **opts)
    assert veloxpatch.api.patch_of(model) is None
    with pytest.raises(OptionError):
        kivi = {k.removeprefix("kv_"): v for k, v in opts.items()}
        veloxpatch.apply(
            model, "kivi", **(kivi if "bits" in kivi else {**kivi, "bits": 9})
        )
    assert veloxpatch.api.patch_of(model) is None


@pytest.mark.parametrize(
    "opts", [dict(kv_bits=4), dict(kv_bits=2), dict(kv_bits=2, kv_key_bits=4)]
)
def test_save_load_and_clone_keep_the_quantized_rows(tmp_path, opts):
    model = tiny_model("llama", head_dim=32)
    ids = prompt_tokens(100)
    with veloxpatch.patched(model, "h2o", budget=48, kv_residual=4, **opts) as p:
        caches = p.make_cache()
        model(ids[None, :90], cache=caches)
        p.end_prompt(caches)
        model(ids[None, 90:92], cache=caches)
        veloxpatch.save_cache(tmp_path / "c.safetensors", caches)
        loaded = veloxpatch.load_cache(tmp_path / "c.safetensors")
        clones = [c.clone() for c in caches]
        outs = [model(ids[None, 92:], cache=cs) for cs in (caches, loaded, clones)]
    assert type(loaded[0]) is type(caches[0]) and loaded[0].quantized > 0
    assert mx.array_equal(outs[0], outs[1]) and mx.array_equal(outs[0], outs[2])


def test_quantized_rows_hold_fewer_bytes():
    model = tiny_model("llama", head_dim=32)
    ids = prompt_tokens(200)
    nbytes = {}
    for bits in (None, 8, 4, 2):
        extra = (
            {} if bits is None else dict(kv_bits=bits, kv_residual=0, kv_recipe="kivi")
        )
        with veloxpatch.patched(model, "tova", budget=160, **extra) as p:
            caches = p.make_cache()
            model(ids[None], cache=caches)
            nbytes[bits] = sum(c.nbytes for c in caches)
    assert nbytes[None] > nbytes[8] > nbytes[4] > nbytes[2]


@pytest.mark.parametrize(
    "opts, at_boundary_exact",
    [
        (dict(bits=2, residual=4, recipe="kivi"), True),
        (dict(bits=4, residual=4), True),
    ],
    ids=["plain-2", "plain-4"],
)
def test_a_trim_into_a_quantized_group_is_not_reused_as_exact(opts, at_boundary_exact):
    # the server reuses a trimmed prompt-cache entry only if trimmed_exactly: a
    # kept group whose grid was set by trimmed rows depends on another prompt,
    # and so does one quantized only because they came (32 rows alone: dense)
    from veloxpatch.serve.prompt_cache import trimmed_exactly

    model = tiny_model("llama", head_dim=64)
    ids = prompt_tokens(70)[None]  # 66 rows past the residual: two groups
    with veloxpatch.patched(model, "kivi", **opts) as patch:
        results = {}
        for keep in (10, 32, 68, 69):  # in group 0, its end, the residual
            caches = patch.make_cache()
            model(ids, cache=caches)
            assert caches[0].quantized == 64
            for c in caches:
                c.trim(c.offset - keep)
            results[keep] = trimmed_exactly(caches, keep)
    exact = at_boundary_exact
    assert results == {10: False, 32: False, 68: exact, 69: exact}


def test_a_trim_back_past_groups_quantized_later_is_not_reused_but_equals_fresh():
    # 100 rows alone quantize 2 groups (residual 32); 40 more quantize a third:
    # trimmed back to 100 it stays quantized, unlike a fresh prefill of them
    from veloxpatch.serve.prompt_cache import trimmed_exactly

    model = tiny_model("llama", head_dim=64)
    ids = prompt_tokens(140)
    with veloxpatch.patched(model, "kivi", bits=2, residual=32, recipe="kivi") as patch:
        got = {}
        for keep in (100, 130):
            caches = patch.make_cache()
            model(ids[None, :100], cache=caches)
            model(ids[None, 100:], cache=caches)
            assert caches[0].quantized == 96
            for c in caches:
                c.trim(c.offset - keep)
            got[keep] = trimmed_exactly(caches, keep)
            if keep == 130:  # 96 of 130 quantized, as a cache fed only them
                fresh = patch.make_cache()  # (in the same calls: the rows a call
                model(ids[None, :100], cache=fresh)  # reads quantized move the
                model(ids[None, 100:130], cache=fresh)  # next layers' inputs)
                nxt = mx.array([[7]])
                np.testing.assert_allclose(
                    np.array(model(nxt, cache=caches)),
                    np.array(model(nxt, cache=fresh)),
                    atol=1e-5,
                )
    assert got == {100: False, 130: True}


@pytest.mark.parametrize("algo", ["h2o", "knorm"])
def test_a_trim_of_quantized_rows_trims_their_side_state(algo):
    # h2o's accumulated attention and knorm's key norms follow the rows through
    # a trim (kv_bits' own truncate once left them long: h2o then failed)
    from mlx_lm.models.cache import trim_prompt_cache

    model = tiny_model("llama", head_dim=32)
    opts = dict(budget=10, kv_bits=8, kv_group=32, kv_residual=4)
    with veloxpatch.patched(model, algo, **opts) as patch:
        caches = patch.make_cache()
        model(prompt_tokens(30)[None], cache=caches)
        for t in (4, 5, 6):
            model(mx.array([[t]]), cache=caches)
        assert trim_prompt_cache(caches, 3) == 3
        for t in (7, 8, 9, 10, 11):
            model(mx.array([[t]]), cache=caches)
            for c in caches:
                side = getattr(c, c.row_arrays[0])
                assert side.shape[-1] == c.rows
    if algo == "knorm":  # each held row's score is its own key's norm
        for c in caches:
            keys = c._view()[0]
            keys = keys.rows_dense()[0] if hasattr(keys, "rows_dense") else keys
            norms = np.linalg.norm(np.array(keys[..., : c.rows, :]), axis=-1)
            np.testing.assert_allclose(-np.array(c.norms), norms, rtol=0.02)


def test_a_compaction_while_decoding_is_one_layer_at_a_time():
    """streaming_llm evicts a row a step in every layer, so every layer
    compacts its holes in the same step (about 50 steps after a prompt longer
    than its 200 rows): each compaction is evaluated when it runs, so the
    step's peak does not grow with the layers (1.0x at 32 layers; left lazy,
    1.4x)."""
    opts = dict(budget=200, kv_bits=2, kv_residual=4)
    worst = [step_peak(n, "streaming_llm", opts, 60, prompt=400) for n in (2, 32)]
    assert worst[1] < 1.2 * worst[0]
