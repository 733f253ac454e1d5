"""Compressed caches through mlx-lm's own tools: prompt-cache files, trim,
speculative decoding, and its memory flags (max_kv_size, kv_bits)."""

import inspect

import mlx.core as mx
import pytest
from helpers import greedy, max_abs
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models import cache as mlx_cache
from test_contract import HEAD_DIM, variants
from tiny import prompt_tokens, resolve_options, tiny_model

import veloxpatch
from veloxpatch.errors import PatchStateError, UnsupportedCacheOperation


def run_to(model, caches, point):
    """Feed a 40-token prompt up to `point`; return what comes next."""
    p = prompt_tokens(40)
    if point == "mid-prompt":
        model(p[None, :30], cache=caches)
        mx.eval([c.state for c in caches])
        return p[30:]
    if point == "prompt-end":  # what mlx_lm.cache_prompt does
        for _ in generate_step(p, model, max_tokens=0, prompt_cache=caches):
            pass
        return mx.array([7, 8, 9])
    greedy(model, p, n=5, prompt_cache=caches)
    return mx.array([5])


@pytest.mark.parametrize("point", ["mid-prompt", "prompt-end", "decoding"])
@pytest.mark.parametrize("algo,opts", variants())
def test_mlx_lm_prompt_cache_files_round_trip(tmp_path, algo, opts, point):
    model = tiny_model("qwen3", head_dim=HEAD_DIM)
    path = str(tmp_path / "prompt.safetensors")
    opts = resolve_options(model, opts)
    with veloxpatch.patched(model, algo, **opts) as patch:
        caches = patch.make_cache()
        rest = run_to(model, caches, point)
        mlx_cache.save_prompt_cache(path, caches, {"m": "1"})
        loaded, meta = mlx_cache.load_prompt_cache(path, return_metadata=True)
        assert meta == {"m": "1"}
        assert [type(c) for c in loaded] == [type(c) for c in caches]
        t1, l1 = greedy(model, rest, n=6, prompt_cache=caches)
        t2, l2 = greedy(model, rest, n=6, prompt_cache=loaded)
    assert t1 == t2 and max_abs(l1, l2) == 0.0


def test_a_cache_from_another_model_is_a_clear_error(tmp_path):
    small, other = tiny_model("llama"), tiny_model("llama", head_dim=32)
    path = str(tmp_path / "p.safetensors")
    with veloxpatch.patched(small, "snapkv", budget=16, window=4) as patch:
        caches = patch.make_cache()
        greedy(small, prompt_tokens(30), n=2, prompt_cache=caches)
        mlx_cache.save_prompt_cache(path, caches)
    with veloxpatch.patched(other, "snapkv", budget=16, window=4):
        loaded = mlx_cache.load_prompt_cache(path)
        with pytest.raises(PatchStateError, match="another model"):
            greedy(other, mx.array([3]), n=2, prompt_cache=loaded)
    deeper = tiny_model("llama", num_hidden_layers=4)
    with veloxpatch.patched(deeper, "snapkv", budget=16, window=4):
        shuffled = mlx_cache.load_prompt_cache(path)[::-1] + [None]
        with pytest.raises(PatchStateError, match="cache of layer"):
            deeper(mx.array([[3]]), cache=shuffled)


@pytest.mark.parametrize("algo,opts", variants())
def test_trim_then_continue_equals_never_seeing_the_trimmed_tokens(algo, opts):
    # A budget above the context: nothing is evicted while the tokens are held
    # (kvzap's threshold drops whatever the budget: its budget mode then).
    opts = {**opts, "budget": 200} if "budget" in opts else opts
    opts = {**opts, "threshold": None} if "threshold" in opts else opts
    model = tiny_model("llama", head_dim=HEAD_DIM)
    p = prompt_tokens(40)
    opts = resolve_options(model, opts)
    with veloxpatch.patched(model, algo, **opts) as patch:
        a, b = patch.make_cache(), patch.make_cache()
        for caches in (a, b):
            model(p[None, :30], cache=caches)
            mx.eval([c.state for c in caches])
        for t in (3, 4, 5):
            model(mx.array([[t]]), cache=a)
        assert mlx_cache.can_trim_prompt_cache(a)
        assert mlx_cache.trim_prompt_cache(a, 3) == 3
        assert all(c.offset == 30 for c in a)
        la, lb = model(p[None, 30:], cache=a), model(p[None, 30:], cache=b)
    assert max_abs(la, lb) < 1e-5


@pytest.mark.parametrize("algo", ["snapkv", "h2o", "knorm"])
def test_trim_after_eviction_drops_only_the_last_positions(algo):
    model = tiny_model("llama")
    opts = dict(budget=12, sinks=2) | (dict(window=4) if algo == "snapkv" else {})
    with veloxpatch.patched(model, algo, **opts) as patch:
        caches = patch.make_cache()
        greedy(model, prompt_tokens(40), n=20, prompt_cache=caches)
        before = [mx.array(c.positions_view()) for c in caches]
        seen = caches[0].offset
        for c in caches:
            c.trim(4)
        for c, pos in zip(caches, before):
            assert c.offset == seen - 4
            for h in range(pos.shape[1]):  # per head: the same rows but the last
                old = [p for p in pos[0, h].tolist() if p < c.offset]
                new = [p for p in c.positions_view()[0, h].tolist() if p < 2**31 - 1]
                assert new == old
        greedy(model, mx.array([3]), n=5, prompt_cache=caches)  # and it goes on


def test_trim_into_quantized_rows():
    model = tiny_model("llama", head_dim=HEAD_DIM)
    with veloxpatch.patched(model, "kivi", bits=8, residual=4) as patch:
        caches = patch.make_cache()
        model(prompt_tokens(100)[None], cache=caches)
        assert caches[0].quantized == 96
        for c in caches:
            c.trim(40)
        # groups of 32 are quantized together: the second group stays, its last
        # 4 slots (positions 60-63) become holes that attention masks
        assert [(c.offset, c.rows, c.quantized, c.holes) for c in caches][0] == (
            60,
            60,
            64,
            4,
        )
        fresh = patch.make_cache()
        model(prompt_tokens(100)[None, :60], cache=fresh)
        nxt = prompt_tokens(5, seed=3)[None]
        la, lb = model(nxt, cache=caches), model(nxt, cache=fresh)
    assert max_abs(la, lb) < 0.1  # rows 32-59 are 8-bit in one, exact in the other


@pytest.mark.parametrize(
    "target,draft",
    [
        (("full", {}), ("full", {})),
        (("snapkv", dict(budget=200, window=4)), ("knorm", dict(budget=16))),
        (("h2o", dict(budget=200)), ("streaming_llm", dict(budget=12))),
    ],
)
def test_speculative_decoding_matches_plain_decoding(target, draft):
    model = tiny_model("llama")
    draft_model = tiny_model("llama", seed=1, num_hidden_layers=1)
    prompt = prompt_tokens(30)
    with veloxpatch.patched(model, target[0], **target[1]):
        plain = [t for t, _ in generate_step(prompt, model, max_tokens=12)]
        with veloxpatch.patched(draft_model, draft[0], **draft[1]):
            steps = speculative_generate_step(
                prompt, model, draft_model, num_draft_tokens=3, max_tokens=12
            )
            spec = [t for t, _, _ in steps]
    assert spec == plain


@pytest.mark.parametrize(
    "algo,opts",
    [
        ("snapkv", dict(budget=200, kv_bits=8, kv_residual=4)),
        ("snapkv", dict(budget=12, window=4)),
        ("expected_attention", dict(budget=12, sinks=2, window=4)),
        ("kvzip", dict(budget=12, sinks=2, window=4)),
    ],
)
def test_a_speculative_target_ends_its_prompt_and_keeps_its_bound(algo, opts):
    """speculative_generate_step never sends the target a lone token: the
    prompt's last one leads the first verify call. It is attended first and
    alone, so the prompt ends (compresses, quantizes) before the drafts."""
    model = tiny_model("llama", head_dim=HEAD_DIM)
    draft = tiny_model("llama", head_dim=HEAD_DIM, seed=1, num_hidden_layers=1)
    prompt = prompt_tokens(60)
    with veloxpatch.patched(model, algo, **opts) as patch:
        plain = [t for t, _ in generate_step(prompt, model, max_tokens=12)]
        caches = patch.make_cache()
        steps = speculative_generate_step(
            prompt,
            model,
            draft,
            num_draft_tokens=3,
            max_tokens=12,
            prompt_cache=caches + mlx_cache.make_prompt_cache(draft),
        )
        spec = [t for t, _, _ in steps]
    assert all(c.phase.ends == 1 and not c.in_prompt for c in caches)
    if opts["budget"] > len(prompt) + 12:  # nothing evicted: plain decoding's
        assert spec == plain and caches[0].quantized > 0
    else:  # the budget, the decode window and one verify call's drafts
        assert max(c.rows for c in caches) <= opts["budget"] + opts["window"] + 3


def test_max_kv_size_is_the_budget_and_kv_bits_is_refused_up_front():
    model = tiny_model("qwen3")
    p = prompt_tokens(60)
    with veloxpatch.patched(model, "knorm", budget=64) as patch:
        mine = patch.make_cache(max_kv_size=24)
        greedy(model, p, n=4, prompt_cache=mine)
        assert all(c.rows <= 24 and c.options.budget == 24 for c in mine)
        via_mlx = [t for t, _ in generate_step(p, model, max_tokens=4, max_kv_size=24)]
        same = patch.make_cache(max_kv_size=24)
        assert via_mlx == greedy(model, p, 4, 2048, prompt_cache=same)[0]
        seen = []
        with pytest.raises(UnsupportedCacheOperation, match="kv_bits"):
            for tok in generate_step(p, model, max_tokens=4, kv_bits=4):
                seen.append(tok)
        with pytest.raises(UnsupportedCacheOperation, match="kv_bits"):
            for tok in generate_step(
                p, model, max_tokens=4, kv_bits=4, prompt_cache=patch.make_cache()
            ):
                seen.append(tok)
        assert seen == []  # before the first token
    with veloxpatch.patched(model, "full"):
        with pytest.raises(UnsupportedCacheOperation, match="max_kv_size"):
            next(generate_step(p, model, max_tokens=2, max_kv_size=24))


def test_mlx_lm_still_names_what_the_flags_are_read_from():
    # mlx_flags reads these locals from mlx-lm's frames (pinned minor version).
    params = inspect.signature(mlx_cache.make_prompt_cache).parameters
    assert "max_kv_size" in params
    for fn in (generate_step, speculative_generate_step):
        assert "kv_bits" in inspect.signature(fn).parameters
    src = inspect.getsource(mlx_cache.make_prompt_cache)
    assert "return model.make_cache()" in src


def test_caches_of_another_algorithm_are_a_clear_error(tmp_path):
    model = tiny_model("llama")
    path = str(tmp_path / "p.safetensors")
    with veloxpatch.patched(model, "snapkv", budget=16, window=4) as patch:
        caches = patch.make_cache()
        greedy(model, prompt_tokens(30), n=2, prompt_cache=caches)
        mlx_cache.save_prompt_cache(path, caches)
    with veloxpatch.patched(model, "h2o", budget=16):
        loaded = mlx_cache.load_prompt_cache(path)
        with pytest.raises(PatchStateError, match="patched with 'h2o'.*'snapkv'"):
            greedy(model, mx.array([3]), n=2, prompt_cache=loaded)
