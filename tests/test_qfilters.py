"""Q-Filters: calibration through the seam, the filters file, the `qfilters` cache."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from oracle import check_oracle
from tiny import dims_of, prompt_tokens, tiny_model

import veloxpatch
from model_adapters.base import fingerprint
from veloxpatch.caches.calibration_files import load_filters
from veloxpatch.caches.qfilters import group_mean
from veloxpatch.calibration.qfilters import (
    capture_queries,
    query_filters,
    save_filters,
)
from veloxpatch.errors import CalibrationError, OptionError

ARCHS = ["llama", "qwen3", "ministral3"]
CHUNKS = [7, 5, 9, 6]  # prefill, then single-token decode


def calibrated(arch, path, n=96):
    model = tiny_model(arch)
    queries = capture_queries(model, prompt_tokens(n, seed=5).tolist(), chunk=32)
    per_head = [query_filters(q) for q in queries]
    save_filters(path, per_head, model)
    return model, queries, per_head


def test_capture_matches_the_patched_forward(tmp_path):
    # The captured queries are the post-RoPE queries the caches score with:
    # rebuild them from the adapter's projection and the layer's rope.
    model = tiny_model("qwen3")
    ids = prompt_tokens(40, seed=2).tolist()
    got = capture_queries(model, ids, chunk=40, max_vectors=40)
    attn = model.layers[0].self_attn
    x = model.model.embed_tokens(mx.array(ids)[None])
    x = model.model.layers[0].input_layernorm(x)
    from model_adapters.base import project_qk_norm

    q, _, _ = project_qk_norm(attn, x)
    want = attn.rope(q, offset=0)[0]
    assert mx.allclose(got[0], want, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_orientation_most_queries_project_positively(tmp_path, arch):
    _, queries, per_head = calibrated(arch, tmp_path / "f.safetensors")
    for q, f in zip(queries, per_head):
        assert mx.allclose(mx.linalg.norm(f, axis=-1), mx.ones(f.shape[0]), atol=1e-4)
        share = ((q * f[:, None, :]).sum(-1) > 0).mean(-1)  # per query head
        assert (share >= 0.5).all().item()


def test_round_trip_in_a_fresh_process(tmp_path):
    path = tmp_path / "f.safetensors"
    model, _, per_head = calibrated("llama", path)
    loaded = load_filters(path, dims_of(model))
    kv = model.layers[0].self_attn.n_kv_heads
    for f, g in zip(per_head, loaded):
        assert mx.array_equal(group_mean(f, kv), g)
    script = f"""
import sys, json; sys.path.insert(0, "tests")
from veloxpatch import blas; blas.preload()
import mlx.core as mx
from tiny import tiny_model, prompt_tokens
import veloxpatch
model = tiny_model("llama")
f = {str(path)!r}
with veloxpatch.patched(model, "qfilters", budget=12, window=2, filters=f) as p:
    c = p.make_cache()
    model(prompt_tokens(30)[None], cache=c)
    out = [[c[i].filter.tolist(), c[i].scores(None).tolist()] for i in range(3)]
    print(json.dumps(out))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    with veloxpatch.patched(
        model, "qfilters", budget=12, window=2, filters=str(path)
    ) as p:
        c = p.make_cache()
        model(prompt_tokens(30)[None], cache=c)
        here = [[c[i].filter.tolist(), c[i].scores(None).tolist()] for i in range(3)]
    for (f1, s1), (f2, s2) in zip(json.loads(out.stdout), here):
        assert f1 == f2  # the very same filters
        assert np.allclose(s1, s2, atol=1e-5)  # BLAS summation order aside


def test_wrong_model_or_damaged_file_rejected_before_patching(tmp_path):
    path = tmp_path / "f.safetensors"
    calibrated("llama", path)
    other = tiny_model("qwen3")
    with pytest.raises(CalibrationError, match="another model"):
        veloxpatch.apply(other, "qfilters", budget=12, window=2, filters=str(path))
    assert veloxpatch.api.patch_of(other) is None and "make_cache" not in vars(other)
    # Same shapes, other weights: only the weight hash tells them apart.
    reseeded = tiny_model("llama", seed=1)
    assert fingerprint(reseeded)["layers"] == fingerprint(tiny_model("llama"))["layers"]
    with pytest.raises(CalibrationError, match="weights_sha256"):
        veloxpatch.apply(reseeded, "qfilters", budget=12, window=2, filters=str(path))
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(path.read_bytes()[:200])
    for bad in (damaged, tmp_path / "missing.safetensors"):
        with pytest.raises(CalibrationError):
            veloxpatch.apply(
                tiny_model("llama"), "qfilters", budget=12, window=2, filters=str(bad)
            )
    with pytest.raises(OptionError):
        veloxpatch.apply(tiny_model("llama"), "qfilters", budget=60, window=64)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["file", "prompt"])
def test_oracle(tmp_path, arch, mode):
    n = 56
    path = tmp_path / "f.safetensors"
    model, _, _ = calibrated(arch, path)
    opts = dict(budget=12, sinks=2, window=3)
    if mode == "file":
        opts["filters"] = str(path)
    tokens = prompt_tokens(n).tolist()
    err, masks, caches, _ = check_oracle(model, tokens, CHUNKS, "qfilters", **opts)
    assert err < 1e-5
    causal = np.tril(np.ones((n, n), bool))
    # queries of the last prefill chunk (21..26), after 21 rows met budget 12
    hidden = [int((causal & ~m)[:, 21:27].sum()) for m in masks]
    if mode == "file":  # evicts during prefill already
        assert all(h > 0 for h in hidden)
    else:  # waits for the prompt end, then evicts
        assert all(h == 0 for h in hidden)
        assert all(int((causal & ~m).sum()) > 0 for m in masks)
    assert all(c.rows <= 12 for c in caches)


def test_prompt_filters_are_the_prompt_queries_principal_direction():
    model = tiny_model("llama")
    ids = prompt_tokens(40, seed=3).tolist()
    queries = capture_queries(model, ids, chunk=40, max_vectors=40)
    with veloxpatch.patched(model, "qfilters", budget=16, window=2) as p:
        caches = p.make_cache()
        model(mx.array(ids)[None], cache=caches)
        p.end_prompt(caches)
    for q, c in zip(queries, caches):
        want = group_mean(query_filters(q), c.keys.shape[1])
        # same direction up to the orientation rule (mean vs majority)
        cos = (want * c.filter).sum(-1) / mx.linalg.norm(want, axis=-1)
        cos = cos / mx.linalg.norm(c.filter, axis=-1)
        assert (mx.abs(cos) > 0.999).all().item()
        assert c.rows == 16


def test_a_lone_token_prompt_still_gets_filters_and_stays_in_budget():
    # one token is no prompt to end: the filters come from the queries seen
    # so far once the rows first pass the budget (before, none ever came)
    from helpers import greedy

    model = tiny_model("llama")
    with veloxpatch.patched(model, "qfilters", budget=8, window=2) as p:
        caches = p.make_cache()
        greedy(model, prompt_tokens(1), n=40, prompt_cache=caches)
    assert all(c.filter is not None and c.rows == 8 for c in caches)


def test_each_sequence_of_a_batch_has_its_own_filters():
    # a sequence's kept rows and logits are those of the same prompt alone
    model = tiny_model("llama")
    prompts = mx.stack([prompt_tokens(24, seed=1), prompt_tokens(24, seed=2)])

    def run(batch):
        with veloxpatch.patched(model, "qfilters", budget=8, window=2) as p:
            caches = p.make_cache()
            model(batch[:, :23], cache=caches)
            mx.eval([c.state for c in caches])  # mlx-lm's chunk, then one token
            outs = [model(batch[:, 23:], cache=caches)]
            for t in range(6):
                step = mx.full((batch.shape[0], 1), 5 + t, mx.int32)
                outs.append(model(step, cache=caches))
        return mx.concatenate(outs, axis=1), caches

    both, caches = run(prompts)
    alone, solo = run(prompts[1:])
    np.testing.assert_allclose(np.array(both[1]), np.array(alone[0]), atol=1e-4)
    for c, s in zip(caches, solo):
        assert mx.array_equal(c.positions_view()[1], s.positions_view()[0])


def test_calibrate_on_a_model_with_sliding_window_layers(tmp_path):
    # Sliding-window layers keep mlx-lm's RotatingKVCache: the probe never sees
    # them, the file holds only the other layers, and the filters load and run.
    model = tiny_model("mistral_swa")
    queries = capture_queries(model, prompt_tokens(48, seed=5).tolist(), chunk=16)
    assert [q is None for q in queries] == [True, False, True]
    per_head = [None if q is None else query_filters(q) for q in queries]
    path = tmp_path / "swa.safetensors"
    save_filters(path, per_head, model)
    loaded = load_filters(path, dims_of(model))
    assert loaded[0] is None and loaded[2] is None and loaded[1].shape == (2, 16)
    with veloxpatch.patched(model, "qfilters", budget=12, window=2, filters=str(path)):
        out = model(prompt_tokens(30)[None])
    assert bool(mx.isfinite(out).all().item())


class ByteTokenizer:
    """Enough of a tokenizer for calibration prose on a tiny model."""

    def encode(self, text, add_special_tokens=False):
        return [b % 97 for b in text.encode()]


@pytest.mark.parametrize("algo", ["qfilters", "a2ats"])
def test_the_whole_calibration_on_sliding_window_layers(tmp_path, algo):
    model = tiny_model("mistral_swa")
    path = tmp_path / f"{algo}.safetensors"
    options = dict(codebook_size=8, far_position=64) if algo == "a2ats" else {}
    veloxpatch.calibrate(model, ByteTokenizer(), algo, tokens=64, out=path, **options)
    key = "codebook" if algo == "a2ats" else "filters"
    extra = dict(far_position=64) if algo == "a2ats" else dict(budget=12, window=2)
    with veloxpatch.patched(model, algo, **{key: str(path)}, **extra):
        out = model(prompt_tokens(30)[None])
    assert bool(mx.isfinite(out).all().item())
