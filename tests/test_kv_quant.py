"""The quantization spec (`caches/kv_quant.py`): one KVQuant behind kivi's
keywords and kv_bits=, checked once, its recipes read exactly what they store,
and files saved with the retired option names load or are refused."""

import json

import mlx.core as mx
import pytest
from helpers import rel
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch import KVQuant
from veloxpatch.caches import ALGORITHMS
from veloxpatch.caches.quantized import QuantizedStore, pack_factor, rounding_factor
from veloxpatch.errors import OptionError


@pytest.mark.parametrize(
    "bits,recipe", [(2, "query"), (3, "query"), (4, "kivi"), (8, "kivi")]
)
def test_each_width_gets_its_measured_recipe(bits, recipe):
    assert KVQuant(bits).recipe == recipe
    assert (
        ALGORITHMS["kivi"].Options.create("kivi", {"bits": bits}).quant.recipe == recipe
    )
    snap = ALGORITHMS["snapkv"].Options.create("snapkv", {"kv_bits": bits})
    assert snap.quant == KVQuant(bits)
    assert ALGORITHMS["kivi"].Options.create("kivi", {}).quant == KVQuant(2)


def test_the_shorthand_and_the_spec_are_one_option():
    snap = ALGORITHMS["snapkv"].Options
    spec = KVQuant(4, key_bits=8, group=64, residual=16)
    flat = dict(kv_bits=4, kv_key_bits=8, kv_group=64, kv_residual=16)
    assert (
        snap.create("snapkv", flat).quant
        == snap.create("snapkv", {"quant": spec}).quant
    )
    again = snap.create("snapkv", snap.create("snapkv", flat).as_dict())
    assert again.quant == spec
    assert snap.create("snapkv", {}).quant is None


@pytest.mark.parametrize(
    "algo,opts,match",
    [
        ("snapkv", dict(kv_bits=5), "kv_bits must be one of"),
        ("snapkv", dict(kv_bits=2, kv_key_bits=1), "kv_key_bits must be one of"),
        ("snapkv", dict(kv_bits=2, kv_group=16), "kv_group must be one of"),
        ("snapkv", dict(kv_bits=2, kv_residual=-1), "kv_residual must be >= 0"),
        ("snapkv", dict(kv_bits=2, kv_recipe="hadamard"), "kv_recipe must be one of"),
        ("snapkv", dict(kv_residual=8), "kv_residual needs kv_bits"),
        ("snapkv", dict(kv_bits=2, quant=KVQuant()), "not both"),
        ("snapkv", dict(kv_rotate="query"), "unknown option"),
        ("kivi", dict(bits="adaptive"), "bits must be one of"),
        ("kivi", dict(target_bits=2.5), "unknown option"),
        ("kivi", dict(quant={"bits": 2}), "veloxpatch.KVQuant"),
    ],
)
def test_bad_quantization_options_are_one_clear_line(algo, opts, match):
    with pytest.raises(OptionError, match=match) as err:
        ALGORITHMS[algo].Options.create(algo, opts)
    assert "\n" not in str(err.value)


def _rows(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed)) * mx.linspace(0.2, 3, 32)


@pytest.mark.parametrize("recipe", ["kivi", "query"])
@pytest.mark.parametrize("bits,key_bits", [(2, None), (3, None), (2, 4), (8, None)])
def test_store_reads_equal_dense_reads_of_its_dequantized_rows(recipe, bits, key_bits):
    query = recipe == "query"
    n = 64 + query  # the query recipe's dense sink, then two whole groups
    k, v, q = _rows((1, 2, n, 32), 0), _rows((1, 2, n, 32), 1), _rows((1, 2, 3, 32), 2)
    signs = mx.where(mx.random.bernoulli(0.5, (2, 32)), 1.0, -1.0) if query else None
    store = QuantizedStore(bits, 32, signs, int(query), key_bits, query, query)
    store.query_power = (q * q).mean(2)
    if query:  # the rounding factor from a second moment, as the cache sets it
        store.key_factor, store.factor_step = pack_factor(
            rounding_factor(q.swapaxes(-1, -2) @ q)
        )
    store.append(k, v)
    dk, dv = store.dequantize(mx.float32)
    assert rel(store.logits(q), q @ dk.swapaxes(-1, -2)) < 1e-4
    p = mx.softmax(store.logits(q), axis=-1)
    assert rel(store.weighted(p), p @ dv) < 1e-4
    assert store.rows == n
    assert 0 < rel(dk, k) < 1  # really quantized (feedback trades key error)
    if query:
        assert mx.array_equal(dk[:, :, :1], k[:, :, :1])  # the dense sink


def _saved_with_old_names(tmp_path, opts, old):
    model = tiny_model("llama", head_dim=32)
    with veloxpatch.patched(model, "kivi", **opts) as patch:
        caches = patch.make_cache()
        model(prompt_tokens(80)[None], cache=caches)
    path = tmp_path / "c.safetensors"
    veloxpatch.save_cache(path, caches)
    arrays, meta = mx.load(str(path), return_metadata=True)
    info = json.loads(meta["veloxpatch"])
    for entry in info["caches"]:
        saved = json.loads(entry["meta"]["options"])
        saved.pop("recipe")
        entry["meta"]["options"] = json.dumps({**saved, **old})
    return caches, arrays, info


@pytest.mark.parametrize(
    "opts,old",
    [
        (
            dict(bits=4, residual=8),
            dict(kv_rotate=None, kv_round="nearest", kv_sinks=0),
        ),
        (
            dict(bits=2, residual=8),
            dict(kv_rotate="query", kv_round="query", kv_sinks=1, kv_grid="minmax"),
        ),
    ],
)
def test_options_saved_under_the_old_names_load_as_their_recipe(tmp_path, opts, old):
    from veloxpatch.caches.base import VeloxCache

    caches, arrays, info = _saved_with_old_names(tmp_path, opts, old)
    for i, c in enumerate(caches):
        entry = info["caches"][i]
        state = {k: arrays[f"{i}/{k}"] for k in entry["arrays"]}
        loaded = VeloxCache.from_state.__func__(type(c), state, entry["meta"])
        assert loaded.options.quant == c.options.quant


def test_a_retired_option_in_a_saved_file_is_refused_in_one_line(tmp_path):
    from veloxpatch.caches.base import VeloxCache

    caches, arrays, info = _saved_with_old_names(
        tmp_path, dict(bits=2, residual=8), dict(kv_rotate="hadamard", kv_sinks=1)
    )
    entry = info["caches"][0]
    state = {k: arrays[f"0/{k}"] for k in entry["arrays"]}
    with pytest.raises(OptionError, match="no longer has") as err:
        VeloxCache.from_state.__func__(type(caches[0]), state, entry["meta"])
    assert "\n" not in str(err.value)  # (load_cache wraps it: CacheFileError)
