"""Expected Attention: the mean rotation against explicit per-position
rotations, scores against the paper's formula written out in numpy on the
queries, keys and values a tiny model really produced (captured through the
probe seam), what the prompt-end compression keeps, and its independence of
the prefill chunking."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import greedy
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.caches.expected_attention import mean_rotation
from veloxpatch.errors import OptionError
from veloxpatch.probe import run_probe

ALGO = "expected_attention"


def explicit_rotation(rope, t: int, dim: int) -> np.ndarray:
    """R_t [dim, dim] by rotating each basis vector alone at position t."""
    eye = mx.eye(dim, dtype=mx.float32)[:, None, None, :]  # dim vectors, 1 position
    return np.array(rope(eye, offset=t))[:, 0, 0, :].T.astype(np.float64)


def test_mean_rotation_of_plain_rope_is_the_mean_of_its_rotation_matrices():
    D, base, T, n = 16, 10000.0, 37, 300  # n spans more than one rope chunk
    theta = base ** (-np.arange(D // 2) * 2 / D)
    mean = np.zeros((D, D))
    for t in range(T, T + n):  # non-traditional: planes (i, i + D/2)
        c, s = np.cos(t * theta), np.sin(t * theta)
        R = np.zeros((D, D))
        i = np.arange(D // 2)
        R[i, i], R[i, i + D // 2] = c, -s
        R[i + D // 2, i], R[i + D // 2, i + D // 2] = s, c
        mean += R / n
    got = np.array(mean_rotation(nn.RoPE(D, base=base), T, n, D))
    np.testing.assert_allclose(got, mean, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "ministral3"])
def test_mean_rotation_of_a_model_rope_averages_its_positions(arch):
    """llama3-scaled, plain and YaRN (which also rescales) ropes of tiny models:
    R-bar x is the mean of rope(x) over the positions, and R-bar the mean of the
    explicit per-position matrices."""
    attn = tiny_model(arch).layers[0].self_attn
    D = attn.q_proj.weight.shape[0] // attn.n_heads
    T, n = 50, 260
    R = np.array(mean_rotation(attn.rope, T, n, D)).astype(np.float64)
    explicit = sum(explicit_rotation(attn.rope, t, D) for t in range(T, T + n)) / n
    np.testing.assert_allclose(R, explicit, atol=1e-5)
    x = mx.random.normal((1, 1, 1, D), key=mx.random.key(3))
    rotated = [np.array(attn.rope(x, offset=t))[0, 0, 0] for t in range(T, T + n)]
    np.testing.assert_allclose(R @ np.array(x)[0, 0, 0], np.mean(rotated, 0), atol=1e-5)


def capture(model, ids, chunk, **opts):
    """Run `ids` through the patched model in calls of `chunk` tokens; returns
    the caches and, per layer, what the attention calls saw."""
    seen = {}

    def probe(s):
        qs = 1.0 if s.query_scale is None else np.array(s.query_scale)
        seen.setdefault(s.layer, []).append(
            dict(
                q=np.array(s.q_pre[0]) * qs,
                k=np.array(s.k[0]),
                v=np.array(s.v[0]),
                rope=s.rope,
                scale=s.scale,
            )
        )

    with veloxpatch.patched(model, ALGO, **opts):
        caches = run_probe(model, ids, probe, chunk=chunk)
    return caches, seen


def reference_scores(calls, sinks: int, n_future: int) -> np.ndarray:
    """The paper's score in float64, from the captured calls of one layer."""
    q = np.concatenate([c["q"] for c in calls], axis=1).astype(np.float64)
    k = np.concatenate([c["k"] for c in calls], axis=1).astype(np.float64)
    v = np.concatenate([c["v"] for c in calls], axis=1).astype(np.float64)
    Hq, T, D = q.shape
    Hkv = k.shape[0]
    G = Hq // Hkv
    s = calls[0]["scale"]
    rope = calls[0]["rope"]
    R = sum(explicit_rotation(rope, t, D) for t in range(T, T + n_future)) / n_future
    out = np.zeros((Hkv, T - sinks))
    for h in range(Hq):
        x = q[h, sinks:]
        mu = x.mean(0)
        cov = np.cov(x.T, bias=True)  # population covariance, as the paper
        mu_bar, cov_bar = R @ mu, R @ cov @ R.T
        keys = k[h // G, sinks:]
        logits = s * keys @ mu_bar + s * s / 2 * np.einsum(
            "ti,ij,tj->t", keys, cov_bar, keys
        )
        p = np.exp(logits - logits.max())
        out[h // G] += p / p.sum() / G
    return out * np.linalg.norm(v[:, sinks:], axis=-1)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "ministral3"])
def test_scores_match_the_formula_on_real_queries(arch):
    model = tiny_model(arch)
    ids = prompt_tokens(45).tolist()
    sinks, n_future = 3, 40
    caches, seen = capture(model, ids, 13, budget=500, sinks=sinks, n_future=n_future)
    for layer, cache in enumerate(caches):
        assert cache.rows == 45  # nothing evicted: every row scored
        got = np.array(cache.scores())[0]
        ref = reference_scores(seen[layer], sinks, n_future)
        np.testing.assert_allclose(got[:, sinks:], ref, rtol=2e-4, atol=1e-7)
    if arch == "ministral3":  # the query scale is really in the statistics
        scales = _query_scales(seen, model)
        plain = [dict(c, q=c["q"] / s) for c, s in zip(seen[0], scales)]
        assert not np.allclose(
            reference_scores(plain, sinks, n_future),
            reference_scores(seen[0], sinks, n_future),
        )


def _query_scales(seen, model):
    """Ministral 3's attn_scale of each captured call of layer 0."""
    from mlx_lm.models.ministral3 import _get_llama_4_attn_scale

    attn = model.layers[0].self_attn
    out, offset = [], 0
    for c in seen[0]:
        L = c["q"].shape[1]
        scale = _get_llama_4_attn_scale(
            L, offset, attn.scaling_beta, attn.original_max_position_embeddings
        )
        out.append(np.array(scale)[None])  # [1, L, 1] against [Hq, L, D]
        offset += L
    return out


def test_prompt_end_keeps_sinks_window_and_the_best_scored_rest():
    model = tiny_model("llama")
    ids = prompt_tokens(50).tolist()
    opts = dict(sinks=2, window=5, n_future=64)
    _, seen = capture(model, ids, 50, budget=500, **opts)
    with veloxpatch.patched(model, ALGO, budget=20, **opts) as patch:
        caches = patch.make_cache()
        model(mx.array(ids)[None], cache=caches)
        patch.end_prompt(caches)
    for layer, cache in enumerate(caches):
        ref = reference_scores(seen[layer], 2, 64)[:, : 50 - 2 - 5]  # scored rest
        kept = np.array(cache.positions_view())[0]
        for h in range(kept.shape[0]):
            best = sorted((np.argsort(-ref[h])[:13] + 2).tolist())
            assert kept[h].tolist() == [0, 1] + best + list(range(45, 50))


def test_compression_is_independent_of_chunking_and_memory_is_bounded():
    model = tiny_model("qwen3")
    prompt = prompt_tokens(57)  # 56 = 1 mod 5 and mod 55: lone mid-prompt chunks
    opts = dict(budget=20, window=4, n_future=32)

    def run(step):
        with veloxpatch.patched(model, ALGO, **opts) as patch:
            caches = patch.make_cache()
            toks, lp = greedy(
                model, prompt, n=12, prefill_step_size=step, prompt_cache=caches
            )
        return [np.array(c.positions_view()) for c in caches], toks, lp, caches

    ref_kept, ref_toks, ref_lp, caches = run(2048)
    for c in caches:  # decode recompressed within budget + window
        assert c.rows <= 24 and c.compressed_rows == 20
        hq, d = c.q_mean.shape[1:]
        rows_bytes = c.rows * 2 * (2 * d * 4 + 4)  # K, V fp32 + int32 positions
        assert c.nbytes == rows_bytes + hq * (d + d * d) * 4  # O(D^2) statistics
    for step in (2, 5, 55):
        kept, toks, lp, _ = run(step)
        assert all((a == b).all() for a, b in zip(kept, ref_kept)), step
        assert toks == ref_toks
        assert mx.abs(lp - ref_lp).max().item() < 1e-4


@pytest.mark.parametrize(
    "opts,match",
    [
        (dict(n_future=0), "n_future"),
        (dict(n_future=1 << 20), "n_future"),
        (dict(window=-1), "window"),
        (dict(budget=20, sinks=4, window=16), "budget"),
    ],
)
def test_options_validated(opts, match):
    with pytest.raises(OptionError, match=match):
        veloxpatch.api.algorithm(ALGO).Options.create(ALGO, opts)
