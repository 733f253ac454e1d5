"""Keys rounded with error feedback weighed by the queries to come
(`kv_round="query"`, quantized.py): the RoPE-moved query moment is the mean
over the next positions; the identity factor is nearest rounding; the feedback
cuts the logit error of queries from that moment; attention over the store
equals dense attention over its dequantized rows; the factor is state (saved,
counted in nbytes); a trim before it is set cannot be reused; options are
checked."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import rel
from mlx_lm.models import cache as mlx_cache
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.caches.quantized import (
    QuantizedStore,
    feedback_quantize,
    future_moment,
    pack_factor,
    quantize,
    rotation_at,
    rotation_signs,
    rounding_factor,
    unpack_factor,
)
from veloxpatch.errors import OptionError

D, GROUP = 64, 32


def moment(n_heads=2, seed=0, rank=6):
    """A low-rank query second moment [1, H, D, D] (queries look along a few
    directions, as real ones do)."""
    a = mx.random.normal((1, n_heads, D, rank), key=mx.random.key(seed))
    return a @ a.swapaxes(-1, -2)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_future_moment_is_the_mean_over_the_next_positions(scale):
    rope = nn.RoPE(D, base=10000.0, scale=scale)
    m2 = moment()
    got = future_moment(rope, 300, m2, n=64)
    ref = sum(
        rotation_at(rope, t, D) @ m2 @ rotation_at(rope, t, D).T
        for t in range(300, 364)
    )
    assert rel(got, ref / 64) < 1e-4
    x = mx.random.normal((D,), key=mx.random.key(2))
    rotated = rope(x[None, None, None], offset=7)[0, 0, 0]
    assert rel(rotation_at(rope, 7, D) @ x, rotated) < 1e-6


def test_rounding_factor_is_the_upper_cholesky_factor_of_the_inverse():
    h = moment(rank=D)
    u = rounding_factor(h)
    damped = h + 0.01 * mx.diagonal(h, axis1=-2, axis2=-1).mean(-1)[
        ..., None, None
    ] * mx.eye(D)
    assert rel(u.swapaxes(-1, -2) @ u @ damped, mx.eye(D)) < 1e-3
    assert float(mx.abs(mx.tril(u, -1)).max()) == 0.0


def test_the_factor_is_held_as_its_rows_strict_upper_triangle():
    u = rounding_factor(moment(rank=D))
    packed, step = pack_factor(u)
    assert packed.shape == (1, 2, D * (D - 1) // 2) and packed.dtype == mx.int8
    assert step.shape == (1, 2, 1)
    rows = u / mx.diagonal(u, axis1=-2, axis2=-1)[..., None]
    assert rel(unpack_factor(packed, step, D), rows) < 1e-2
    # an fp16 triangle (files before the 8-bit one) reads back as it was
    upper = mx.array(np.flatnonzero(np.triu(np.ones((D, D)), 1)))
    old = rows.reshape(1, 2, D * D)[..., upper]
    assert rel(unpack_factor(old.astype(mx.float16), None, D), rows) < 1e-3
    # the feedback reads the rows only: rounded by U itself or by its packed
    # rows, the keys' error under the moment is the same (codes may differ)
    h, k = moment(rank=D), mx.random.normal((1, 2, 64, D), key=mx.random.key(9))

    def weighed_error(factor):
        w, sc, b = feedback_quantize(k, GROUP, 2, "minmax", None, factor)
        e = mx.dequantize(w, sc, b, group_size=GROUP, bits=2).swapaxes(-1, -2) - k
        return float(((e @ h) * e).sum(-1).mean())

    exact = weighed_error(rounding_factor(h))
    packed, step = pack_factor(rounding_factor(h))
    assert abs(weighed_error(unpack_factor(packed, step, D)) / exact - 1) < 0.02
    assert weighed_error(mx.broadcast_to(mx.eye(D), (1, 2, D, D))) > 1.5 * exact


@pytest.mark.parametrize("grid", ["minmax", "gaussian"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_the_identity_factor_rounds_to_nearest(bits, grid):
    k = mx.random.normal((1, 2, 64, D), key=mx.random.key(bits))
    eye = mx.broadcast_to(mx.eye(D), (1, 2, D, D))
    got = feedback_quantize(k, GROUP, bits, grid, None, eye)
    ref = quantize(k.swapaxes(-1, -2), GROUP, bits, grid)
    for a, b in zip(got, ref):
        assert mx.array_equal(a, b)


@pytest.mark.parametrize("bits", [2, 3])
def test_feedback_cuts_the_logit_error_of_the_queries_it_weighs(bits):
    k1, k2 = mx.random.split(mx.random.key(5))
    keys = mx.random.normal((1, 2, 4 * GROUP, D), key=k1)
    m2 = moment(seed=1)
    # queries drawn from that moment: q = a z, z ~ N(0, I)
    a = mx.linalg.cholesky(m2 + 1e-3 * mx.eye(D), stream=mx.cpu)
    q = (a @ mx.random.normal((1, 2, D, 256), key=k2)).swapaxes(-1, -2)
    err = {}
    for rounds in (False, True):
        store = QuantizedStore((bits, bits), GROUP, rotation_signs(2, D, 0))
        store.rounds, store.query_moment = rounds, m2
        store.append(keys, keys)
        ref = q @ keys.swapaxes(-1, -2)
        err[rounds] = float(mx.sqrt(((store.logits(q) - ref) ** 2).mean()))
    assert err[True] < 0.6 * err[False]


@pytest.mark.parametrize("rotation", [None, "hadamard", "query"])
def test_store_reads_equal_dense_reads_of_its_dequantized_rows(rotation):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(7), 4)
    keys = mx.random.normal((1, 2, 64, D), key=k1)
    values = mx.random.normal((1, 2, 64, D), key=k2)
    signs = None if rotation is None else rotation_signs(2, D, 0)
    store = QuantizedStore((2, 2), GROUP, signs, query_aware=rotation == "query")
    store.rounds, store.query_moment = True, moment()
    store.query_power = mx.diagonal(moment(), axis1=-2, axis2=-1)
    store.append(keys, values)
    assert store.key_factor is not None and store.query_moment is None
    dk, dv = store.dequantize(mx.float32)
    q = mx.random.normal((1, 2, 5, D), key=k3)
    p = mx.softmax(mx.random.normal((1, 2, 5, 64), key=k4), axis=-1)
    assert rel(store.logits(q), q @ dk.swapaxes(-1, -2)) < 1e-5
    assert rel(store.weighted(p), p @ dv) < 1e-5


OPTS = dict(bits=2, residual=4, group=32, kv_rotate="hadamard", kv_round="query")


def test_the_factor_is_set_once_from_the_prompt_saved_and_counted(tmp_path):
    model = tiny_model("llama", head_dim=D)
    with veloxpatch.patched(model, "kivi", **OPTS) as patch:
        caches = patch.make_cache()
        model(prompt_tokens(20)[None], cache=caches)
        # nothing quantized yet (the sink only): the sums survive a file
        assert caches[0].store.key_factor is None and caches[0].query_m2_count > 0
        veloxpatch.save_cache(tmp_path / "early.safetensors", caches)
        early = veloxpatch.load_cache(tmp_path / "early.safetensors")
        more = prompt_tokens(60, seed=3)[None]
        out, ref = model(more, cache=early), model(more, cache=caches)
        assert mx.array_equal(out, ref)
        for a, b in zip(caches, early):
            assert a.query_m2 is None and a.store.key_factor is not None
            assert mx.array_equal(a.store.key_factor, b.store.key_factor)
        before = caches[0].nbytes
        factor = caches[0].store.key_factor
        assert factor.shape == (1, caches[0].keys.shape[1], D * (D - 1) // 2)
        assert factor.dtype == mx.int8  # with one fp32 step a head
        assert caches[0].store.factor_step.shape == (1, factor.shape[1], 1)
        veloxpatch.save_cache(tmp_path / "late.safetensors", caches)
        late = veloxpatch.load_cache(tmp_path / "late.safetensors")
        step = prompt_tokens(40, seed=4)[None]
        out, ref = model(step, cache=late), model(step, cache=caches)
        assert mx.array_equal(out, ref)
        assert mx.array_equal(late[0].store.key_factor, caches[0].store.key_factor)
        assert mx.array_equal(late[0].store.factor_step, caches[0].store.factor_step)
        # a file with the factor as an fp16 triangle (before the 8-bit one) reads
        st = caches[0].store.state()
        st["q.key_factor"] = (factor * st.pop("q.factor_step")).astype(mx.float16)
        old = QuantizedStore.from_state(st, 32, sinks=1, rounds=True)
        k = mx.zeros((1, factor.shape[1], 32, D))
        got, ref = old._factors(k)[0], caches[0].store._factors(k)[0]
        assert rel(got, ref) < 1e-3
        assert old.nbytes == caches[0].store.nbytes + factor.size - 4 * factor.shape[1]
        assert "q.factor_step" not in old.state()
    # the factor is held per sequence: nbytes counts it
    store_bytes = sum(a.nbytes for a in caches[0].store.arrays())
    assert factor.nbytes + 4 * factor.shape[1] <= store_bytes <= before


def test_a_trim_before_the_factor_is_set_cannot_be_reused():
    from veloxpatch.serve.kv import trimmed_exactly

    model = tiny_model("llama", head_dim=D)
    with veloxpatch.patched(model, "kivi", **dict(OPTS, kv_sinks=0)) as patch:
        caches = patch.make_cache()
        model(prompt_tokens(28)[None], cache=caches)
        assert caches[0].store.rows == 0  # nothing quantized yet
        mlx_cache.trim_prompt_cache(caches, 18)
        assert not trimmed_exactly(caches, 10)


def test_evicting_algorithms_round_their_requantized_groups_too():
    model = tiny_model("llama", head_dim=D)
    opts = dict(budget=40, window=4, kv_bits=2, kv_residual=4, kv_round="query")
    with veloxpatch.patched(model, "snapkv", **opts) as patch:
        caches = patch.make_cache()
        model(prompt_tokens(120)[None], cache=caches)
        for _ in range(40):
            model(prompt_tokens(1, seed=_)[None], cache=caches)
        assert all(c.store.key_factor is not None for c in caches)


@pytest.mark.parametrize(
    "algo,opts,match",
    [
        ("kivi", dict(kv_round="gptq"), "kv_round must be one of"),
        ("kivi", dict(kv_round="query", kv_keys="token"), "kv_keys='channel'"),
        ("kivi", dict(kv_round="query", kv_grid="mlx"), "'minmax' or 'gaussian'"),
        ("snapkv", dict(kv_round="query"), "needs kv_bits"),
        ("kivi", dict(kv_round="query", kv_debias=True), "kv_debias"),
    ],
)
def test_rounding_options_are_checked(algo, opts, match):
    model = tiny_model("llama", head_dim=D)
    with pytest.raises(OptionError, match=match):
        veloxpatch.apply(model, algo, **opts)
    assert veloxpatch.api.patch_of(model) is None
