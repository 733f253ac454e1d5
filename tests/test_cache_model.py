"""The cache core inside a patched tiny model: save/load, memory bounds, batches,
and the mlx-lm features that must fail loudly instead of bypassing the cache."""

import mlx.core as mx
import pytest
from helpers import greedy, max_abs
from mlx_lm.generate import generate_step
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.errors import PatchStateError, UnsupportedCacheOperation
from veloxpatch.memory import kv_bytes


@pytest.mark.parametrize(
    "arch,algo,opts",
    [
        ("llama", "knorm", dict(budget=20, sinks=2)),
        ("mistral_swa", "streaming_llm", dict(budget=16)),
        ("qwen3", "full", {}),
    ],
)
def test_save_load_round_trip_then_generation_continues(tmp_path, arch, algo, opts):
    model = tiny_model(arch)
    prompt = prompt_tokens(40)
    with veloxpatch.patched(model, algo=algo, **opts) as patch:
        caches = patch.make_cache()
        model(prompt[None, :-1], cache=caches)
        veloxpatch.save_cache(tmp_path / "c.safetensors", caches, {"note": "x"})
        loaded, meta = veloxpatch.load_cache(tmp_path / "c.safetensors", True)
        assert meta == {"note": "x"}
        assert [type(c) for c in loaded] == [type(c) for c in caches]
        rest = prompt[-1:]
        t1, l1 = greedy(model, rest, n=12, prompt_cache=caches)
        t2, l2 = greedy(model, rest, n=12, prompt_cache=loaded)
    assert t1 == t2 and max_abs(l1, l2) == 0.0


def test_kv_bits_raises_a_clear_error():
    model = tiny_model("llama")
    with veloxpatch.patched(model, algo="knorm", budget=10):
        with pytest.raises(UnsupportedCacheOperation, match="kv_bits"):
            list(
                generate_step(
                    prompt_tokens(12),
                    model,
                    max_tokens=2,
                    kv_bits=4,
                    quantized_kv_start=0,
                )
            )


def test_equal_length_batch_matches_single_rows():
    # llama, not qwen3: Qwen3's k_norm makes all key norms near-equal, so knorm's
    # choice there hinges on 1e-6 noise between batched and single matmuls.
    model = tiny_model("llama")
    batch = mx.stack([prompt_tokens(30, seed=1), prompt_tokens(30, seed=2)])
    with veloxpatch.patched(model, algo="knorm", budget=12, sinks=2) as patch:
        caches = patch.make_cache()
        both = model(batch, cache=caches)
        both = mx.concatenate([both, model(batch[:, :1], cache=caches)], axis=1)
        for b in range(2):
            single = patch.make_cache()
            one = model(batch[b : b + 1], cache=single)
            one = mx.concatenate([one, model(batch[b : b + 1, :1], cache=single)], 1)
            assert max_abs(both[b], one[0]) < 1e-5


def test_custom_mask_is_refused():
    model = tiny_model("llama")
    attn = model.layers[0].self_attn
    with veloxpatch.patched(model, algo="full") as patch:
        cache = patch.make_cache()[0]
        x = mx.zeros((2, 4, 64))
        padding = mx.array([[True] * 4, [False, True, True, True]])[:, None, None, :]
        with pytest.raises(PatchStateError, match="padded"):
            attn(x, mask=padding, cache=cache)


def test_memory_at_4000_tokens_budget_512():
    model = tiny_model("llama")
    mx.random.seed(3)
    prompt = mx.random.randint(0, 97, (4000,))
    held = {}
    for algo, opts in [
        ("full", {}),
        ("streaming_llm", dict(budget=512)),
        ("knorm", dict(budget=512)),
    ]:
        with veloxpatch.patched(model, algo=algo, **opts) as patch:
            caches = patch.make_cache()
            for s in range(0, 4000, 2048):
                model(prompt[None, s : s + 2048], cache=caches)
            mx.eval([c.state for c in caches])
            held[algo] = kv_bytes(caches)
    for algo in ("streaming_llm", "knorm"):
        ratio = held[algo] / held["full"]
        assert abs(ratio - 512 / 4000) / (512 / 4000) <= 0.05, (algo, ratio)


@pytest.mark.parametrize(
    "algo,opts",
    [
        ("streaming_llm", {}),
        ("knorm", {}),
        ("h2o", {}),
        ("tova", {}),
        ("snapkv", dict(window=16)),
        ("adakv", dict(window=16)),
    ],
)
def test_long_decode_keeps_memory_bounded(algo, opts):
    # The state is read every step, as a caller saving caches might: the prompt
    # still ends (after the 2nd lone call at worst) and memory stays bounded.
    model = tiny_model("llama", num_hidden_layers=1)
    with veloxpatch.patched(model, algo=algo, budget=64, **opts) as patch:
        caches = patch.make_cache()
        y = prompt_tokens(8)[None]
        seen = []
        for step in range(1000):  # 15x the budget: many eviction cycles
            logits = model(y, cache=caches)
            y = mx.argmax(logits[:, -1:], axis=-1)
            mx.eval(y, [c.state for c in caches])
            if step >= 64 + 16:
                seen.append(kv_bytes(caches))
                assert caches[0].rows <= caches[0].row_bound()
    cache = caches[0]
    assert cache.offset == 8 + 999
    row = 2 * cache.keys.shape[1] * cache.keys.shape[3] * 4 + 4 * cache.keys.shape[1]
    if algo == "snapkv":  # between budget and budget + window, + its queries
        queries = 4 * 16 * cache.keys.shape[3] * 4  # query heads x window x D, fp32
        assert max(seen) <= (64 + 16) * row + queries
        assert min(seen) == 64 * row + queries
    elif algo == "adakv":  # heads padded to the largest: budget x heads at most
        assert max(seen) <= (64 * cache.keys.shape[1] + 16) * row
    else:
        assert len(set(seen)) == 1 and cache.rows == 64


def test_foreign_mlx_lm_caches_on_a_patched_model_raise():
    # An explicit list of mlx-lm KVCaches would run uncompressed without a word.
    from mlx_lm.models.cache import KVCache

    model = tiny_model("llama")
    with veloxpatch.patched(model, algo="knorm", budget=12):
        with pytest.raises(PatchStateError, match="KVCache.*patch's caches"):
            greedy(model, prompt_tokens(20), n=2, prompt_cache=[KVCache()] * 3)
        assert model(prompt_tokens(5)[None]).shape[1] == 5  # no cache: fine
