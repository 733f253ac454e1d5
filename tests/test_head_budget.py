"""`head_budget="adaptive"` (Ada-KV's allocation) on every scoring algorithm:
the layer's rows sum to budget x KV heads with every head at or above its floor,
the masked-dense oracle and bounded bytes with padded heads, save/load, and
what it changes for scorers that give every head the same scores (nothing)."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import greedy, max_abs
from oracle import oracle_logits, run_patched
from test_contract import CHUNKS, CONTRACT, HEAD_DIM, QUANTIZED, N
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.caches import ALGORITHMS
from veloxpatch.caches.base import PAD_POSITION
from veloxpatch.caches.eviction import head_budgets
from veloxpatch.errors import OptionError

ADAPTIVE = dict(head_budget="adaptive")
# every algorithm that evicts by scores that differ between heads
SCORERS = ["knorm", "snapkv", "pyramidkv", "h2o", "keyformer", "qfilters"]
SCORERS += ["expected_attention"]


def real_rows(cache) -> np.ndarray:
    """Rows each (batch item, KV head) really holds, padding left out."""
    return (np.array(cache.positions_view()) != PAD_POSITION).sum(-1)


def test_allocation_sums_to_the_layer_budget_and_respects_the_floor():
    rng = np.random.default_rng(0)
    for trial in range(30):
        H, T = rng.integers(2, 6), rng.integers(20, 60)
        prefix, alpha = int(rng.integers(1, T // 2)), float(rng.choice([0, 0.2, 0.7]))
        scores = rng.random((2, H, T)) ** rng.integers(1, 12, (1, H, 1))
        scores[rng.random(scores.shape) < 0.1] = -np.inf  # protected / padding
        got = np.array(head_budgets(mx.array(scores, dtype=mx.float32), prefix, alpha))
        assert (got.sum(-1) == H * prefix).all(), trial
        assert (got >= np.floor(alpha * prefix)).all() and (got <= T).all(), trial


@pytest.mark.parametrize("alpha", [0.2, 0.6])
@pytest.mark.parametrize("algo", SCORERS)
def test_layer_rows_are_budget_times_heads_and_every_head_has_its_floor(algo, alpha):
    model = tiny_model("llama", num_attention_heads=8, num_key_value_heads=4)
    opts = dict(budget=24, head_budget="adaptive", alpha=alpha)
    if algo in ("snapkv", "pyramidkv", "qfilters", "expected_attention"):
        opts["window"] = 4  # (their default windows fill a budget of 24)
    with veloxpatch.patched(model, algo, **opts) as patch:
        caches = patch.make_cache()
        model(prompt_tokens(80)[None], cache=caches)
        patch.end_prompt(caches)
    protected = caches[0].options.protected()
    differ = False
    for c in caches:
        budget = c.row_budget()  # pyramidkv: this layer's
        rows = real_rows(c)[0]
        assert rows.sum() == budget * 4
        assert (rows >= protected + np.floor(alpha * (budget - protected))).all()
        assert c.rows == rows.max() <= c.head_bound(budget)  # padded to the largest
        per_row = 2 * 8 * 4 + 4  # K and V (head dim 8, fp32) and a position
        assert c.nbytes >= c.rows * 4 * per_row  # padding counted
        differ |= len(set(rows.tolist())) > 1
    assert differ


def adaptive_variants():
    out = [pytest.param(a, {**CONTRACT[a], **ADAPTIVE}, id=a) for a in SCORERS]
    for algo in ("h2o", "expected_attention"):
        opts = {**CONTRACT[algo], **ADAPTIVE, **QUANTIZED}
        out.append(pytest.param(algo, opts, id=f"{algo}-kv8"))
    return out


@pytest.mark.parametrize("algo,opts", adaptive_variants())
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_masked_dense_oracle_with_adaptive_heads(arch, algo, opts):
    model = tiny_model(arch, head_dim=HEAD_DIM)
    tokens = prompt_tokens(N).tolist()
    patched, masks, caches = run_patched(model, tokens, CHUNKS, algo, **opts)
    dense = oracle_logits(model, tokens, masks)
    lp = patched - mx.logsumexp(patched, axis=-1, keepdims=True)
    ld = dense - mx.logsumexp(dense, axis=-1, keepdims=True)
    assert mx.abs(lp - ld).max().item() <= (0.1 if "kv_bits" in opts else 1e-4)
    seen = [m.sum(-1) for m in masks]  # [Hkv, N]: rows each head's queries saw
    assert any((s != s[:1]).any() for s in seen)  # heads really held different rows
    assert all(c.rows <= c.row_bound() for c in caches)


@pytest.mark.parametrize("algo", ["h2o", "knorm", "expected_attention"])
def test_bytes_stay_bounded_over_a_long_decode_with_padded_heads(algo):
    model = tiny_model("llama", head_dim=HEAD_DIM, num_hidden_layers=1)
    with veloxpatch.patched(model, algo, **CONTRACT[algo], **ADAPTIVE) as patch:
        caches = patch.make_cache()
        y, held = prompt_tokens(24)[None], []
        for _ in range(300):
            y = mx.argmax(model(y, cache=caches)[:, -1:], axis=-1)
            mx.eval(y)
            held.append(sum(c.nbytes for c in caches))
            assert all(c.rows <= c.row_bound() for c in caches)
    assert max(held[150:]) <= max(held[50:150])


def test_save_load_of_padded_heads_continues_identically(tmp_path):
    model = tiny_model("qwen3", head_dim=HEAD_DIM)
    with veloxpatch.patched(model, "h2o", **CONTRACT["h2o"], **ADAPTIVE) as patch:
        caches = patch.make_cache()
        greedy(model, prompt_tokens(40), n=6, prompt_cache=caches)
        assert any(c.padded for c in caches)
        veloxpatch.save_cache(tmp_path / "c.safetensors", caches)
        loaded = veloxpatch.load_cache(tmp_path / "c.safetensors")
        assert [c.options.head_budget for c in loaded] == ["adaptive"] * len(caches)
        t1, l1 = greedy(model, mx.array([5]), n=8, prompt_cache=caches)
        t2, l2 = greedy(model, mx.array([5]), n=8, prompt_cache=loaded)
    assert t1 == t2 and max_abs(l1, l2) == 0.0


def kept_and_logprobs(model, algo, **opts):
    with veloxpatch.patched(model, algo, **opts) as patch:
        caches = patch.make_cache()
        toks, lp = greedy(model, prompt_tokens(50), n=10, prompt_cache=caches)
    return [np.array(c.positions_view()) for c in caches], toks, lp


@pytest.mark.parametrize(
    "algo_a,opts_a,algo_b",
    [
        # every head holds the same positions / the same scores: adaptive is uniform
        ("streaming_llm", {}, "streaming_llm"),
        ("tova", {}, "tova"),
        # adakv is snapkv with adaptive head budgets
        ("adakv", {}, "snapkv"),
    ],
)
def test_adaptive_changes_nothing_where_the_heads_agree(algo_a, opts_a, algo_b):
    model = tiny_model("llama")
    opts = CONTRACT[algo_b]
    a = kept_and_logprobs(model, algo_a, **opts, **opts_a)
    b = kept_and_logprobs(model, algo_b, **opts, **ADAPTIVE)
    assert all((x == y).all() for x, y in zip(a[0], b[0]))
    assert a[1] == b[1] and max_abs(a[2], b[2]) == 0.0


@pytest.mark.parametrize(
    "algo,opts,match",
    [
        ("h2o", dict(alpha=0.3), "alpha.*needs head_budget='adaptive'"),
        ("h2o", dict(head_budget="adaptive", alpha=1.5), "alpha"),
        ("knorm", dict(head_budget="per-head"), "head_budget"),
        ("adakv", dict(head_budget="uniform"), "head_budget"),
    ],
)
def test_options_validated(algo, opts, match):
    with pytest.raises(OptionError, match=match):
        ALGORITHMS[algo].Options.create(algo, opts)
