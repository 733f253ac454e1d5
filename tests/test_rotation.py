"""Quantized rows stored rotated (`kv_rotate="hadamard"`, TurboQuant): the
attention over them equals dense attention over their dequantized rows, at
every width, with and without GQA, in prefill pieces and decode; the rotation
is orthogonal and spreads an outlier channel; options are checked."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import greedy, rel
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import make_prompt_cache
from tiny import SCORER, prompt_tokens, resolve_options, tiny_model

import veloxpatch
from veloxpatch.caches import ALGORITHMS
from veloxpatch.caches.quantized import (
    QuantizedStore,
    key_scales,
    rotate,
    rotation_signs,
    unrotate,
)
from veloxpatch.errors import OptionError

D, GROUP = 64, 32


def test_rotation_is_orthogonal_and_seeded_per_layer():
    signs = rotation_signs(3, D, layer=5)
    assert set(np.unique(np.array(signs))) == {-1.0, 1.0}
    assert (np.array(signs) == np.array(rotation_signs(3, D, layer=5))).all()
    assert not (np.array(signs) == np.array(rotation_signs(3, D, layer=6))).all()
    x = mx.random.normal((1, 3, 7, D), key=mx.random.key(1))
    y = rotate(x, signs)
    assert rel(unrotate(y, signs), x) < 1e-6
    assert rel(mx.linalg.norm(y, axis=-1), mx.linalg.norm(x, axis=-1)) < 1e-6
    assert rel(y @ y.swapaxes(-1, -2), x @ x.swapaxes(-1, -2)) < 1e-5


@pytest.mark.parametrize("keys", ["channel", "token"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_store_reads_equal_dense_reads_of_its_dequantized_rows(bits, keys):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(bits), 4)
    rows_k = mx.random.normal((1, 2, 64, D), key=k1)
    values = mx.random.normal((1, 2, 64, D), key=k2)
    store = QuantizedStore((bits, bits), GROUP, rotation_signs(2, D, 0), keys)
    store.append(rows_k, values)
    # whole groups kept, then some rows only, as eviction and compaction do
    store.take_groups(mx.array([[[1, 0], [0, 1]]]))
    store.truncate(GROUP)
    dk, dv = store.dequantize(mx.float32)
    q = mx.random.normal((1, 2, 5, D), key=k3)
    p = mx.softmax(mx.random.normal((1, 2, 5, GROUP), key=k4), axis=-1)
    assert rel(store.logits(q), q @ dk.swapaxes(-1, -2)) < 1e-5
    assert rel(store.weighted(p), p @ dv) < 1e-5
    # and the dequantized rows are the original ones, to the grid's error
    kept = mx.stack([rows_k[0, 0, GROUP:], rows_k[0, 1, :GROUP]])[None]
    assert rel(dk, kept) < {2: 0.8, 3: 0.4, 4: 0.2, 8: 0.02}[bits]
    st = QuantizedStore.from_state(store.state(), GROUP)
    assert st.keys == keys and mx.array_equal(st.dequantize(mx.float32)[0], dk)


def test_rotation_spreads_outlier_channels_of_per_token_groups():
    # rows with two channels 10x the rest: values, quantized per token in groups
    # of channels, lose the small channels to the outliers' range unless rotated;
    # keys, grouped per channel along tokens, isolate them anyway (no gain)
    base = mx.random.normal((1, 2, 64, D), key=mx.random.key(7))
    rows = base * mx.where((mx.arange(D) == 3) | (mx.arange(D) == 40), 10.0, 1.0)
    err = {}
    for name, signs in (("plain", None), ("rotated", rotation_signs(2, D, 0))):
        store = QuantizedStore((2, 2), GROUP, signs)
        store.append(rows, rows)
        dk, dv = store.dequantize(mx.float32)
        norm = mx.linalg.norm(rows)
        err[name] = [float(mx.linalg.norm(x - rows) / norm) for x in (dk, dv)]
    assert err["rotated"][1] < 0.7 * err["plain"][1]  # values
    assert err["rotated"][0] == pytest.approx(err["plain"][0], rel=0.1)  # keys


@pytest.mark.parametrize("rotation", ["hadamard", "query"])
@pytest.mark.parametrize("keys", ["channel", "token"])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_cache_attention_equals_dense_attention_of_its_rows(
    bits, heads, keys, rotation
):
    # kernel path: prefill pieces under 32 queries, then decode
    hq, hkv = heads
    cls = ALGORITHMS["kivi"]
    opts = dict(bits=bits, residual=4, kv_rotate=rotation, kv_keys=keys)
    cache = cls(cls.Options(**opts))
    total = 0
    for i, L in enumerate([20, 30, 25, 1, 1, 1]):
        kq, kk, kv = mx.random.split(mx.random.key(100 * bits + i), 3)
        q = mx.random.normal((1, hq, L, D), key=kq)
        k = mx.random.normal((1, hkv, L, D), key=kk)
        v = mx.random.normal((1, hkv, L, D), key=kv)
        dk, dv = k, v  # what the call attends: the rows held, then its own
        if total:
            view, values = cache._view()
            if hasattr(view, "rows_dense"):
                view, values = view.rows_dense()
            dk, dv = mx.concatenate([view, k], 2), mx.concatenate([values, v], 2)
        quantized = cache.quantized
        out = cache.attend(q, k, v, rope=lambda t, offset=0: t, scale=D**-0.5)
        total += L
        mask = mx.arange(total)[None] <= mx.arange(total - L, total)[:, None]
        ref = mx.fast.scaled_dot_product_attention(q, dk, dv, scale=D**-0.5, mask=mask)
        assert rel(out, ref) < 1e-5
    assert quantized > 0 and cache.store.signs is not None
    assert (cache.store.key_scale is not None) == (rotation == "query")


@pytest.mark.parametrize("debias", [False, True])
@pytest.mark.parametrize("rotation", ["hadamard", "query"])
def test_rotated_rows_round_trip_a_file(tmp_path, rotation, debias):
    model = tiny_model("qwen3", head_dim=D)
    opts = dict(bits=2, residual=4, kv_rotate=rotation, kv_debias=debias)
    with veloxpatch.patched(model, "kivi", **opts) as patch:
        caches = patch.make_cache()
        model(prompt_tokens(80)[None], cache=caches)
        veloxpatch.save_cache(tmp_path / "c.safetensors", caches)
        loaded = veloxpatch.load_cache(tmp_path / "c.safetensors")
        for a, b in zip(caches, loaded):
            assert b.options.kv_debias is debias
            assert (np.array(a.store.signs) == np.array(b.store.signs)).all()
            if rotation == "query":
                assert mx.array_equal(a.store.key_scale, b.store.key_scale)
        nxt = mx.array([[5]])
        assert mx.array_equal(model(nxt, cache=caches), model(nxt, cache=loaded))


# ---- query-aware scaling (kv_rotate="query") ---------------------------------------
def test_key_scales_follow_queries_over_key_spread():
    k1, k2 = mx.random.split(mx.random.key(3))
    spread = mx.exp(mx.random.normal((D,), key=k1))
    keys = mx.random.normal((1, 2, 2 * GROUP, D), key=k2) * spread + 5.0
    power = mx.exp(mx.random.normal((1, 2, D), key=k1))
    s = np.array(key_scales(power, keys, GROUP), np.float64)
    g = np.array(keys, np.float64).reshape(1, 2, 2, GROUP, D)
    var = g.var(3).mean(2)  # within each group: offsets between groups ignored
    ref = (np.array(power, np.float64) / var) ** 0.25
    ref /= np.exp(np.log(ref).mean(-1, keepdims=True))
    assert np.abs(s / ref - 1).max() < 1e-4
    assert (np.array(key_scales(None, keys, GROUP)) == 1).all()


def test_query_aware_scaling_cuts_the_logit_error_of_2_bit_keys():
    # queries look along a few channels where keys vary little; a plain rotation
    # spreads the large channels' rounding error onto them, the scaled one not
    k1, k2, k3 = mx.random.split(mx.random.key(11), 3)
    loud = mx.where(mx.arange(D) < 8, 0.2, 3.0)
    keys = mx.random.normal((1, 2, 4 * GROUP, D), key=k1) * loud
    look = mx.where(mx.arange(D) < 8, 4.0, 0.3)
    q = mx.random.normal((1, 2, 64, D), key=k2) * look
    err = {}
    for aware in (False, True):
        signs = rotation_signs(2, D, 0)
        store = QuantizedStore((2, 2), GROUP, signs, query_aware=aware)
        store.query_power = (q * q).mean(2)
        store.append(keys, keys)
        ref = q @ keys.swapaxes(-1, -2)
        err[aware] = float(mx.sqrt(((store.logits(q) - ref) ** 2).mean()))
    assert err[True] < 0.5 * err[False]


def test_query_power_before_the_first_group_survives_a_file(tmp_path):
    # saved before any row is quantized: the next group's scales still see the
    # prompt's queries
    model = tiny_model("llama", head_dim=D)
    opts = dict(bits=2, residual=4, group=32, kv_rotate="query")
    with veloxpatch.patched(model, "kivi", **opts) as patch:
        caches = patch.make_cache()
        model(prompt_tokens(20)[None], cache=caches)
        assert caches[0].store.key_scale is None and caches[0].query_count > 0
        veloxpatch.save_cache(tmp_path / "c.safetensors", caches)
        loaded = veloxpatch.load_cache(tmp_path / "c.safetensors")
        more = prompt_tokens(40)[None]
        out, ref = model(more, cache=loaded), model(more, cache=caches)
        assert mx.array_equal(out, ref)
        for a, b in zip(caches, loaded):
            assert a.query_power is None and a.store.key_scale is not None
            assert mx.array_equal(a.store.key_scale, b.store.key_scale)


def test_a_first_group_formed_by_compaction_reads_the_query_sums_so_far(tmp_path):
    # kvzap's threshold keeps the rows few: only the dense sink is quantized when
    # the file is saved, and a compaction forms the first group afterwards
    model = tiny_model("llama", head_dim=D)
    opts = dict(scorer=SCORER, threshold=0.0, window=4, kv_bits=2, kv_residual=8)
    opts = resolve_options(model, dict(opts, kv_group=32, kv_rotate="query"))
    with veloxpatch.patched(model, "kvzap", **opts) as patch:
        caches = patch.make_cache()
        model(prompt_tokens(60)[None], cache=caches)
        assert all(c.store.rows == 1 and not c._scaled for c in caches)
        veloxpatch.save_cache(tmp_path / "c.safetensors", caches)
        loaded = veloxpatch.load_cache(tmp_path / "c.safetensors")
        for cs in (caches, loaded):
            model(prompt_tokens(200, seed=2)[None], cache=cs)
        ref = [c.store.key_scale for c in caches]
        more = prompt_tokens(8)[None]
        out, ref_out = (model(more, cache=c) for c in (loaded, caches))
    for c, scale in zip(loaded, ref):
        assert mx.array_equal(c.store.key_scale, scale)
    assert mx.array_equal(out, ref_out)


@pytest.mark.parametrize("rotation", ["query", "hadamard"])
def test_a_trim_before_the_first_group_cannot_take_back_the_query_sums(rotation):
    # the sums hold the trimmed tokens' queries: the server must not hand the
    # trimmed cache to another request as if it had seen only the shared tokens
    from veloxpatch.serve.kv import trimmed_exactly

    model = tiny_model("llama", head_dim=D)
    opts = dict(bits=2, residual=4, group=32, kv_rotate=rotation, kv_sinks=0)
    with veloxpatch.patched(model, "kivi", **opts) as patch:
        caches = patch.make_cache()
        model(prompt_tokens(28)[None], cache=caches)
        assert caches[0].store.rows == 0  # nothing quantized yet
        mlx_cache.trim_prompt_cache(caches, 18)
        exact = trimmed_exactly(caches, 10)
        reused = model(prompt_tokens(28)[None, 10:], cache=caches)
        fresh = model(prompt_tokens(28)[None], cache=patch.make_cache())[:, 10:]
    if rotation == "query":
        assert not exact
    else:  # nothing but the rows: the trim is exact
        assert exact and rel(reused, fresh) < 1e-5


@pytest.mark.parametrize(
    "algo,opts,match",
    [
        ("kivi", dict(kv_rotate="random"), "kv_rotate must be one of"),
        ("snapkv", dict(kv_rotate="hadamard"), "needs kv_bits"),
        ("snapkv", dict(kv_bits=4, kv_rotate=True), "kv_rotate must be one of"),
        ("kivi", dict(kv_keys="row"), "kv_keys must be one of"),
        ("h2o", dict(kv_keys="token"), "kv_keys='token' needs kv_bits"),
    ],
)
def test_rotation_options_are_checked(algo, opts, match):
    model = tiny_model("llama", head_dim=D)
    with pytest.raises(OptionError, match=match):
        veloxpatch.apply(model, algo, **opts)
    assert veloxpatch.api.patch_of(model) is None


def test_a_head_dim_without_a_hadamard_transform_is_refused():
    model = tiny_model("llama", head_dim=96)  # 3 x 32: 96 = 12 x 8 is fine
    veloxpatch.apply(model, "kivi", bits=4, kv_rotate="hadamard").restore()
    odd = tiny_model("llama", head_dim=160)  # 5 x 32 = 20 x 8: fine too
    veloxpatch.apply(odd, "kivi", bits=4, kv_rotate="hadamard").restore()
    bad = tiny_model("llama", head_dim=288)  # 9 x 32
    with pytest.raises(OptionError, match="head dim 288"):
        veloxpatch.apply(bad, "kivi", bits=4, kv_rotate="hadamard")
    assert veloxpatch.api.patch_of(bad) is None


# ---- grids (kv_grid) ----------------------------------------------------------------
def test_gaussian_step_is_the_mse_optimal_uniform_step_of_max_1960():
    from veloxpatch.caches.quantized import gaussian_step

    for bits, step in ((2, 0.9957), (3, 0.5860), (4, 0.3352)):
        assert gaussian_step(bits) == pytest.approx(step, abs=5e-4)


def test_gaussian_grid_beats_minmax_on_gaussian_rows_at_2_bits():
    from veloxpatch.caches.quantized import (
        gaussian_quantize,
        gaussian_step,
        minmax_quantize,
    )

    x = mx.random.normal((4, 256, 64), key=mx.random.key(3)) * 2.0 + 0.5
    err = {}
    for name, fn in (("gaussian", gaussian_quantize), ("minmax", minmax_quantize)):
        w, s, b = fn(x, 64, 2)
        back = mx.dequantize(w, s, b, group_size=64, bits=2)
        err[name] = float(((back - x) ** 2).mean())
    # the optimal uniform grid's error on N(0.5, 4): 4 x 0.1188 (Max, 1960)
    assert err["gaussian"] == pytest.approx(4 * 0.1188, rel=0.08)
    assert err["gaussian"] < 0.85 * err["minmax"]
    # each group: its mean at the grid's centre, its std x the step between levels
    w, s, b = gaussian_quantize(x, 64, 2)
    g = np.array(x, np.float64)
    s, b = np.array(s[..., 0]), np.array(b[..., 0])  # one group a row
    np.testing.assert_allclose(s, g.std(-1) * gaussian_step(2), rtol=1e-4)
    np.testing.assert_allclose(b + 1.5 * s, g.mean(-1), atol=1e-4)
    # a constant group is its value exactly
    const = mx.full((1, 64), 3.25)
    w, s, b = gaussian_quantize(const, 32, 2)
    assert mx.array_equal(mx.dequantize(w, s, b, group_size=32, bits=2), const)


@pytest.mark.parametrize("keys", ["channel", "token"])
@pytest.mark.parametrize(
    "grid,bits", [("gaussian", 2), ("gaussian", 3), ("mlx", 2), ("mxfp4", 4)]
)
def test_every_grid_reads_equal_dense_reads_and_survives_save(grid, bits, keys):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(bits), 4)
    rows_k = mx.random.normal((1, 2, 64, D), key=k1)
    values = mx.random.normal((1, 2, 64, D), key=k2)
    store = QuantizedStore((bits, bits), GROUP, rotation_signs(2, D, 0), keys, grid)
    store.append(rows_k, values)
    store.take_groups(mx.array([[[1, 0], [0, 1]]]))
    store.truncate(GROUP)
    dk, dv = store.dequantize(mx.float32)
    q = mx.random.normal((1, 2, 5, D), key=k3)
    p = mx.softmax(mx.random.normal((1, 2, 5, GROUP), key=k4), axis=-1)
    assert rel(store.logits(q), q @ dk.swapaxes(-1, -2)) < 1e-5
    assert rel(store.weighted(p), p @ dv) < 1e-5
    kept = mx.stack([rows_k[0, 0, GROUP:], rows_k[0, 1, :GROUP]])[None]
    assert rel(dk, kept) < {2: 0.8, 3: 0.4, 4: 0.3}[bits]
    st = QuantizedStore.from_state(store.state(), GROUP)
    assert st.grid == grid and mx.array_equal(st.dequantize(mx.float32)[0], dk)
    biases = [n for n in store.state() if n.endswith("b")]
    assert (grid == "mxfp4") == (not biases)  # mxfp4 keeps no biases


def test_grid_options_are_checked():
    from veloxpatch.api import make_options

    with pytest.raises(OptionError, match="kv_grid"):
        make_options("kivi", {"kv_grid": "lloyd"})
    with pytest.raises(OptionError, match="4 bits in groups of 32"):
        make_options("kivi", {"bits": 2, "kv_grid": "mxfp4"})
    with pytest.raises(OptionError, match="needs kv_bits"):
        make_options("snapkv", {"kv_grid": "gaussian"})
    _, opts = make_options("snapkv", {"kv_bits": 4, "kv_grid": "mxfp4"})
    assert opts.kv_grid == "mxfp4"
    for algo, bits in (("snapkv", "kv_bits"), ("kivi", "bits")):
        mx16 = {bits: 4, "kv_grid": "mxfp4", "kv_scales": "float16"}
        with pytest.raises(OptionError, match="its own 8-bit scales"):
            make_options(algo, mx16)


@pytest.mark.parametrize("grid", ["minmax", "gaussian", "mlx"])
def test_fp16_scales_halve_their_bytes_and_read_as_dense(grid):
    rows = mx.random.normal((1, 2, 64, D), key=mx.random.key(9))
    stores = {}
    for scales in ("model", "float16"):
        store = QuantizedStore((2, 2), GROUP, None, "channel", grid, scales)
        store.append(rows, rows)
        stores[scales] = store
    wide, half = stores["model"], stores["float16"]
    assert half.parts[0].ks.dtype == half.parts[0].vb.dtype == mx.float16
    codes = sum(a.nbytes for a in half.arrays() if a.dtype == mx.uint32)
    assert half.nbytes - codes == (wide.nbytes - codes) // 2
    dk, dv = half.dequantize(mx.float32)
    q = mx.random.normal((1, 2, 3, D), key=mx.random.key(10))
    assert rel(half.logits(q), q @ dk.swapaxes(-1, -2)) < 1e-5
    # the same grid with its scales rounded: as close to the rows
    err = [
        float(mx.linalg.norm(k - rows) / mx.linalg.norm(rows))
        for k in (dk, wide.dequantize(mx.float32)[0])
    ]
    assert err[0] == pytest.approx(err[1], rel=0.05)
    back = QuantizedStore.from_state(half.state(), GROUP)
    assert back.scales == "float16" and mx.array_equal(
        back.dequantize(mx.float32)[0], dk
    )


# ---- TurboQuant's 1-bit residual (kv_qjl) ---------------------------------------
@pytest.mark.parametrize("bits", [2, 3])
def test_qjl_store_reads_equal_dense_reads_and_survives_save(bits):
    from veloxpatch.caches.quantized import qjl_matrix

    k1, k2, k3 = mx.random.split(mx.random.key(20 + bits), 3)
    rows_k = mx.random.normal((1, 2, 64, D), key=k1)
    values = mx.random.normal((1, 2, 64, D), key=k2)
    signs, qjl = rotation_signs(2, D, 0), qjl_matrix(D, 0)
    store = QuantizedStore(
        (bits, bits), GROUP, signs, "token", "gaussian", "model", qjl
    )
    store.append(rows_k, values)
    store.take_groups(mx.array([[[1, 0], [0, 1]]]))
    store.truncate(GROUP)
    assert store.parts[0].rw.shape == (1, 2, GROUP, D // 32)  # one bit a coordinate
    dk, _ = store.dequantize(mx.float32)
    q = mx.random.normal((1, 2, 5, D), key=k3)
    assert rel(store.logits(q), q @ dk.swapaxes(-1, -2)) < 1e-5
    back = QuantizedStore.from_state(store.state(), GROUP)
    assert mx.array_equal(back.qjl, qjl)
    assert mx.array_equal(back.dequantize(mx.float32)[0], dk)


def test_qjl_estimate_of_the_residual_is_unbiased():
    """Over many draws of S, the sketch's estimate of q . r averages to q . r
    (sqrt(pi/2) / D is the right constant), for residuals of 1-bit keys."""
    from veloxpatch.caches.quantized import QuantizedRows

    k = mx.random.normal((1, 1, 32, D), key=mx.random.key(5))
    q = mx.random.normal((1, 1, 1, D), key=mx.random.key(6))
    plain = QuantizedRows(1, GROUP, "token", "gaussian")
    plain.append(k, k)
    k_hat, _ = plain.dequantize(mx.float32)
    true = (q @ (k - k_hat).swapaxes(-1, -2))[0, 0, 0]
    draws = []
    for seed in range(400):
        S = mx.random.normal((D, D), key=mx.random.key(1000 + seed))
        rows = QuantizedRows(2, GROUP, "token", "gaussian", qjl=S)
        rows.append(k, k)
        draws.append((rows.logits(q) - q @ k_hat.swapaxes(-1, -2))[0, 0, 0])
    est = mx.stack(draws)
    err = est.mean(0) - true
    spread = est.std(0) / math.sqrt(len(draws))
    assert float(mx.abs(err / spread).max()) < 4.5  # within noise, every key
    assert float(mx.abs(err).mean()) < 0.1 * float(mx.abs(true).mean())


def test_qjl_options_are_checked():
    from veloxpatch.api import make_options as make

    with pytest.raises(OptionError, match="kv_keys='token'"):
        make("kivi", {"bits": 2, "kv_qjl": True})
    with pytest.raises(OptionError, match="bits 2, 3 or 4"):
        make("kivi", {"bits": 8, "kv_qjl": True, "kv_keys": "token"})
    with pytest.raises(OptionError, match="true or false"):
        make("kivi", {"bits": 2, "kv_qjl": "yes", "kv_keys": "token"})
    _, opts = make("snapkv", {"kv_bits": 2, "kv_qjl": True, "kv_keys": "token"})
    assert opts.kv_qjl


@pytest.mark.parametrize("keys", ["channel", "token"])
def test_a_rebuilt_rotated_store_holds_the_rows_it_was_given(keys):
    # compaction (kv_bits._compact) requantizes dequantized, unrotated rows
    k1, k2 = mx.random.split(mx.random.key(31), 2)
    rows_k = mx.random.normal((1, 2, 64, D), key=k1)
    values = mx.random.normal((1, 2, 64, D), key=k2)
    store = QuantizedStore((4, 4), GROUP, rotation_signs(2, D, 0), keys)
    store.append(rows_k, values)
    dk, dv = store.dequantize(mx.float32)
    exact = mx.array([[[True, False], [False, False]]])  # one group kept as it is
    new = [64] * (64 - GROUP)  # rows from outside the old ones
    src = mx.array([[list(range(GROUP)) + new, [64] * 64]])  # (its rows)
    store.rebuild(dk, dv, exact, mx.array([[[0, 1], [0, 1]]]), src)
    back_k, back_v = store.dequantize(mx.float32)
    assert rel(back_k, rows_k) < 0.2 and rel(back_v, values) < 0.2
    assert mx.array_equal(back_k[0, 0, :GROUP], dk[0, 0, :GROUP])  # kept exactly


@pytest.mark.parametrize("rotation", ["hadamard", "query"])
def test_evicting_rotated_rows_down_to_the_residual_keeps_the_rows_kept(
    rotation, monkeypatch
):
    # a compaction that leaves no whole group past the residual rebuilds an
    # empty store (it once rotated the empty rows and failed): cut in chunks of
    # the prompt, each after its rows past the residual were quantized
    model = tiny_model("llama", head_dim=D)
    ids = prompt_tokens(300)
    opts = dict(budget=64, kv_bits=8, kv_rotate=rotation, kv_residual=40)
    opts |= dict(compress="chunks", chunk=64)
    emptied, rebuild = [], QuantizedStore.rebuild

    def spy(store, k, *args):
        emptied.append(k.shape[2] == 0 and store.rows > store.sink_rows)
        return rebuild(store, k, *args)

    monkeypatch.setattr(QuantizedStore, "rebuild", spy)
    with veloxpatch.patched(model, "snapkv", **opts) as patch:
        caches = patch.make_cache()
        greedy(model, ids, n=8, prefill_step_size=64, prompt_cache=caches)
    assert any(emptied)
    plain = make_prompt_cache(model)  # layer 0's keys are the tokens' own
    model(ids[None], cache=plain)
    first = caches[0]
    assert first.store is not None and first.rows <= 64 + first.options.window
    keys, values = (np.array(a[0]) for a in first._view()[0].rows_dense())
    pos = np.array(first.positions_view()[0])  # [Hkv, rows], one sequence
    want_k, want_v = np.array(plain[0].keys[0]), np.array(plain[0].values[0])
    for h in range(pos.shape[0]):
        rows = np.nonzero(pos[h] < len(ids))[0]  # the prompt's (then generated)
        assert len(rows) > 0
        assert rel(keys[h, rows], want_k[h, pos[h, rows]]) < 0.02
        assert rel(values[h, rows], want_v[h, pos[h, rows]]) < 0.02


# ---- dense sinks (kv_sinks) -----------------------------------------------------
@pytest.mark.parametrize("dense", ["model", "float16"])
@pytest.mark.parametrize("keys", ["channel", "token"])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_sink_rows_stay_exact_and_attention_equals_dense_attention(heads, keys, dense):
    hq, hkv = heads
    cls = ALGORITHMS["kivi"]
    opts = dict(bits=2, residual=4, kv_rotate="hadamard", kv_keys=keys, kv_sinks=3)
    cache = cls(cls.Options(**opts, kv_dense=dense))
    # kv_dense="float16": the rows enter in fp16, and every read sees them so
    held = (lambda t: t.astype(mx.float16)) if dense == "float16" else (lambda t: t)
    total, first = 0, None
    for i, L in enumerate([20, 30, 25, 1, 1]):
        kq, kk, kv = mx.random.split(mx.random.key(7 + i), 3)
        q = mx.random.normal((1, hq, L, D), key=kq)
        k = held(mx.random.normal((1, hkv, L, D), key=kk))
        v = held(mx.random.normal((1, hkv, L, D), key=kv))
        first = (k[:, :, :3], v[:, :, :3]) if first is None else first
        dk, dv = k, v
        if total:
            dk, dv = cache._view()[0].rows_dense()
            dk, dv = mx.concatenate([dk, k], 2), mx.concatenate([dv, v], 2)
        out = cache.attend(q, k, v, rope=lambda t, offset=0: t, scale=D**-0.5)
        assert out.dtype == mx.float32
        total += L
        mask = mx.arange(total)[None] <= mx.arange(total - L, total)[:, None]
        dk, dv = dk.astype(mx.float32), dv.astype(mx.float32)
        ref = mx.fast.scaled_dot_product_attention(q, dk, dv, scale=D**-0.5, mask=mask)
        # fp16 rows: the kernels read their codes in fp32, copies round to fp16
        assert rel(out, ref) < (2e-3 if dense == "float16" else 1e-5)
    # 3 sinks, then whole groups of 32 past the residual of 4
    assert cache.store.sink_rows == 3 and cache.quantized == 3 + 2 * GROUP
    assert cache.keys.dtype == (mx.float16 if dense == "float16" else mx.float32)
    dk, dv = cache._view()[0].rows_dense()
    assert mx.array_equal(dk[:, :, :3], first[0])  # held exactly
    assert mx.array_equal(dv[:, :, :3], first[1])


def test_sinks_survive_save_trim_and_count_in_the_bytes(tmp_path):
    model = tiny_model("qwen3", head_dim=D)
    opts = dict(bits=2, residual=4, kv_rotate="hadamard", kv_sinks=2)
    ids = prompt_tokens(80)[None]
    with veloxpatch.patched(model, "kivi", **opts) as patch:
        caches = patch.make_cache()
        model(ids, cache=caches)
    no_sinks = dict(opts, kv_sinks=0)
    with veloxpatch.patched(model, "kivi", **no_sinks):
        plain = model.make_cache()
        model(ids, cache=plain)
    extra = sum(c.store.nbytes for c in caches) - sum(c.store.nbytes for c in plain)
    kv_heads, layers = caches[0].keys.shape[1], len(caches)
    # 2 dense rows of keys and values in each head, fp32, and one group fewer
    # quantized (80 - 4 = 76 rows: 2 sinks + 2 groups, against 2 groups)
    assert extra == 2 * 2 * D * 4 * kv_heads * layers
    with veloxpatch.patched(model, "kivi", **opts):
        veloxpatch.save_cache(tmp_path / "c.safetensors", caches)
        loaded = veloxpatch.load_cache(tmp_path / "c.safetensors")
        assert all(c.store.sink_rows == 2 for c in loaded)
        nxt = mx.array([[5]])
        assert mx.array_equal(model(nxt, cache=caches), model(nxt, cache=loaded))
        # trimmed into the sinks, then refilled: as if the rows were never there
        fresh = model.make_cache()
        model(ids[:, :1], cache=fresh)
        for c in loaded:
            c.trim(c.offset - 1)
        assert all(c.store.sink_rows == 1 for c in loaded)
        more = prompt_tokens(60, seed=3)[None]
        np.testing.assert_allclose(
            np.array(model(more, cache=loaded)),
            np.array(model(more, cache=fresh)),
            atol=1e-4,
        )


@pytest.mark.parametrize(
    "opts",
    [dict(kv_rotate="hadamard"), dict(kv_sinks=2), dict(kv_rotate="query")],
    ids=["rotated, one sink", "two sinks", "query-scaled, one sink"],
)
def test_trims_into_the_groups_behind_sinks_compact_to_the_rows_kept(opts):
    # trims leave holes (kv_bits.truncate_rows) until _compact regroups the rows
    # behind the sinks; each row must then be the token's own key and value
    model = tiny_model("qwen3", head_dim=D)
    pieces = [prompt_tokens(300, seed=1), prompt_tokens(20, seed=2)]
    last = prompt_tokens(5, seed=3)
    with veloxpatch.patched(model, "kivi", bits=8, residual=32, **opts) as patch:
        caches = patch.make_cache()
        model(pieces[0][None], cache=caches)
        model(mx.array([[3]]), cache=caches)
        for c in caches:
            c.trim(c.offset - 50)
        model(pieces[1][None], cache=caches)
        for c in caches:
            c.trim(c.offset - 10)
        out = model(last[None], cache=caches)
    plain = make_prompt_cache(model)  # unpatched: the exact rows of the tokens
    ref_out = model(mx.concatenate([pieces[0][:10], last])[None], cache=plain)
    sinks = caches[0].store.sink_rows
    assert sinks == opts.get("kv_sinks", 1) and caches[0].holes == 0  # compacted
    for c, p in zip(caches, plain):
        keys, values = c._view()[0].rows_dense()
        assert c.rows == 15 and c.offset == 15
        assert mx.array_equal(c.positions_view()[0, 0], mx.arange(15))
        want_k, want_v = p.keys[:, :, :15], p.values[:, :, :15]
        assert rel(keys[:, :, :sinks], want_k[:, :, :sinks]) < 1e-5  # not quantized
        assert rel(keys, want_k) < 0.02 and rel(values, want_v) < 0.02
    assert rel(out, ref_out[:, -5:]) < 0.05


@pytest.mark.parametrize(
    "algo, opts",
    [
        ("kivi", dict(bits=2, residual=8, kv_dense="float16")),
        ("snapkv", dict(budget=100, kv_bits=2, kv_residual=16, kv_dense="float16")),
    ],
)
def test_fp16_rows_leave_a_bf16_model_in_bf16(algo, opts):
    # attention over fp16 rows promotes to fp32: the output goes back to the
    # model's dtype, or every later layer computes (and stores) in fp32
    model = tiny_model("llama", head_dim=D, dtype=mx.bfloat16)
    ids = prompt_tokens(150)
    with veloxpatch.patched(model, algo, **opts) as patch:
        caches = patch.make_cache()
        outs = [
            model(ids[None, :100], cache=caches),
            model(ids[None, 100:], cache=caches),
        ]
        outs.append(model(mx.array([[4]]), cache=caches))
    assert [o.dtype for o in outs] == [mx.bfloat16] * 3
    assert caches[0].keys.dtype == mx.float16 and caches[-1].keys.dtype == mx.float16


@pytest.mark.parametrize("left", [0, 1])
def test_a_trim_into_the_sinks_after_one_into_the_groups_starts_again_cleanly(left):
    # the first trim leaves holes (a slot map); the second keeps fewer rows than
    # the sinks: only sinks (or nothing) stay, and the next rows refill them
    model = tiny_model("qwen3", head_dim=D)
    ids, more = prompt_tokens(300, seed=1), prompt_tokens(120, seed=3)
    opts = dict(bits=2, residual=32, kv_rotate="hadamard", kv_sinks=2)
    with veloxpatch.patched(model, "kivi", **opts) as patch:
        caches = patch.make_cache()
        model(ids[None], cache=caches)
        for c in caches:
            c.trim(60)
        assert caches[0].holes > 0
        for c in caches:
            c.trim(c.offset - left)
        assert caches[0].store.sink_rows == left
        out = model(more[None], cache=caches)
        nxt = model(mx.array([[5]]), cache=caches)
        fresh = model.make_cache()
        if left:
            model(ids[None, :left], cache=fresh)
        ref = model(more[None], cache=fresh)
        ref_nxt = model(mx.array([[5]]), cache=fresh)
    assert caches[0].store.sink_rows == 2
    assert rel(out, ref) < 1e-5 and rel(nxt, ref_nxt) < 1e-5


def test_sinks_default_to_one_with_a_rotation_and_none_without():
    Options = ALGORITHMS["kivi"].Options
    assert Options(kv_rotate="hadamard").kv_sinks == 1
    assert Options().kv_sinks == 0  # KIVI's own
    assert Options(kv_rotate="hadamard", kv_sinks=0).kv_sinks == 0


def test_evicting_algorithms_hold_a_dense_sink_among_the_rows_they_never_evict():
    Options = ALGORITHMS["snapkv"].Options  # (SnapKV's own sinks: 0)
    rotated = Options(kv_bits=2, kv_rotate="hadamard")
    assert rotated.kv_sinks == 1 and rotated.sinks == 1
    assert Options(kv_bits=2).kv_sinks == 0 and Options().kv_sinks == 0
    assert Options(kv_bits=2).sinks == 0
    assert Options(kv_bits=2, kv_rotate="hadamard", kv_sinks=0).sinks == 0
    assert Options(kv_bits=2, sinks=2, kv_sinks=3).sinks == 3
    assert Options(kv_bits=2, sinks=6, kv_sinks=3).sinks == 6
    with pytest.raises(OptionError, match="kv_sinks needs kv_bits"):
        Options(kv_sinks=1)


@pytest.mark.parametrize("algo", ["snapkv", "h2o"])
def test_evicted_and_compacted_rows_keep_their_sinks_exact(algo, monkeypatch):
    from veloxpatch.caches.kv_bits import QuantizedKV

    # eviction leaves holes and compaction regroups the rows behind the sinks:
    # the first rows stay the tokens' own keys and values, never quantized
    model = tiny_model("qwen3", head_dim=D)
    ids = prompt_tokens(120, seed=1)
    opts = dict(budget=40, kv_bits=2, kv_residual=4, kv_rotate="hadamard")
    compactions, real = [], QuantizedKV._compact
    spy = lambda self: compactions.append(1) or real(self)  # noqa: E731
    monkeypatch.setattr(QuantizedKV, "_compact", spy)
    with veloxpatch.patched(model, algo, **opts, kv_sinks=2) as patch:
        assert patch.options.sinks >= 2  # raised to them: never evicted
        caches = patch.make_cache()
        greedy(model, ids, n=60, prompt_cache=caches)
    assert compactions
    plain = make_prompt_cache(model)
    model(ids[None, :2], cache=plain)
    for c, p in zip(caches, plain):
        assert c.store.sink_rows == 2 and c.rows <= c.row_bound()
        assert mx.array_equal(
            c.positions_view()[..., :2],
            mx.broadcast_to(mx.arange(2), c.positions_view()[..., :2].shape),
        )
        keys, values = c._view()[0].rows_dense()
        assert rel(keys[:, :, :2], p.keys[:, :, :2]) < 1e-6
        assert rel(values[:, :, :2], p.values[:, :, :2]) < 1e-6


def test_sink_options_are_checked():
    with pytest.raises(OptionError, match="kv_sinks"):
        ALGORITHMS["kivi"].Options(kv_sinks=-1)
    with pytest.raises(OptionError, match="kv_sinks"):
        ALGORITHMS["kivi"].Options(kv_sinks=True)


def test_fp16_dense_rows_halve_the_residual_and_scale_bytes():
    model = tiny_model("llama", head_dim=D)
    ids = prompt_tokens(80)[None]
    held = {}
    for dense in ("model", "float16"):
        with veloxpatch.patched(model, "kivi", bits=2, residual=8, kv_dense=dense) as p:
            caches = p.make_cache()
            model(ids, cache=caches)
            held[dense] = caches
    for plain, half in zip(held["model"], held["float16"]):
        assert half.keys.dtype == mx.float16 and plain.keys.dtype == mx.float32
        assert half.keys.shape == plain.keys.shape  # the same rows stay dense
        assert 2 * (half.keys.nbytes + half.values.nbytes) == (
            plain.keys.nbytes + plain.values.nbytes
        )
        # the same codes; scales and biases taken from fp16 rows are fp16
        assert half.quantized == plain.quantized > 0
        assert half.store.nbytes < plain.store.nbytes


# ---- keys at their own width (key_bits / kv_key_bits) ----------------------------
@pytest.mark.parametrize("keys", ["channel", "token"])
@pytest.mark.parametrize("key_bits,bits", [(3, 2), (4, 2), (2, 4)])
def test_keys_at_their_own_width_read_as_dense_and_survive_save(key_bits, bits, keys):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(40 + key_bits), 4)
    rows_k = mx.random.normal((1, 2, 64, D), key=k1)
    values = mx.random.normal((1, 2, 64, D), key=k2)
    signs = rotation_signs(2, D, 0)
    store = QuantizedStore((bits, bits), GROUP, signs, keys, key_bits=key_bits)
    plain = {w: QuantizedStore((w, w), GROUP, signs, keys) for w in (key_bits, bits)}
    for s in (store, *plain.values()):
        s.append(rows_k, values)
    dk, dv = store.dequantize(mx.float32)
    # keys rounded as at key_bits, values as at bits: the same codes
    assert mx.array_equal(dk, plain[key_bits].dequantize(mx.float32)[0])
    assert mx.array_equal(dv, plain[bits].dequantize(mx.float32)[1])
    q = mx.random.normal((1, 2, 5, D), key=k3)
    p = mx.softmax(mx.random.normal((1, 2, 5, 64), key=k4), axis=-1)
    assert rel(store.logits(q), q @ dk.swapaxes(-1, -2)) < 1e-5
    assert rel(store.weighted(p), p @ dv) < 1e-5
    part = store.parts[0]
    assert part.kw.nbytes == plain[key_bits].parts[0].kw.nbytes
    assert part.vw.nbytes == plain[bits].parts[0].vw.nbytes
    back = QuantizedStore.from_state(store.state(), GROUP)
    assert back.key_bits == key_bits
    assert mx.array_equal(back.dequantize(mx.float32)[0], dk)
    # a store without it saves as files before it did
    assert "q.key_bits" not in plain[bits].state()


def test_key_bits_reach_the_cache_file_and_the_byte_bound(tmp_path):
    from veloxpatch.caches.kv_budget import slot_bytes

    model = tiny_model("llama", head_dim=D)
    ids = prompt_tokens(80)[None]
    held = {}
    for kb in (None, 4):
        opts = dict(bits=2, key_bits=kb, residual=8, kv_rotate="hadamard")
        with veloxpatch.patched(model, "kivi", **opts) as patch:
            caches = patch.make_cache()
            model(ids, cache=caches)
            held[kb] = caches
            if kb:
                veloxpatch.save_cache(tmp_path / "c.safetensors", caches)
                loaded = veloxpatch.load_cache(tmp_path / "c.safetensors")
                nxt = mx.array([[5]])
                assert mx.array_equal(
                    model(nxt, cache=caches), model(nxt, cache=loaded)
                )
                assert loaded[0].store.key_bits == 4
    two, wide = held[None][0].store.parts[0], held[4][0].store.parts[0]
    assert wide.kw.nbytes == 2 * two.kw.nbytes and wide.vw.nbytes == two.vw.nbytes
    Options = ALGORITHMS["kivi"].Options
    for kb in (None, 3, 4):
        o = Options(bits=2, key_bits=kb)
        assert slot_bytes(o, D, 4, True) == D * (2 + (kb or 2)) / 8 + 4 * D * 4 / 32


@pytest.mark.parametrize(
    "algo,opts,match",
    [
        ("kivi", dict(key_bits=5), "key_bits must be one of"),
        ("kivi", dict(key_bits=True), "key_bits must be one of"),
        ("kivi", dict(bits="adaptive", target_bits=3, key_bits=4), "needs bits"),
        ("snapkv", dict(kv_key_bits=4), "kv_key_bits needs kv_bits"),
        (
            "kivi",
            dict(key_bits=3, kv_qjl=True, kv_keys="token"),
            "kv_qjl sets the keys",
        ),
        ("kivi", dict(bits=4, group=32, kv_grid="mxfp4", key_bits=2), "must be 4"),
    ],
)
def test_key_bits_options_are_checked(algo, opts, match):
    with pytest.raises(OptionError, match=match):
        ALGORITHMS[algo].Options.create(algo, opts)


# ---- logit debiasing (kv_debias) --------------------------------------------------
def hadamard_matrix(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


def expected_bias(store, residual: int, qg) -> np.ndarray:
    """The bias [B, H, M, slots] kv_debias adds, from the stored steps alone:
    minus sum_c q'_c^2 step_c^2 / 24 per quantized row (q' the query as the
    store reads it: divided by the key scales, then rotated), 0 elsewhere."""
    q = np.array(qg, np.float64)
    if store.key_scale is not None:
        q = q / np.array(store.key_scale, np.float64)[:, :, None, :]
    if store.signs is not None:
        q = (q * np.array(store.signs)[None, :, None, :]) @ hadamard_matrix(D)
    part = store.parts[0]
    steps = np.array(part.ks.astype(mx.float32), np.float64)
    if part.keys == "token":  # [B, H, T, D / group] -> per row and channel
        per_row = np.repeat(steps, part.group, axis=-1)
    else:  # [B, H, D, T / group] -> [B, H, T, D]
        per_row = np.repeat(steps, part.group, axis=-1).swapaxes(-1, -2)
    noise = (q**2) @ (per_row**2).swapaxes(-1, -2) / 24.0
    B, H, M, _ = q.shape
    return np.concatenate(
        [
            np.zeros((B, H, M, store.sink_rows)),
            -noise,
            np.zeros((B, H, M, residual)),
        ],
        axis=-1,
    )


@pytest.mark.parametrize("rotation", [None, "hadamard", "query"])
@pytest.mark.parametrize("keys", ["channel", "token"])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_debiased_attention_is_dense_attention_plus_the_expected_bias(
    heads, keys, rotation
):
    # prefill pieces (the dense copy, in tiles) and decode (the kernels) alike
    hq, hkv = heads
    rep = hq // hkv
    cls = ALGORITHMS["kivi"]
    opts = dict(bits=2, residual=4, kv_rotate=rotation, kv_keys=keys, kv_sinks=2)
    cache = cls(cls.Options(**opts, kv_debias=True))
    total, checked = 0, 0
    for i, L in enumerate([20, 30, 25, 40, 1, 1]):
        kq, kk, kv = mx.random.split(mx.random.key(31 + i), 3)
        q = mx.random.normal((1, hq, L, D), key=kq)
        k = mx.random.normal((1, hkv, L, D), key=kk)
        v = mx.random.normal((1, hkv, L, D), key=kv)
        bias = None
        dk, dv = k, v
        if total:
            view = cache._view()[0]
            dk, dv = view.rows_dense()
            if cache.store is not None and cache.store.parts[0].rows:
                qg = (q * D**-0.5).reshape(1, hkv, rep * L, D)
                held = cache.keys.shape[2]
                bias = expected_bias(cache.store, held + L, qg)
                bias = bias.reshape(1, hq, L, -1)
            dk, dv = mx.concatenate([dk, k], 2), mx.concatenate([dv, v], 2)
        out = cache.attend(q, k, v, rope=lambda t, offset=0: t, scale=D**-0.5)
        total += L
        visible = mx.arange(total)[None] <= mx.arange(total - L, total)[:, None]
        mask = mx.where(visible, 0.0, -mx.inf)
        if bias is not None:
            mask = mask + mx.array(bias.astype(np.float32))
            checked += 1
        ref = mx.fast.scaled_dot_product_attention(q, dk, dv, scale=D**-0.5, mask=mask)
        assert rel(out, ref) < 1e-5
    assert checked == 4 and cache.quantized > 2


def test_debiasing_makes_the_summed_attention_weight_of_rotated_rows_unbiased():
    # sum_i exp(q . k_i) over many rows: quantized keys inflate it by the
    # logit noise (E exp(x + n) = exp(x) exp(var / 2)); the bias takes it back
    cls = ALGORITHMS["kivi"]
    n, m = 32 * 64, 64
    k = mx.random.normal((1, 1, n, D), key=mx.random.key(5))
    # logits of standard deviation 1.6 (attention's range; where one row's
    # logit dwarfs all others the sum is that row's, and no mean correction fits)
    q = 0.2 * mx.random.normal((1, 1, m, D), key=mx.random.key(6))
    exact = mx.exp(q @ k.swapaxes(-1, -2)).sum(-1)
    errors = {}
    for debias in (False, True):
        opts = cls.Options(bits=2, residual=0, kv_rotate="hadamard", kv_sinks=0)
        cache = cls(opts)
        cache.attend(q[:, :, :1], k, k, rope=lambda t, offset=0: t, scale=1.0)
        store = cache.store
        logits = store.logits(q)
        if debias:
            logits = logits + store.logit_bias(q)
        ratio = mx.exp(logits).sum(-1) / exact
        errors[debias] = abs(float(mx.log(ratio).mean()))
    assert errors[False] > 0.1  # inflated by exp(var / 2) without the bias
    assert errors[True] < errors[False] / 4


@pytest.mark.parametrize(
    "algo, opts, match",
    [
        ("kivi", dict(kv_debias="yes"), "kv_debias must be"),
        ("kivi", dict(bits=4, kv_grid="mxfp4", kv_debias=True), "affine"),
        ("kivi", dict(kv_keys="token", kv_qjl=True, kv_debias=True), "kv_qjl"),
        ("snapkv", dict(kv_debias=True), "kv_bits"),
    ],
)
def test_debias_options_are_checked(algo, opts, match):
    with pytest.raises(OptionError, match=match):
        ALGORITHMS[algo].Options(**opts)
    assert ALGORITHMS["kivi"].Options(kv_rotate="hadamard").kv_debias is False


@pytest.mark.parametrize("algo", ["h2o", "adakv", "kivi"])
def test_debiased_dense_copy_reads_as_the_kernels_over_holes_and_slots(
    algo, monkeypatch
):
    # a chunk of queries reads a dense copy (rows in row order, holes dropped;
    # per slot, masked, where Ada-KV pads heads); fewer read the kernels over
    # slots: with the bias both attend alike
    from veloxpatch.caches import qview

    model = tiny_model("qwen3", head_dim=D)
    ids = prompt_tokens(140, seed=3)
    opts = dict(kv_bits=2, kv_residual=4, budget=60) if algo != "kivi" else {}
    opts = opts or dict(bits=2, residual=4)
    with veloxpatch.patched(
        model, algo, **opts, kv_rotate="query", kv_debias=True
    ) as patch:
        caches = patch.make_cache()
        greedy(model, ids[:100], n=20, prompt_cache=caches)
        if algo == "h2o":
            assert any(c.holes > 0 for c in caches)
        if algo == "adakv":
            assert any(c.padded for c in caches)
        chunk = ids[100:110][None]
        outs = []
        for rows in (1, 10**9):  # every read dense, then every read on the kernels
            monkeypatch.setattr(qview, "CPU_DENSE_ROWS", rows)
            outs.append(model(chunk, cache=[c.clone() for c in caches]))
    assert rel(outs[0], outs[1]) < 1e-4
