"""Reversibility and isolation of the patch (DESIGN: "The seam")."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen3
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch import patcher
from veloxpatch.caches.full import FullCache
from veloxpatch.errors import OptionError, PatchStateError, UnsupportedModelError


def logits(model, n=24):
    return model(prompt_tokens(n)[None])


def params(model):
    return dict(tree_flatten(model.parameters()))


def test_restore_puts_back_the_same_objects():
    model = tiny_model("llama")
    original = llama.Attention.__dict__["__call__"]
    before_params = params(model)
    before = logits(model)
    patch = veloxpatch.apply(model, algo="full")
    assert llama.Attention.__dict__["__call__"] is not original
    assert "make_cache" in model.__dict__
    patch.restore()
    assert llama.Attention.__dict__["__call__"] is original
    assert "make_cache" not in model.__dict__
    after_params = params(model)
    assert list(after_params) == list(before_params)
    assert all(after_params[k] is before_params[k] for k in before_params)
    assert mx.array_equal(logits(model), before)
    patch.restore()  # a second restore is a no-op
    assert llama.Attention.__dict__["__call__"] is original


def test_parameter_tree_unchanged_while_patched():
    model = tiny_model("qwen3")
    before = params(model)
    with veloxpatch.patched(model, algo="full"):
        during = params(model)
        assert list(during) == list(before)
        assert all(during[k] is before[k] for k in before)


def test_exception_inside_with_still_restores():
    model = tiny_model("llama")
    original = llama.Attention.__dict__["__call__"]
    with pytest.raises(RuntimeError, match="boom"):
        with veloxpatch.patched(model, algo="full"):
            raise RuntimeError("boom")
    assert llama.Attention.__dict__["__call__"] is original
    assert veloxpatch.apply(model, algo="full").restore() is None


def test_models_are_isolated():
    a, b, c = (
        tiny_model("llama", seed=0),
        tiny_model("llama", seed=1),
        tiny_model("llama", seed=2),
    )
    ref_c = logits(c)
    pa = veloxpatch.apply(a, algo="full")
    pb = veloxpatch.apply(b, algo="full")
    # Unpatched c runs the original code even though its class is wrapped.
    assert mx.array_equal(logits(c), ref_c)
    assert not patcher.is_registered(c.layers[0].self_attn)
    ca, cb = a.make_cache(), b.make_cache()
    a(prompt_tokens(10)[None], cache=ca)
    assert all(x.rows == 10 for x in ca) and all(x.rows == 0 for x in cb)
    pa.restore()
    assert patcher.is_registered(b.layers[0].self_attn)
    assert llama.Attention in patcher.wrapped_classes()  # b still needs it
    pb.restore()
    assert llama.Attention not in patcher.wrapped_classes()


def test_second_apply_raises_and_changes_nothing():
    model = tiny_model("llama")
    patch = veloxpatch.apply(model, algo="full")
    make_cache = model.make_cache
    with pytest.raises(PatchStateError, match="already patched"):
        veloxpatch.apply(model, algo="full")
    assert model.make_cache == make_cache and patch.active
    assert veloxpatch.unpatch(model) is True
    assert veloxpatch.unpatch(model) is False


@pytest.mark.parametrize("first", ["outer", "inner"])
def test_patching_a_model_inside_a_patched_one_raises_and_changes_nothing(first):
    # a vision-language wrapper holds the language model: either can be given,
    # but not both; the refusal leaves the other's patch whole
    outer = tiny_model("mistral3_llama")
    inner = outer.language_model
    attn = inner.model.layers[0].self_attn
    models = {"outer": outer, "inner": inner}
    second = models["inner" if first == "outer" else "outer"]
    patch = veloxpatch.apply(models[first], algo="h2o", budget=8)
    with pytest.raises(PatchStateError, match="already patched"):
        veloxpatch.apply(second, algo="h2o", budget=8)
    assert patcher.is_registered(attn) and patch.active
    assert veloxpatch.unpatch(second) is False  # nothing of its own to undo
    caches = models[first].make_cache()
    models[first](prompt_tokens(12)[None], cache=caches)
    assert caches[0].rows == 8  # still evicting: its layers are still patched
    patch.restore()
    assert not patcher.is_registered(attn)


def test_prior_instance_make_cache_is_put_back():
    model = tiny_model("llama")

    def mine():
        return ["mine"]

    model.make_cache = mine
    with veloxpatch.patched(model, algo="full") as patch:
        assert model.make_cache == patch.make_cache
    assert model.__dict__["make_cache"] is mine


def test_failure_midway_leaves_model_untouched(monkeypatch):
    model = tiny_model("qwen3")
    original = qwen3.Attention.__dict__["__call__"]
    calls = {"n": 0}
    real_wrap = patcher._wrap_class

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 2:  # the second layer fails
            raise RuntimeError("injected failure")
        return real_wrap(*args)

    monkeypatch.setattr(patcher, "_wrap_class", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        veloxpatch.apply(model, algo="full")
    assert qwen3.Attention.__dict__["__call__"] is original
    assert "make_cache" not in model.__dict__
    assert not any(patcher.is_registered(layer.self_attn) for layer in model.layers)
    assert veloxpatch.api.patch_of(model) is None
    veloxpatch.apply(model, algo="full").restore()  # and it can be patched later


def test_bad_input_is_rejected_before_mutation():
    model = tiny_model("llama")
    with pytest.raises(OptionError, match="unknown algorithm 'nope'.*full"):
        veloxpatch.apply(model, algo="nope")
    with pytest.raises(OptionError, match="unknown option.*budget"):
        veloxpatch.apply(model, algo="full", budget=3)
    model.model_type = "gpt2"
    with pytest.raises(UnsupportedModelError, match="supported: .*llama.*qwen3"):
        veloxpatch.apply(model, algo="full")
    assert "make_cache" not in model.__dict__
    assert llama.Attention not in patcher.wrapped_classes()


def test_mistral4_text_model_is_rejected():
    from model_adapters.mistral import MistralAdapter

    class Fake:
        model_type = "mistral3"

        class args:
            text_config = {"model_type": "mistral4"}

    with pytest.raises(UnsupportedModelError, match="mistral4"):
        MistralAdapter().target_for(Fake())


def test_cache_after_restore_raises():
    model = tiny_model("llama")
    with veloxpatch.patched(model, algo="full"):
        cache = model.make_cache()
        model(prompt_tokens(5)[None], cache=cache)
    with pytest.raises(PatchStateError, match="not patched"):
        model(prompt_tokens(2)[None], cache=cache)


def test_make_prompt_cache_and_generate_pick_up_the_caches():
    from mlx_lm.models.cache import make_prompt_cache

    model = tiny_model("qwen2")
    with veloxpatch.patched(model, algo="full"):
        assert all(isinstance(c, FullCache) for c in make_prompt_cache(model))
    assert not any(isinstance(c, FullCache) for c in make_prompt_cache(model))


def test_algos_lists_full():
    assert "full" in veloxpatch.algos()


def test_import_patches_nothing():
    import subprocess
    import sys

    code = (
        "import veloxpatch, sys; from mlx_lm.models import llama;"
        "f = llama.Attention.__dict__['__call__'];"
        "import inspect; assert inspect.isfunction(f), f;"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
