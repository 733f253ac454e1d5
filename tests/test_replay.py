"""Prefill once, derive every arm: replayed caches equal a direct run, bit for
bit (every cache attends with the fused kernel, so the capture run's layer
inputs are exactly those of a direct run)."""

import mlx.core as mx
import pytest
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.caches import ALGORITHMS
from veloxpatch.eval.replay import capture_prefill

ARMS = [
    ("full", {}),
    ("streaming_llm", dict(budget=12)),
    ("knorm", dict(budget=12, sinks=2)),
    ("snapkv", dict(budget=14, window=4)),
    ("pyramidkv", dict(budget=14, window=4)),
    ("adakv", dict(budget=14, window=4)),
    ("h2o", dict(budget=12)),
    ("tova", dict(budget=12)),
    ("keyformer", dict(budget=12)),
]


def continue_from(model, caches, tokens):
    """Feed the last prompt token alone, then decode tokens; all logits."""
    outs = [model(mx.array([[t]]), cache=caches)[0, -1] for t in tokens]
    return mx.stack(outs)


@pytest.mark.parametrize("arch", ["llama", "ministral3"])
def test_replay_equals_direct_run(arch):
    model = tiny_model(arch)
    prompt = prompt_tokens(40).tolist()
    tail = [prompt[-1], 5, 17, 3, 60]
    captured = capture_prefill(model, prompt[:-1])
    assert "capture" not in ALGORITHMS
    for algo, opts in ARMS:
        with veloxpatch.patched(model, algo=algo, **opts) as patch:
            direct = patch.make_cache()
            model(mx.array(prompt[:-1])[None], cache=direct)
            ref = continue_from(model, direct, tail)
            replayed = captured.caches(algo, opts)
            got = continue_from(model, replayed, tail)
        assert mx.array_equal(got, ref), algo
        assert [c.offset for c in replayed] == [c.offset for c in direct]
        assert all(
            mx.array_equal(a.positions_view(), b.positions_view())
            for a, b in zip(replayed, direct)
        ), algo
