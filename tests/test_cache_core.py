"""Cache-level properties of the eviction core, fed a fixed key/value stream."""

import copy

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxpatch.caches import ALGORITHMS
from veloxpatch.caches.kv_budget import holds_of
from veloxpatch.errors import OptionError

N, HKV, HQ, D = 72, 2, 4, 8
mx.random.seed(7)
KEYS = mx.random.normal((1, HKV, N, D)) * mx.random.uniform(0.5, 2.0, (1, HKV, N, 1))
VALUES = mx.random.normal((1, HKV, N, D))
QUERIES = mx.random.normal((1, HQ, N, D))


def identity_rope(t, offset=0):
    return t


def feed(cache, chunks, check=None):
    """Feed the stream in the given chunk sizes, then one token per call."""
    sizes = list(chunks) + [1] * (N - sum(chunks))
    start = 0
    for L in sizes:
        sl = slice(start, start + L)
        out = cache.attend(
            QUERIES[:, :, sl],
            KEYS[:, :, sl],
            VALUES[:, :, sl],
            rope=identity_rope,
            scale=D**-0.5,
        )
        mx.eval(out)
        start += L
        if check:
            check(cache, start)
    return cache


def kept(cache):
    return np.array(cache.positions_view())


def row_bytes(cache):
    side = holds_of(cache.options).row_bytes  # knorm's norm of each row
    return (KEYS.dtype.size * D * 2 + 4 + side) * HKV


chunkings = st.lists(st.integers(1, 20), min_size=0, max_size=6).filter(
    lambda c: sum(c) <= N
)
CONFIGS = [
    ("streaming_llm", dict(budget=16, sinks=4)),
    ("streaming_llm", dict(budget=9, sinks=0)),
    ("knorm", dict(budget=16, sinks=4)),
    ("knorm", dict(budget=12, sinks=2, recent=5)),
]


@pytest.mark.parametrize("algo,opts", CONFIGS)
@settings(deadline=None, max_examples=25)
@given(chunks=chunkings)
def test_eviction_invariants(algo, opts, chunks):
    cls = ALGORITHMS[algo]
    budget, sinks = opts["budget"], opts["sinks"]

    def check(cache, seen):
        assert cache.offset == seen  # tokens seen, not rows held
        assert cache.rows <= budget
        assert cache.nbytes <= budget * row_bytes(cache)
        pos = kept(cache)
        assert (np.diff(pos, axis=-1) > 0).all()  # strictly increasing per head
        for s in range(min(sinks, seen)):
            assert (pos == s).any(axis=-1).all()  # every sink in every head
        recent = opts.get("recent", 0)
        for r in range(max(0, seen - recent), seen):
            assert (pos == r).any(axis=-1).all()

    cache = feed(cls(cls.Options.create(algo, opts)), chunks, check)
    reference = feed(cls(cls.Options.create(algo, opts)), [])
    np.testing.assert_array_equal(kept(cache), kept(reference))  # chunking-free


def test_streaming_llm_keeps_sinks_and_recent():
    cls = ALGORITHMS["streaming_llm"]
    cache = feed(cls(cls.Options(budget=10, sinks=3)), [30])
    assert kept(cache)[0, 0].tolist() == [0, 1, 2] + list(range(N - 7, N))


def test_knorm_keeps_lowest_norms():
    cls = ALGORITHMS["knorm"]
    cache = feed(cls(cls.Options(budget=10, sinks=2, recent=0)), [N])
    norms = np.linalg.norm(np.array(KEYS[0]), axis=-1)
    for h in range(HKV):
        rest = np.argsort(norms[h, 2:])[:8] + 2
        assert kept(cache)[0, h].tolist() == [0, 1] + sorted(rest.tolist())
    assert not (kept(cache)[0, 0] == kept(cache)[0, 1]).all()  # heads differ


def test_knorm_default_recent_is_half_of_what_sinks_leave():
    cls = ALGORITHMS["knorm"]
    assert cls.Options(budget=512).recent == 254
    assert cls.Options(budget=10, sinks=2).recent == 4
    assert cls.Options(budget=5, sinks=4).recent == 0


def test_attention_output_matches_masked_dense_at_cache_level():
    # After eviction, one decode query attends over exactly the kept rows.
    cls = ALGORITHMS["knorm"]
    cache = feed(cls(cls.Options(budget=12, sinks=2)), [N - 1])
    pos = kept(cache)[0]
    q, k, v = QUERIES[:, :, -1:], KEYS[:, :, -1:], VALUES[:, :, -1:]
    out = cache.attend(q, k, v, rope=identity_rope, scale=D**-0.5)
    for hq in range(HQ):
        h = hq // (HQ // HKV)
        idx = [int(i) for i in pos[h]] + [N - 1]
        kk, vv = np.array(KEYS[0, h])[idx], np.array(VALUES[0, h])[idx]
        logits = np.array(q[0, hq, 0]) @ kk.T * D**-0.5
        p = np.exp(logits - logits.max())
        ref = (p / p.sum()) @ vv
        np.testing.assert_allclose(np.array(out[0, hq, 0]), ref, atol=1e-5)


@pytest.mark.parametrize(
    "algo,opts,match",
    [
        ("streaming_llm", dict(budget=4, sinks=4), "budget"),
        ("streaming_llm", dict(budget=0), "budget"),
        ("streaming_llm", dict(sinks=-1), "sinks"),
        ("streaming_llm", dict(budget=2.5), "integer"),
        ("knorm", dict(budget=10, sinks=4, recent=6), "budget"),
        (
            "knorm",
            dict(window=3),
            "unknown option.*valid: budget, sinks, head_budget, alpha, "
            "max_kv_bytes, recent, kv_bits, kv_key_bits, kv_group, kv_residual, "
            "kv_recipe, quant",
        ),
    ],
)
def test_options_validated(algo, opts, match):
    with pytest.raises(OptionError, match=match):
        ALGORITHMS[algo].Options.create(algo, opts)


def test_deepcopy_is_independent():
    cls = ALGORITHMS["knorm"]
    cache = feed(cls(cls.Options(budget=10, sinks=2)), [40])
    twin = copy.deepcopy(cache)
    assert twin.offset == cache.offset and (kept(twin) == kept(cache)).all()
    q, k, v = QUERIES[:, :, :1], KEYS[:, :, :1] * 0, VALUES[:, :, :1]
    twin.attend(q, k, v, rope=identity_rope, scale=1.0)
    assert twin.offset == cache.offset + 1
    assert not (kept(twin) == kept(cache)).all()


def test_every_cache_trims_and_an_empty_one_trims_nothing():
    # (issue 19: speculative decoding and prompt-cache reuse trim every cache;
    # tests/test_lifecycle.py checks what trimming keeps)
    for cls in ALGORITHMS.values():
        cache = cls(cls.Options())
        assert cache.is_trimmable() and cache.trim(3) == 0 and cache.offset == 0
