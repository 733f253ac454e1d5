"""SnapKV, PyramidKV and Ada-KV: scores against the paper formulas written out
in numpy, prompt-end compression independent of chunking, budgets per layer
and per head."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import greedy
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.caches import ALGORITHMS
from veloxpatch.caches.eviction import head_budgets
from veloxpatch.caches.pyramidkv import pyramid_budgets
from veloxpatch.errors import OptionError

HQ, HKV, D = 4, 2, 8


def feed(cache, n, chunks=(17,)):
    """Stream n random tokens through a cache (identity rope), chunked, then end."""
    mx.random.seed(11)
    q = mx.random.normal((1, HQ, n, D))
    k = mx.random.normal((1, HKV, n, D)) * 2
    v = mx.random.normal((1, HKV, n, D))
    start = 0
    for L in list(chunks) + [n - sum(chunks)]:
        sl = slice(start, start + L)
        cache.attend(
            q[:, :, sl],
            k[:, :, sl],
            v[:, :, sl],
            rope=lambda t, offset=0: t,
            scale=D**-0.5,
        )
        start += L
    return np.array(q), np.array(k)


def reference_scores(q, k, w, kernel, scale=D**-0.5):
    """SnapKV by hand: window queries' softmax over the keys they can see, summed,
    max-pooled over positions with zero padding, averaged over the GQA group."""
    n = k.shape[2]
    G = HQ // HKV
    out = np.zeros((HKV, n))
    for h in range(HKV):
        per_q_head = []
        for g in range(G):
            total = np.zeros(n)
            for i in range(n - w, n):
                logits = q[0, h * G + g, i] @ k[0, h, : i + 1].T * scale
                p = np.exp(logits - logits.max())
                total[: i + 1] += p / p.sum()
            r = kernel // 2
            padded = np.pad(total, r)
            windows = np.stack([padded[j : j + n] for j in range(kernel)])
            per_q_head.append(windows.max(0))
        out[h] = np.mean(per_q_head, axis=0)
    return out


@pytest.mark.parametrize("kernel", [7, 5, 1])
def test_snapkv_scores_match_formula(kernel):
    cls = ALGORITHMS["snapkv"]
    cache = cls(cls.Options(budget=1000, window=6, kernel=kernel))
    q, k = feed(cache, 40)  # budget not reached: nothing evicted, all scored
    got = np.array(cache.scores())[0]
    np.testing.assert_allclose(got, reference_scores(q, k, 6, kernel), atol=1e-5)


def test_snapkv_keeps_top_prefix_plus_window():
    cls = ALGORITHMS["snapkv"]
    cache = cls(cls.Options(budget=12, window=4))
    q, k = feed(cache, 40)
    cache.close_prompt()
    ref = reference_scores(q, k, 4, 7)
    for h in range(HKV):
        top = sorted(np.argsort(-ref[h, :36])[:8].tolist())
        assert np.array(cache.positions_view())[0, h].tolist() == top + [36, 37, 38, 39]


def kept_and_logits(model, prompt, algo, step, **opts):
    with veloxpatch.patched(model, algo=algo, **opts) as patch:
        caches = patch.make_cache()
        toks, lp = greedy(
            model, prompt, n=6, prefill_step_size=step, prompt_cache=caches
        )
    return [np.array(c.positions_view()) for c in caches], toks, lp


@pytest.mark.parametrize("algo", ["snapkv", "pyramidkv", "adakv"])
def test_prompt_end_compression_is_independent_of_chunking(algo):
    model = tiny_model("llama")
    prompt = prompt_tokens(57)  # 56 = 1 mod 5 and mod 55: lone mid-prompt chunks
    opts = dict(budget=20, window=5)
    ref_kept, ref_toks, ref_lp = kept_and_logits(model, prompt, algo, 2048, **opts)
    assert ref_kept[0].shape[-1] < 57  # it compressed
    for step in (2, 3, 5, 55):
        kept, toks, lp = kept_and_logits(model, prompt, algo, step, **opts)
        assert all((a == b).all() for a, b in zip(kept, ref_kept)), step
        assert toks == ref_toks
        assert mx.abs(lp - ref_lp).max().item() < 1e-4  # chunked-matmul noise only


def test_pyramid_budgets_formula():
    counts = pyramid_budgets(256, 32, 30, 20.0)
    prefix = 224
    lo, hi = prefix / 20, 2 * prefix - prefix / 20
    exact = [hi - layer * (hi - lo) / 29 + 32 for layer in range(30)]
    assert sum(counts) == 256 * 30
    assert all(abs(c - e) < 1 for c, e in zip(counts, exact))
    assert counts == sorted(counts, reverse=True) and counts[0] > 2 * counts[-1]


def test_a_steep_pyramid_leaves_no_layer_under_its_protected_rows():
    # budget 16, window 4: the top layer's taper (5 rows) is under the 4 sinks
    # and the window; it keeps those, and the largest layers give the rest
    plain = pyramid_budgets(16, 4, 4, 20.0)
    rows = pyramid_budgets(16, 4, 4, 20.0, protected=8)
    assert min(plain) < 8 and min(rows) == 8 and sum(rows) == 16 * 4
    assert rows == sorted(rows, reverse=True) and rows[0] < plain[0]
    assert pyramid_budgets(256, 32, 30, 20.0, protected=36) == pyramid_budgets(
        256, 32, 30, 20.0
    )  # the defaults' pyramid never reaches its protected rows
    model = tiny_model("llama", num_hidden_layers=4)
    opts = dict(budget=16, window=4, sinks=4)
    for head_budget in ("uniform", "adaptive"):
        with veloxpatch.patched(
            model, "pyramidkv", head_budget=head_budget, **opts
        ) as patch:
            caches = patch.make_cache()
            model(prompt_tokens(60)[None], cache=caches)
            patch.end_prompt()
        top = np.array(caches[-1].positions_view()[0])
        for head in top:  # the sinks and the window's rows, in every head
            kept = set(head.tolist())
            assert {0, 1, 2, 3, 56, 57, 58, 59} <= kept
        for c, want in zip(caches, rows):  # adaptive: the heads' mean
            held = (np.array(c.positions_view()[0]) < 2**31 - 1).sum(-1)
            assert held.mean() == want


def test_pyramidkv_layers_hold_different_rows():
    model = tiny_model("llama", num_hidden_layers=4)
    with veloxpatch.patched(model, algo="pyramidkv", budget=20, window=4) as patch:
        caches = patch.make_cache()
        model(prompt_tokens(60)[None], cache=caches)
        patch.end_prompt()
    rows = [c.rows for c in caches]
    assert rows == pyramid_budgets(20, 4, 4, 20.0) and len(set(rows)) == 4
    assert sum(rows) == 20 * 4
    window_queries = 4 * 4 * 16 * 4  # 4 query heads x window x D, float32
    per_row = (caches[0].nbytes - window_queries) // rows[0]
    assert sum(c.nbytes - window_queries for c in caches) == 20 * 4 * per_row


def test_head_budgets_formula():
    rng = np.random.default_rng(0)
    scores = rng.random((1, 3, 50)) ** np.array([1, 4, 12])[None, :, None]
    got = np.array(head_budgets(mx.array(scores, dtype=mx.float32), 10, 0.2))[0]
    flat = scores[0].reshape(-1)
    top = np.argsort(-flat)[:30] // 50
    c = np.bincount(top, minlength=3)
    exact = c * 0.8 + 0.2 * 10
    assert got.sum() == 30 and (np.abs(got - exact) < 1).all()
    assert len(set(got.tolist())) > 1


def test_adakv_heads_differ_and_layer_total_is_budget():
    model = tiny_model("llama")
    with veloxpatch.patched(model, algo="adakv", budget=20, window=4) as patch:
        caches = patch.make_cache()
        model(prompt_tokens(80)[None], cache=caches)
        patch.end_prompt()
    for c in caches:
        pos = np.array(c.positions_view())[0]
        real = (pos < 2**31 - 1).sum(-1)
        assert real.sum() == 20 * HKV
        assert c.rows == real.max()  # padded to the largest head
        window_queries = 4 * 4 * 16 * 4  # 4 query heads x window x D, float32
        assert c.nbytes == c.rows * HKV * (2 * 16 * 4 + 4) + window_queries
    assert any(
        len(set((np.array(c.positions_view())[0] < 2**31 - 1).sum(-1))) > 1
        for c in caches
    )


@pytest.mark.parametrize(
    "opts,match",
    [
        (dict(budget=32, window=32), "budget"),
        (dict(kernel=4), "odd"),
        (dict(kernel=0), "kernel"),
        (dict(window=0), "window"),
    ],
)
def test_snapkv_options_validated(opts, match):
    with pytest.raises(OptionError, match=match):
        ALGORITHMS["snapkv"].Options.create("snapkv", opts)
    with pytest.raises(OptionError, match="alpha"):
        ALGORITHMS["adakv"].Options.create("adakv", {"alpha": 1.5})
    with pytest.raises(OptionError, match="beta"):
        ALGORITHMS["pyramidkv"].Options.create("pyramidkv", {"beta": 0.5})
