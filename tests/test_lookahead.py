"""`lookahead=k` for the SnapKV family: the prompt-end compression waits for k
answer tokens and scores with the prompt window plus the answer-time queries."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import greedy
from test_snapkv import HKV, HQ, D
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.caches import ALGORITHMS
from veloxpatch.caches.base import PAD_POSITION
from veloxpatch.errors import OptionError

GOLDEN = Path(__file__).parent / "data" / "snapkv_family_lookahead0.npz"


def stream(cache, prompt, answer, seed=5):
    """A prompt in two chunks, the prompt end, then `answer` single-token calls
    (identity rope). Returns q, k as numpy and the row counts after each call."""
    n = prompt + answer
    mx.random.seed(seed)
    q = mx.random.normal((1, HQ, n, D))
    k = mx.random.normal((1, HKV, n, D)) * 2
    v = mx.random.normal((1, HKV, n, D))
    rows = []

    def call(sl):
        cache.attend(
            q[:, :, sl],
            k[:, :, sl],
            v[:, :, sl],
            rope=lambda t, offset=0: t,
            scale=D**-0.5,
        )
        rows.append(cache.rows)

    call(slice(0, 11))
    call(slice(11, prompt))
    cache.close_prompt()
    for t in range(prompt, n):
        call(slice(t, t + 1))
    return np.array(q), np.array(k), rows


def window_scores(q, k, first, last, kernel=7):
    """SnapKV by hand over queries first..last-1 (prompt and answer queries
    alike). Max pooling, mean over the GQA group."""
    G = HQ // HKV
    n = last
    out = np.zeros((HKV, n))
    for h in range(HKV):
        acc = []
        for g in range(G):
            total = np.zeros(n)
            for i in range(first, last):
                logits = q[0, h * G + g, i] @ k[0, h, : i + 1].T * D**-0.5
                p = np.exp(logits - logits.max())
                total[: i + 1] += p / p.sum()
            padded = np.pad(total, kernel // 2)
            acc.append(np.stack([padded[j : j + n] for j in range(kernel)]).max(0))
        out[h] = np.mean(acc, axis=0)
    return out


def test_lookahead_scores_prompt_window_and_answer_queries():
    cls = ALGORITHMS["snapkv"]
    w, k_ahead, prompt = 4, 3, 40
    opts = dict(budget=16, window=w, lookahead=k_ahead)
    cache = cls(cls.Options(kernel=1, **opts))  # no pooling: no tied scores
    q, k, rows = stream(cache, prompt, k_ahead + 1)
    # The whole prompt is held through the first k answer tokens, then `budget`.
    assert rows[:2] == [11, 40]
    assert rows[2:] == [41, 42, 16, 17]
    end = prompt + k_ahead
    ref = window_scores(q, k, prompt - w, end, kernel=1)
    kept = np.array(cache.positions_view())[0]
    for h in range(HKV):
        # top (budget - window - lookahead) of the prefix, then the protected tail
        top = sorted(np.argsort(-ref[h, : end - w - k_ahead])[:9].tolist())
        assert kept[h].tolist() == top + list(range(end - w - k_ahead, end)) + [end]


@pytest.mark.parametrize("algo", ["snapkv", "pyramidkv", "adakv"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lookahead_zero_reproduces_prompt_end_compression(arch, algo):
    # Kept sets and logits recorded before `lookahead` existed (same run).
    golden = np.load(GOLDEN)
    model = tiny_model(arch)
    with veloxpatch.patched(
        model, algo=algo, budget=20, window=5, lookahead=0
    ) as patch:
        caches = patch.make_cache()
        toks, lp = greedy(
            model, prompt_tokens(57), n=12, prefill_step_size=7, prompt_cache=caches
        )
    for i, c in enumerate(caches):
        assert (np.array(c.positions_view()) == golden[f"{arch}/{algo}/kept{i}"]).all()
    assert toks == golden[f"{arch}/{algo}/tokens"].tolist()
    np.testing.assert_allclose(
        np.array(lp), golden[f"{arch}/{algo}/logprobs"], atol=1e-4
    )


def kept_per_head(caches):
    """Real (unpadded) rows summed over layers, per KV head."""
    pos = [np.array(c.positions_view()) for c in caches]
    return sum(int((p != PAD_POSITION).sum()) // p.shape[1] for p in pos)


@pytest.mark.parametrize("algo", ["snapkv", "pyramidkv", "adakv"])
def test_each_turn_waits_for_its_own_lookahead(algo):
    model = tiny_model("llama")
    with veloxpatch.patched(model, algo=algo, budget=24, window=4, lookahead=5) as p:
        caches = p.make_cache()
        total = 24 * len(caches)
        model(prompt_tokens(40)[None], cache=caches)
        p.end_prompt()
        held = []
        for t in range(6):
            model(mx.array([[7 + t]]), cache=caches)
            held.append(kept_per_head(caches))
        # Four answer tokens with the whole prompt, the fifth compresses.
        assert held[:4] == [(41 + t) * len(caches) for t in range(4)]
        assert held[4] == total and held[5] == total + len(caches)
        model(prompt_tokens(30)[None], cache=caches)  # a new user turn
        p.end_prompt()
        for t in range(5):
            model(mx.array([[3 + t]]), cache=caches)
            if t < 4:
                assert kept_per_head(caches) > total  # waiting again
        assert kept_per_head(caches) == total
        assert all(c.offset == 40 + 6 + 30 + 5 for c in caches)


def test_lookahead_through_generate_step():
    # mlx-lm's own loop: the prompt end is detected, then k steps, then compress.
    model = tiny_model("qwen3")
    with veloxpatch.patched(model, algo="adakv", budget=20, window=4, lookahead=3) as p:
        caches = p.make_cache()
        # generate_step runs one step ahead: two tokens yielded, two attended
        greedy(model, prompt_tokens(45), n=2, prefill_step_size=8, prompt_cache=caches)
        assert all(c.offset == c.rows == 47 and c.lookahead_left == 1 for c in caches)
        model(mx.array([[9]]), cache=caches)
    assert all(c.lookahead_left == 0 and c.rows < 47 for c in caches)


@pytest.mark.parametrize(
    "opts,match",
    [
        (dict(lookahead=-1), "lookahead"),
        (dict(lookahead=2.5), "lookahead"),
        (dict(budget=64, lookahead=17), "budget / 4"),
        (dict(budget=40, window=32, lookahead=8), "budget"),
    ],
)
def test_lookahead_options_validated(opts, match):
    for algo in ("snapkv", "pyramidkv", "adakv"):
        with pytest.raises(OptionError, match=match):
            ALGORITHMS[algo].Options.create(algo, opts)
