"""Prefill once, derive every arm: replayed caches equal a direct run, bit for
bit (every cache attends with the fused kernel, so the capture run's layer
inputs are exactly those of a direct run)."""

import mlx.core as mx
import pytest
from tiny import prompt_tokens, tiny_model, tiny_scorer

import veloxpatch
from veloxpatch.api import make_options
from veloxpatch.caches import ALGORITHMS
from veloxpatch.eval.arms import takes_budget
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


def assert_replay_is_direct(model, captured, prompt, tail, algo, opts):
    """Replayed caches give the logits, offsets and kept rows of a direct run."""
    with veloxpatch.patched(model, algo=algo, **opts) as patch:
        direct = patch.make_cache()
        model(mx.array(prompt[:-1])[None], cache=direct)
        ref = continue_from(model, direct, tail)
        replayed = captured.caches(algo, opts, bound=patch.options)
        got = continue_from(model, replayed, tail)
    assert mx.array_equal(got, ref), (algo, opts)
    assert [c.offset for c in replayed] == [c.offset for c in direct]
    assert all(
        mx.array_equal(a.positions_view(), b.positions_view())
        for a, b in zip(replayed, direct)
    ), (algo, opts)


@pytest.mark.parametrize("arch", ["llama", "ministral3"])
def test_replay_equals_direct_run(arch):
    model = tiny_model(arch)
    prompt = prompt_tokens(40).tolist()
    tail = [prompt[-1], 5, 17, 3, 60]
    captured = capture_prefill(model, prompt[:-1])
    assert "capture" not in ALGORITHMS
    for algo, opts in ARMS:
        assert_replay_is_direct(model, captured, prompt, tail, algo, opts)


BUDGETED = sorted(a for a in ALGORITHMS if takes_budget(a))


@pytest.mark.parametrize("algo", BUDGETED)
def test_budgets_share_one_attended_prefill(algo):
    # Every registered algorithm: arms differing only in budget are derived from
    # one attended state, in any order, and each equals its own direct run.
    model = tiny_model("qwen3")
    prompt = prompt_tokens(44).tolist()
    tail = [prompt[-1], 9, 21, 4, 33, 8]
    captured = capture_prefill(model, prompt[:-1])
    extra = (
        dict(window=4)
        if "window" in ALGORITHMS[algo].Options.__dataclass_fields__
        else {}
    )
    if "scorer" in ALGORITHMS[algo].Options.__dataclass_fields__:
        extra["scorer"] = str(tiny_scorer(model))  # kvzap: a scorer for the model
    for budget in (20, 12, 60, 16):
        opts = dict(budget=budget, **extra)
        assert_replay_is_direct(model, captured, prompt, tail, algo, opts)
    # caches that may cut inside a call attend every call anew (kvzap)
    cuts = make_options(algo, opts)[1].prompt_chunk() is not None
    assert len(captured.attended) == (0 if cuts else 1)


def test_an_arm_cutting_inside_the_captured_call_is_prefilled_directly():
    """compress="chunks" cuts back mid-call: later layers see other inputs than
    the captured dense run, so the eval prefills that arm itself."""
    from veloxpatch.eval.arms import Arm
    from veloxpatch.eval.sessions import Prefills, arm_caches

    model = tiny_model("llama")
    prompt = prompt_tokens(40).tolist()
    tail = [prompt[-1], 5, 17]
    opts = dict(budget=14, window=4, compress="chunks", chunk=8)
    with veloxpatch.patched(model, "snapkv", **opts) as patch:
        direct = patch.make_cache()
        model(mx.array(prompt[:-1])[None], cache=direct)
        ref = continue_from(model, direct, tail)
    prefills = Prefills(model, prompt[:-1], [Arm("snapkv", opts)])
    with arm_caches(model, Arm("snapkv", opts), prompt[:-1], prefills) as (c, shared):
        got = continue_from(model, c, tail)
    assert not shared and mx.array_equal(got, ref)
    replayed = capture_prefill(model, prompt[:-1]).caches("snapkv", opts)
    with veloxpatch.patched(model, "snapkv", **opts):
        wrong = continue_from(model, replayed, tail)
    assert not mx.array_equal(wrong, ref)  # what the replay would have given
