"""When the prompt ends: after mlx-lm's lone last prompt token, or on
`Patch.end_prompt()` for callers who drive the model themselves."""

import mlx.core as mx
import pytest
from helpers import greedy
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.caches import ALGORITHMS
from veloxpatch.caches.full import FullCache


class CountingCache(FullCache):
    name = "counting"
    summary = "test: records when the prompt ends"

    def end_prompt(self):
        self.ended_at = getattr(self, "ended_at", []) + [self.offset]


@pytest.fixture
def counting(monkeypatch):
    monkeypatch.setitem(ALGORITHMS, "counting", CountingCache)  # one registry line


@pytest.mark.parametrize("step", [2, 7, 64])
def test_generate_step_ends_the_prompt_once(counting, step):
    model = tiny_model("llama")
    with veloxpatch.patched(model, algo="counting") as patch:
        caches = patch.make_cache()
        greedy(
            model, prompt_tokens(30), n=5, prefill_step_size=step, prompt_cache=caches
        )
    # The prompt ends after its 30th token, whatever the chunking (7 and 2 also
    # send a lone 29th token), and before the first generated token is attended.
    assert all(c.ended_at == [30] for c in caches)


def test_patch_end_prompt_for_manual_callers(counting):
    model = tiny_model("qwen3")
    with veloxpatch.patched(model, algo="counting") as patch:
        caches = patch.make_cache()
        model(prompt_tokens(12)[None], cache=caches)
        patch.end_prompt()  # defaults to the caches of the last make_cache()
        model(mx.array([[3]]), cache=caches)  # decode: no second end
        model(prompt_tokens(6)[None], cache=caches)  # a new turn...
        model(mx.array([[4]]), cache=caches)  # ...its lone last token...
        model(mx.array([[5]]), cache=caches)  # ...ended it once this one comes
    assert all(c.ended_at == [12, 20] for c in caches)


def test_one_phase_for_all_layers_of_a_prompt_cache():
    model = tiny_model("llama")
    with veloxpatch.patched(model, algo="full") as patch:
        a, b = patch.make_cache(), patch.make_cache()
        assert len({id(c.phase) for c in a}) == 1
        assert a[0].phase is not b[0].phase  # one phase per sequence
        model(prompt_tokens(8)[None], cache=a)
        assert a[0].phase.in_prompt and not b[0].phase.in_prompt


def test_probe_sees_every_patched_call():
    model = tiny_model("mistral_swa")
    seen = []
    with veloxpatch.patched(model, algo="full") as patch:
        caches = patch.make_cache(probe=seen.append)
        model(prompt_tokens(10)[None], cache=caches)
        model(mx.array([[3]]), cache=caches)
    # only layer 1 is patched (0 and 2 slide); pre- and post-RoPE tensors
    assert [(s.layer, s.offset, s.q.shape[2]) for s in seen] == [(1, 0, 10), (1, 10, 1)]
    s = seen[1]
    rope = model.layers[1].self_attn.rope
    assert mx.allclose(s.q, rope(s.q_pre, offset=10)).item()
    assert mx.allclose(s.k, rope(s.k_pre, offset=10)).item()
