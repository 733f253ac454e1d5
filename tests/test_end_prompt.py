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
