"""The cache contract, checked for every entry of `veloxpatch.algos()`.

A new algorithm is one file plus one registry line, and one line in CONTRACT
below (options that make it evict on a 60-token tiny run); the first test fails
until that line exists. Every algorithm then gets, with and without `kv_bits`
where its options have it: the masked-dense oracle on tiny llama, qwen3 and
ministral3, save/load, bounded bytes over a long decode, `offset`, option
validation with a clear error, and restore by identity.
"""

import gc
import importlib
import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import greedy, max_abs
from oracle import oracle_logits, run_patched
from tiny import SCORER, prompt_tokens, resolve_options, tiny_model

import veloxpatch
from veloxpatch.api import algorithm
from veloxpatch.errors import UnsupportedModelError, VeloxpatchError

# Small budgets so that a 60-token run evicts in prefill chunks and in decode.
CONTRACT = {
    "full": {},
    "streaming_llm": dict(budget=12, sinks=2),
    "knorm": dict(budget=14, sinks=2),
    "snapkv": dict(budget=16, window=4),
    "pyramidkv": dict(budget=16, window=4, beta=4),
    "adakv": dict(budget=16, window=4),
    "h2o": dict(budget=12, sinks=2),
    "tova": dict(budget=12, sinks=2),
    "keyformer": dict(budget=12, sinks=1, recent=3),
    "qfilters": dict(budget=16, window=4),
    "expected_attention": dict(budget=14, sinks=2, window=4),
    # top=1: retrieval of every far row is dense attention (test_a2ats.py checks
    # what a smaller fraction retrieves).
    "a2ats": dict(window=8, sinks=2, top=1.0),
    "kivi": dict(bits=8, residual=4),
    "kvzip": dict(budget=12, sinks=2, window=4),
    "kvzap": dict(budget=12, sinks=2, window=4, chunk=8, scorer=SCORER),
}
QUANTIZED = dict(kv_bits=8, kv_residual=4)
CHUNKED = dict(compress="chunks", chunk=8)
# snapkv at 2 bits: 40 rows, so whole 32-row groups are quantized before eviction
SNAPKV_KV2 = dict(budget=40, window=4, kv_bits=2, kv_residual=4)
# each recipe (kv_quant.py) on kivi and under eviction: 2 bits' default is the
# query recipe (scaled, rotated, rounded for the queries, a dense sink)
ROTATED = [
    ("kivi", dict(bits=2, residual=4), "kivi-query"),
    ("kivi", dict(bits=2, residual=4, recipe="kivi"), "kivi-2-plain"),
    ("kivi", dict(CONTRACT["kivi"], recipe="query"), "kivi-8-query"),
    ("snapkv", SNAPKV_KV2, "snapkv-kv2-query"),
    ("snapkv", dict(SNAPKV_KV2, kv_recipe="kivi"), "snapkv-kv2-plain"),
    (
        "kvzip",
        dict(CONTRACT["kvzip"], budget=40, kv_bits=2, kv_residual=4),
        "kvzip-kv2-query",
    ),
    # dense sinks under eviction: heads keep different rows (Ada-KV), sinks stay
    (
        "h2o",
        dict(budget=40, kv_bits=2, kv_residual=4, head_budget="adaptive"),
        "h2o-kv2-adaptive",
    ),
    # keys at their own width, on kivi and on an evicting algorithm
    ("kivi", dict(bits=2, key_bits=4, residual=4), "kivi-k4v2"),
    ("snapkv", dict(SNAPKV_KV2, kv_key_bits=3), "snapkv-k3v2"),
]
# kvzap's other mode: drop what scores under 0 (about half), capped by a budget
THRESHOLD = [
    ("kvzap", dict(CONTRACT["kvzap"], threshold=0.0, budget=16), "kvzap-threshold"),
    (
        "kvzap",
        dict(CONTRACT["kvzap"], threshold=0.0, budget=16, **QUANTIZED),
        "kvzap-threshold-kv8",
    ),
]
NOT_EVICTING = {"full", "a2ats", "kivi"}
ARCHS = ["llama", "qwen3", "ministral3"]
N, CHUNKS = 60, [9, 7, 11]  # prefill chunks, then single-token decode
HEAD_DIM = 32  # quantized rows need groups of 32 channels
TWO_BITS = 6.0


def has_option(algo, name):
    return name in algorithm(algo).Options.option_names()


def variants():
    out = []
    for algo in veloxpatch.algos():
        opts = CONTRACT.get(algo, {})
        out.append(pytest.param(algo, opts, id=algo))
        if has_option(algo, "kv_bits"):
            out.append(pytest.param(algo, {**opts, **QUANTIZED}, id=f"{algo}-kv8"))
        if has_option(algo, "compress"):  # cut every 8 prompt tokens, mid-call too
            chunked = {**opts, **CHUNKED}
            out.append(pytest.param(algo, chunked, id=f"{algo}-chunks"))
    more = ROTATED + THRESHOLD
    return out + [pytest.param(algo, opts, id=name) for algo, opts, name in more]


def quantized(algo, opts):
    return "kv_bits" in opts or algo == "kivi"


def oracle_tolerance(algo, opts):
    """Max |log-prob| error against the dense oracle: 8-bit rows move tiny
    qwen3's sharpened log-probabilities by up to ~0.06 (rotated rows read
    unrotated: ~4); 2-bit rows up to ~3.6, rotated or not, so there the oracle
    checks what is hidden and held (test_rotation.py checks their attention
    against their dequantized rows)."""
    if not quantized(algo, opts):
        return 1e-4
    return 0.1 if opts.get("kv_bits", opts.get("bits")) == 8 else TWO_BITS


def logprobs(x):
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def skip_if_refused(model, algo, opts):
    """An algorithm may refuse an architecture (A2ATS: YaRN ropes), with one
    clear line before anything is patched; then there is nothing else to check."""
    opts = resolve_options(model, opts)
    try:
        veloxpatch.apply(model, algo, **opts).restore()
    except UnsupportedModelError as e:
        assert "\n" not in str(e) and veloxpatch.api.patch_of(model) is None
        pytest.skip(f"{algo} refuses this model: {e}")


def test_every_algorithm_has_contract_options():
    assert set(veloxpatch.algos()) == set(CONTRACT), (
        "add the new algorithm's small-budget options to CONTRACT"
    )


@pytest.mark.parametrize("algo,opts", variants())
@pytest.mark.parametrize("arch", ARCHS)
def test_masked_dense_oracle(arch, algo, opts):
    model = tiny_model(arch, head_dim=HEAD_DIM)
    skip_if_refused(model, algo, opts)
    tokens = prompt_tokens(N).tolist()
    opts = resolve_options(model, opts)
    patched, masks, caches = run_patched(model, tokens, CHUNKS, algo, **opts)
    dense = oracle_logits(model, tokens, masks)
    err = mx.abs(logprobs(patched) - logprobs(dense)).max().item()
    assert err <= oracle_tolerance(algo, opts)
    assert all(c.offset == N for c in caches)
    causal = np.tril(np.ones((N, N), bool))
    hidden = sum(int((causal & ~m).sum()) for m in masks)
    if algo in NOT_EVICTING:
        assert hidden == 0
    else:  # eviction really happened, and what is held is within the bound
        assert hidden > 0
        assert all(c.rows <= c.row_bound() for c in caches)


@pytest.mark.parametrize("algo,opts", variants())
def test_save_load_then_generation_continues(tmp_path, algo, opts):
    model = tiny_model("qwen3", head_dim=HEAD_DIM)
    prompt = prompt_tokens(40)
    opts = resolve_options(model, opts)
    with veloxpatch.patched(model, algo=algo, **opts) as patch:
        caches = patch.make_cache()
        greedy(model, prompt, n=6, prompt_cache=caches)  # prompt ended, decoding
        veloxpatch.save_cache(tmp_path / "c.safetensors", caches)
        loaded = veloxpatch.load_cache(tmp_path / "c.safetensors")
        assert [type(c) for c in loaded] == [type(c) for c in caches]
        assert [c.offset for c in loaded] == [c.offset for c in caches]
        nxt = mx.array([5])
        t1, l1 = greedy(model, nxt, n=8, prompt_cache=caches)
        t2, l2 = greedy(model, nxt, n=8, prompt_cache=loaded)
    assert t1 == t2 and max_abs(l1, l2) == 0.0


def full_bytes(caches, model):
    """What mlx-lm's own KVCache holds for the same tokens (no positions)."""
    attn = model.layers[0].self_attn
    per_token = 2 * attn.n_kv_heads * HEAD_DIM * 4
    return sum(per_token * c.offset for c in caches)


@pytest.mark.parametrize("algo,opts", variants())
def test_bytes_stay_bounded_over_a_long_decode(algo, opts):
    model = tiny_model("llama", head_dim=HEAD_DIM, num_hidden_layers=1)
    opts = resolve_options(model, opts)
    with veloxpatch.patched(model, algo=algo, **opts) as patch:
        caches = patch.make_cache()
        y = prompt_tokens(24)[None]
        held = []
        for _ in range(400):
            logits = model(y, cache=caches)
            y = mx.argmax(logits[:, -1:], axis=-1)
            mx.eval(y)
            held.append(sum(c.nbytes for c in caches))
    assert caches[0].offset == 24 + 399
    if algo in NOT_EVICTING:  # everything kept: no more than a full cache, + codes
        assert held[-1] <= 1.5 * full_bytes(caches, model)
    else:  # no growth with the generation length
        assert max(held[200:]) <= max(held[100:200])
        assert all(c.rows <= c.row_bound() for c in caches)


@pytest.mark.parametrize("algo,opts", variants())
def test_nbytes_counts_every_array_a_cache_holds(algo, opts):
    # what a cache keeps between calls (rows, scores, buffered queries,
    # statistics) is in nbytes, and so in max_kv_bytes; a file's calibration
    # data (filters, scorers, codebooks) is the model's, shared by its caches
    model = tiny_model("llama", head_dim=HEAD_DIM, num_hidden_layers=2)
    opts = resolve_options(model, opts)
    with veloxpatch.patched(model, algo=algo, **opts) as patch:
        caches = patch.make_cache()
        greedy(model, prompt_tokens(60), n=6, prompt_cache=caches)
    shared = {id(a) for c in caches for a in (getattr(c.options, "loaded", None) or [])}
    for c in caches:
        held = {id(a) for a in c.held_arrays()}
        kept = [
            name
            for name, a in vars(c).items()
            if isinstance(a, mx.array) and a.size and id(a) not in shared
        ]
        assert [n for n in kept if id(getattr(c, n)) not in held] == []
        assert c.nbytes == sum(a.nbytes for a in c.held_arrays())


@pytest.mark.parametrize("algo,opts", variants())
def test_a_cache_holds_no_more_memory_than_its_nbytes(algo, opts):
    # nbytes counts arrays, but an array sliced out of a larger one keeps the
    # whole buffer alive: the prefill chunks of a long prompt leave none held
    model = tiny_model("llama", head_dim=HEAD_DIM, num_hidden_layers=2)
    opts = resolve_options(model, opts)
    ids = prompt_tokens(600)[None]
    with veloxpatch.patched(model, algo=algo, **opts) as patch:
        caches = patch.make_cache()
        for start in range(0, ids.shape[1], 256):
            model(ids[:, start : start + 256], cache=caches)
            mx.eval([c.state for c in caches])
        gc.collect()
        before = mx.get_active_memory()
        held = sum(c.nbytes for c in caches)
        del caches
        gc.collect()
        freed = before - mx.get_active_memory()
    # (small arrays' allocations round up a little)
    assert freed <= 1.6 * held + 16 * 1024, (freed, held)


# Values no option accepts: wrong types, NaN, infinities, huge negatives.
BAD_VALUES = ["bogus-value", math.nan, math.inf, -math.inf, [1], -(10**9)]


@pytest.mark.parametrize("algo", veloxpatch.algos())
def test_every_option_rejects_bad_values_clearly_and_changes_nothing(algo):
    model = tiny_model("llama", head_dim=HEAD_DIM)
    module = importlib.import_module(type(model.layers[0].self_attn).__module__)
    original = module.Attention.__dict__["__call__"]
    base = resolve_options(model, CONTRACT[algo])
    for name in algorithm(algo).Options.option_names():
        for value in BAD_VALUES:
            with pytest.raises(VeloxpatchError) as err:
                veloxpatch.apply(model, algo=algo, **{**base, name: value})
            message = str(err.value)
            assert "\n" not in message
            assert veloxpatch.api.patch_of(model) is None
            assert module.Attention.__dict__["__call__"] is original
            assert "make_cache" not in model.__dict__


@pytest.mark.parametrize("algo,opts", variants())
def test_restore_by_identity(algo, opts):
    model = tiny_model("qwen3", head_dim=HEAD_DIM)
    module = importlib.import_module(type(model.layers[0].self_attn).__module__)
    original = module.Attention.__dict__["__call__"]
    before = dict(veloxpatch_params(model))
    opts = resolve_options(model, opts)
    with veloxpatch.patched(model, algo=algo, **opts) as patch:
        greedy(model, prompt_tokens(20), n=4, prompt_cache=patch.make_cache())
    assert module.Attention.__dict__["__call__"] is original
    assert "make_cache" not in model.__dict__
    after = dict(veloxpatch_params(model))
    assert list(after) == list(before)
    assert all(after[k] is before[k] for k in before)


def veloxpatch_params(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())
