"""Keys mapped to the queries' and keys' joint basis (`kv_rotate="query_basis"`,
quantized.py): the map balances the keys' spread and the queries' weight, so
its logit error bound is below channel scaling's; the stored inverse undoes
it; attention over the store equals dense attention over its dequantized rows;
it cuts the logit error of queries from the moment it was set from; it is set
once from the prompt, saved and counted in nbytes (the byte bound:
test_kv_budget.py)."""

import mlx.core as mx
import pytest
from helpers import rel
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.caches.quantized import (
    QuantizedStore,
    key_basis,
    key_map,
    key_scales,
    rotation_signs,
    unpack_unmap,
)

D, GROUP = 64, 32


def correlated(n, seed, rank=8, n_heads=2):
    """Rows [1, H, n, D] spread along a few directions plus a little noise
    (as keys and queries are), and their direction matrix."""
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    dirs = mx.random.normal((1, n_heads, rank, D), key=k1)
    z = mx.random.normal((1, n_heads, n, rank), key=k2)
    return z @ dirs + 0.05 * mx.random.normal((1, n_heads, n, D), key=k3)


def second_moment(x):
    return x.swapaxes(-1, -2) @ x / x.shape[2]


def spread(k):
    """The keys' spread within their groups, as key_basis reads it."""
    B, H, n, _ = k.shape
    g = k.reshape(B, H, n // GROUP, GROUP, D)
    dev = (g - g.mean(3, keepdims=True)).reshape(B, H, n, D)
    return second_moment(dev)


def bound(a, c, h):
    """tr(A C A^T) tr(A^-T H A^-1): the logit error's scale after rotation."""
    ai = mx.linalg.inv(a, stream=mx.cpu)
    first = mx.trace(a @ c @ a.swapaxes(-1, -2), axis1=-2, axis2=-1)
    return first * mx.trace(ai.swapaxes(-1, -2) @ h @ ai, axis1=-2, axis2=-1)


def test_the_basis_bound_is_below_channel_scalings_and_its_inverse_undoes_it():
    keys, queries = correlated(4 * GROUP, 1), correlated(256, 2)
    h = second_moment(queries)
    codes, step = key_basis(h, keys, GROUP)
    assert codes.dtype == mx.int8 and step.shape == (1, 2, 1, D)
    eye = mx.eye(D)
    unmap = unpack_unmap(codes, step)
    a = key_map(unmap).swapaxes(-1, -2)  # A, from A^-1 as stored
    assert rel(a @ unmap, eye) < 1e-4
    c = spread(keys)
    power = mx.diagonal(h, axis1=-2, axis2=-1)
    scaled = bound(mx.eye(D) * key_scales(power, keys, GROUP)[..., None, :], c, h)
    mapped = bound(a, c, h)
    assert (mapped < 0.8 * scaled).all()
    assert (scaled <= bound(mx.broadcast_to(eye, c.shape), c, h) * 1.0001).all()
    # no queries seen: the identity
    m = unpack_unmap(*key_basis(None, keys, GROUP))
    assert mx.array_equal(m, mx.broadcast_to(eye, m.shape))


def test_the_basis_does_not_hang_on_the_signs_eigh_returns(monkeypatch):
    """An eigenvector's sign is LAPACK's choice: float rounding alone (a
    replayed prefill against a direct one) flipped one in 3 of SmolLM2's 90
    layer-heads on a passkey case, and the Hadamard rotation after the map
    turns a flipped coordinate into other rounding. The basis fixes each
    sign itself, so flipped eigenvectors give the same stored A^-1."""
    keys, queries = correlated(4 * GROUP, 3), correlated(256, 4)
    h = second_moment(queries)
    codes, step = key_basis(h, keys, GROUP)
    eigh = mx.linalg.eigh
    flips = mx.where(mx.arange(D) % 3 == 0, -1.0, 1.0)

    def flipped(a, **kw):
        w, v = eigh(a, **kw)
        return w, v * flips

    monkeypatch.setattr(mx.linalg, "eigh", flipped)
    other, other_step = key_basis(h, keys, GROUP)
    assert mx.array_equal(other, codes) and mx.array_equal(other_step, step)


@pytest.mark.parametrize("rounds", [False, True])
def test_store_reads_equal_dense_reads_of_its_dequantized_rows(rounds):
    k1, k2, k3 = mx.random.split(mx.random.key(7), 3)
    keys, values = correlated(64, 3), mx.random.normal((1, 2, 64, D), key=k1)
    store = QuantizedStore((2, 2), GROUP, rotation_signs(2, D, 0), basis=True)
    store.rounds, store.query_moment = rounds, second_moment(correlated(128, 4))
    store.append(keys, values)
    assert store.key_unmap.dtype == mx.int8
    assert (store.key_factor is not None) == rounds
    dk, dv = store.dequantize(mx.float32)
    q = mx.random.normal((1, 2, 5, D), key=k2)
    p = mx.softmax(mx.random.normal((1, 2, 5, 64), key=k3), axis=-1)
    assert rel(store.logits(q), q @ dk.swapaxes(-1, -2)) < 1e-5
    assert rel(store.weighted(p), p @ dv) < 1e-5


@pytest.mark.parametrize("bits", [2, 3])
def test_the_basis_cuts_the_logit_error_of_the_queries_it_weighs(bits):
    keys, queries = correlated(4 * GROUP, 5), correlated(512, 6)
    h = second_moment(queries)
    err = {}
    for mode in ("scale", "basis"):
        store = QuantizedStore(
            (bits, bits),
            GROUP,
            rotation_signs(2, D, 0),
            query_aware=mode == "scale",
            basis=mode == "basis",
        )
        store.query_power = mx.diagonal(h, axis1=-2, axis2=-1)
        store.query_moment = h
        store.append(keys, keys)
        ref = queries @ keys.swapaxes(-1, -2)
        err[mode] = float(mx.sqrt(((store.logits(queries) - ref) ** 2).mean()))
    assert err["basis"] < 0.9 * err["scale"]  # 0.68-0.85 over seeds at 2 bits


OPTS = dict(bits=2, residual=4, group=32, kv_rotate="query_basis")


@pytest.mark.parametrize("rounds", ["nearest", "query"])
def test_the_basis_is_set_once_from_the_prompt_saved_and_counted(tmp_path, rounds):
    model = tiny_model("llama", head_dim=D)
    with veloxpatch.patched(model, "kivi", **OPTS, kv_round=rounds) as patch:
        caches = patch.make_cache()
        model(prompt_tokens(20)[None], cache=caches)
        # nothing quantized yet (the sink only): the sums survive a file
        assert caches[0].store.key_unmap is None and caches[0].query_m2_count > 0
        veloxpatch.save_cache(tmp_path / "early.safetensors", caches)
        early = veloxpatch.load_cache(tmp_path / "early.safetensors")
        more = prompt_tokens(60, seed=3)[None]
        out, ref = model(more, cache=early), model(more, cache=caches)
        assert mx.array_equal(out, ref)
        for a, b in zip(caches, early):
            assert a.query_m2 is None and a.store.key_unmap is not None
            assert mx.array_equal(a.store.key_unmap, b.store.key_unmap)
            assert mx.array_equal(a.store.unmap_step, b.store.unmap_step)
            assert (a.store.key_factor is not None) == (rounds == "query")
        veloxpatch.save_cache(tmp_path / "late.safetensors", caches)
        late = veloxpatch.load_cache(tmp_path / "late.safetensors")
        step = prompt_tokens(40, seed=4)[None]
        out, ref = model(step, cache=late), model(step, cache=caches)
        assert mx.array_equal(out, ref)
        assert mx.array_equal(late[0].store.key_unmap, caches[0].store.key_unmap)
        store = caches[0].store
        held = sum(a.nbytes for a in store.arrays())
        assert held >= store.key_unmap.nbytes + store.unmap_step.nbytes
        assert caches[0].nbytes >= held
        # a file from before the 8-bit basis (A^T and A^-1 in fp16) reads back:
        # its rows answer as they did, new keys are mapped by its A^-1
        st = store.state()
        unmap = unpack_unmap(st["q.key_unmap"], st.pop("q.unmap_step"))
        st["q.key_unmap"] = unmap.astype(mx.float16)
        st["q.key_map"] = key_map(unmap).astype(mx.float16)
        old = QuantizedStore.from_state(st, 32, sinks=1, basis=True)
        q = mx.random.normal((1, caches[0].keys.shape[1], 3, D), key=mx.random.key(5))
        assert rel(old.logits(q), store.logits(q)) < 2e-3
        assert "q.unmap_step" not in old.state() and "q.key_map" not in old.state()
        k = mx.random.normal((1, q.shape[1], 32, D), key=mx.random.key(6))
        old.append(k, k)
        dk, _ = old.dequantize(mx.float32)
        assert rel(old.logits(q), q @ dk.swapaxes(-1, -2)) < 1e-4
