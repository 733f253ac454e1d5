"""H2O, TOVA and Keyformer: the attention they accumulate, checked against the
paper formulas written out in numpy."""

import mlx.core as mx
import numpy as np
import pytest

from veloxpatch.caches import ALGORITHMS
from veloxpatch.errors import OptionError

HQ, HKV, D, N = 4, 2, 8, 40
G = HQ // HKV
mx.random.seed(5)
Q = mx.random.normal((1, HQ, N, D))
K = mx.random.normal((1, HKV, N, D)) * 2
V = mx.random.normal((1, HKV, N, D))


def feed(cache, chunks):
    start = 0
    for L in list(chunks) + [1] * (N - sum(chunks)):
        sl = slice(start, start + L)
        out = cache.attend(
            Q[:, :, sl],
            K[:, :, sl],
            V[:, :, sl],
            rope=lambda t, offset=0: t,
            scale=D**-0.5,
        )
        mx.eval(out)
        start += L
    return cache


def probs_np():
    """[HQ, N, N] causal softmax attention of every query."""
    q, k = np.array(Q[0]), np.array(K[0])
    out = np.zeros((HQ, N, N))
    for hq in range(HQ):
        for i in range(N):
            logits = q[hq, i] @ k[hq // G, : i + 1].T * D**-0.5
            p = np.exp(logits - logits.max())
            out[hq, i, : i + 1] = p / p.sum()
    return out


def kept(cache):
    return np.array(cache.positions_view())[0]


@pytest.mark.parametrize("tile", [None, 1, 3 * HQ * N], ids=["one", "1q", "3q"])
def test_h2o_accumulates_every_query_mean_over_group(tile, monkeypatch):
    # the probabilities are taken in tiles of queries (elements of logits)
    from veloxpatch.caches import attention_math

    if tile is not None:
        monkeypatch.setattr(attention_math, "TILE_ELEMENTS", tile)
    cls = ALGORITHMS["h2o"]
    cache = feed(cls(cls.Options(budget=1000)), [13, 9])
    p = probs_np()
    ref = np.stack([p[h * G : (h + 1) * G].mean(0).sum(0) for h in range(HKV)])
    np.testing.assert_allclose(np.array(cache.acc)[0], ref, atol=1e-5)


def test_h2o_keeps_heavy_recent_and_sinks():
    cls = ALGORITHMS["h2o"]
    cache = feed(cls(cls.Options(budget=N - 1, sinks=2, recent=5)), [N - 1])
    # One decode step over budget: the row with the least accumulated attention
    # outside sinks and the recent window goes.
    p = probs_np()
    for h in range(HKV):
        acc = p[h * G : (h + 1) * G].mean(0).sum(0)
        candidates = np.arange(2, N - 5)
        drop = candidates[np.argmin(acc[candidates])]
        assert kept(cache)[h].tolist() == [t for t in range(N) if t != drop]


def test_tova_drops_least_attended_by_last_query_mean_over_all_heads():
    cls = ALGORITHMS["tova"]
    cache = feed(cls(cls.Options(budget=16, sinks=2)), [N])
    p = probs_np()
    score = p[:, N - 1].mean(0)  # all query heads, last query
    top = sorted((np.argsort(-score[2:])[:14] + 2).tolist())
    for h in range(HKV):
        assert kept(cache)[h].tolist() == [0, 1] + top  # every head the same


def test_keyformer_tau_schedule_and_seeded_noise(monkeypatch):
    from veloxpatch.caches import attention_math

    cls = ALGORITHMS["keyformer"]
    opts = dict(budget=12, sinks=1, recent=3, tau_steps=10)
    a = feed(cls(cls.Options(**opts)), [20])
    b = feed(cls(cls.Options(**opts)), [20])
    c = feed(cls(cls.Options(seed=1, **opts)), [20])
    assert (kept(a) == kept(b)).all()
    assert a.decode_steps == N - 20 and a.tau() == 2.0
    # prompt tiles of one query keep the prompt's temperature
    monkeypatch.setattr(attention_math, "TILE_ELEMENTS", 1)
    d = feed(cls(cls.Options(**opts)), [20])
    assert d.decode_steps == N - 20 and d.calls == 20 + N - 20
    fresh = cls(cls.Options(**opts))
    fresh.decode_steps = 5
    assert fresh.tau() == pytest.approx(1.5)
    assert not (kept(a) == kept(c)).all() or not np.allclose(
        np.array(a.acc), np.array(c.acc)
    )


def test_keyformer_weights_are_tempered_gumbel_softmax():
    cls = ALGORITHMS["keyformer"]
    cache = cls(cls.Options(budget=50, tau_init=1.5))
    logits = mx.random.normal((1, HKV, G, 3, 7))
    got = cache.weights(logits, None)
    key = mx.random.key(0)
    noise = mx.random.gumbel(logits.shape, key=key)
    ref = mx.softmax((logits + noise) / 1.5, axis=-1)
    assert mx.allclose(got, ref).item()


@pytest.mark.parametrize(
    "algo,opts,match",
    [
        ("h2o", dict(budget=10, sinks=4, recent=6), "budget"),
        ("h2o", dict(recent=-1), "recent"),
        ("keyformer", dict(tau_init=0), "tau_init"),
        ("keyformer", dict(tau_steps=0), "tau_steps"),
        ("tova", dict(budget=4, sinks=4), "budget"),
    ],
)
def test_options_validated(algo, opts, match):
    with pytest.raises(OptionError, match=match):
        ALGORITHMS[algo].Options.create(algo, opts)


def test_softmax_is_mlx_softmax_with_masked_and_empty_rows():
    # attention_math.softmax goes through numpy on the CPU (mlx's exp is slow
    # there): the same probabilities as mlx's, -inf entries 0, a row with
    # nothing visible NaN as in mlx, large logits without overflow
    from veloxpatch.caches.attention_math import softmax

    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 3, 6, 50)).astype(np.float32) * 30
    x[rng.uniform(size=x.shape) < 0.4] = -np.inf
    x[0, 1, 2] = -np.inf
    got = np.array(softmax(mx.array(x)))
    want = np.array(mx.softmax(mx.array(x), axis=-1))
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[0, 1, 2]).all()
    assert (got[np.isneginf(x) & ~np.isnan(got)] == 0).all()
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), atol=1e-6)
    assert softmax(mx.array(x)).dtype == mx.float32


@pytest.mark.parametrize("mask", ["causal", "array", "function", None])
def test_fused_attention_in_tiles_equals_one_call(mask, monkeypatch):
    # a long call on the CPU attends in chained tiles of queries: the output is
    # the untiled kernel's, a causal tile reads only the rows it can see
    from veloxpatch.caches import attention_math

    rng = np.random.default_rng(5)
    B, Hq, Hkv, L, S, D = 1, 6, 2, 37, 50, 16
    q = mx.array(rng.normal(size=(B, Hq, L, D)).astype(np.float32))
    k = mx.array(rng.normal(size=(B, Hkv, S, D)).astype(np.float32))
    v = mx.array(rng.normal(size=(B, Hkv, S, D)).astype(np.float32))
    m = mask
    if mask in ("array", "function"):
        m = mx.array(rng.uniform(size=(B, Hq, L, S)) < 0.7)
    sdpa = mx.fast.scaled_dot_product_attention
    want = sdpa(q, k, v, scale=0.25, mask=m)
    if mask == "function":  # built per tile, for the queries first..stop
        whole = m

        def m(first, stop):
            return whole[:, :, first:stop]

    calls = []

    def spy(q, k, v, *, scale, mask=None):
        calls.append((q.shape[2], k.shape[2]))
        return sdpa(q, k, v, scale=scale, mask=mask)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(attention_math, "FUSED_TILE_ELEMENTS", Hq * S * 8)  # 8 q
    got = attention_math.fused_attention(q, k, v, 0.25, m)
    assert [n for n, _ in calls] == [8, 8, 8, 8, 5]
    if mask == "causal":
        assert [s for _, s in calls] == [S - L + b for b in (8, 16, 24, 32, 37)]
    assert mx.abs(got - want).max().item() <= 1e-5 * mx.abs(want).max().item()
