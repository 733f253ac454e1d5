"""A2ATS: windowed RoPE, the query-aware codebook, decode retrieval."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tiny import dims_of, prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.caches.a2ats import rope_at
from veloxpatch.caches.calibration_files import load_codebook
from veloxpatch.calibration.a2ats import (
    calibrate_codebook,
    save_codebook,
    second_moment,
)
from veloxpatch.errors import CalibrationError, OptionError, UnsupportedModelError


def test_rope_at_rotates_each_row_to_its_own_position():
    rope = nn.RoPE(8)
    x = mx.random.normal((1, 2, 3, 8))
    pos = mx.array([[[0, 7, 3000], [5, 5, 1]]])
    got = rope_at(rope, x, pos)
    for h in range(2):
        for r in range(3):
            p = int(pos[0, h, r])
            want = rope(x[:, h : h + 1, r : r + 1], offset=p)[0, 0, 0]
            assert mx.allclose(got[0, h, r], want, atol=1e-5)


def run(model, ids, prompt, **opts):
    """Logits of every token: `prompt` tokens in two chunks, the rest one by one."""
    with veloxpatch.patched(model, "a2ats", **opts) as patch:
        caches = patch.make_cache()
        outs = [model(ids[None, : prompt - 20], cache=caches)]
        outs.append(model(ids[None, prompt - 20 : prompt], cache=caches))
        for t in ids[prompt:].tolist():
            outs.append(model(mx.array([[t]]), cache=caches))
    return mx.concatenate(outs, axis=1), caches


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(
    "opts",
    [
        dict(window=4096),
        dict(window=4, sinks=2, top=1.0),  # everything retrieved
        dict(window=4, sinks=2, top=1.0, far_position=0),  # far scores only rank
    ],
)
def test_parity_with_full(arch, opts):
    model = tiny_model(arch)
    ids = prompt_tokens(90)
    ref = model(ids[None])
    got, caches = run(model, ids, 60, **opts)
    assert mx.abs(got - ref).max().item() < 1e-4
    assert all(c.rows == 90 and c.offset == 90 for c in caches)


def test_ministral3_yarn_rope_is_refused():
    model = tiny_model("ministral3")
    with pytest.raises(UnsupportedModelError, match="rotation"):
        veloxpatch.apply(model, "a2ats")
    assert veloxpatch.api.patch_of(model) is None


@pytest.mark.parametrize(
    "opts",
    [
        dict(top=0),
        dict(top=1.5),
        dict(window=0),
        dict(codebook=3),
        dict(sinks=-1),
    ],
)
def test_option_errors(opts):
    with pytest.raises(OptionError):
        veloxpatch.apply(tiny_model("llama"), "a2ats", **opts)


@pytest.fixture(scope="module")
def book_file(tmp_path_factory):
    model = tiny_model("llama")
    path = tmp_path_factory.mktemp("a2ats") / "book.safetensors"
    books, captured = calibrate_codebook(
        model, prompt_tokens(400, seed=4).tolist(), size=16, far_position=2048
    )
    save_codebook(path, books, model, 2048)
    return path, books, captured


def test_codebook_is_the_query_aware_k_means_of_the_paper(book_file):
    path, books, captured = book_file
    keys, queries = (np.array(a, np.float64) for a in captured[0])
    book = books[0]
    lower = np.array(book["transform"], np.float64)
    h = second_moment(queries, keys.shape[0])
    assert np.allclose(lower @ lower.transpose(0, 2, 1), h, atol=1e-4)  # H = L L^T
    assert np.allclose(
        np.array(book["centroids"]) @ lower, np.array(book["tcentroids"]), atol=1e-3
    )  # c = c' L^-1
    # Each key's code is its nearest transformed centroid.
    model = tiny_model("llama")
    loaded = load_codebook(path, 2048, dims_of(model))
    from veloxpatch.caches.a2ats import assign

    codes = np.array(assign(mx.array(keys[None]), loaded[0]))[0]
    kt = keys @ lower
    dist = ((kt[:, :, None] - np.array(book["tcentroids"])[:, None]) ** 2).sum(-1)
    assert (codes == dist.argmin(-1)).mean() > 0.999


def test_codebook_file_is_checked(book_file, tmp_path):
    path = book_file[0]
    with pytest.raises(CalibrationError, match="far_position"):
        load_codebook(path, 1024, dims_of(tiny_model("llama")))
    with pytest.raises(CalibrationError, match="another model"):
        load_codebook(path, 2048, dims_of(tiny_model("llama", seed=1)))
    with pytest.raises(CalibrationError):
        veloxpatch.apply(tiny_model("qwen3"), "a2ats", codebook=str(path))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a file")
    with pytest.raises(CalibrationError):
        load_codebook(bad, 2048, dims_of(tiny_model("llama")))


@pytest.mark.parametrize("with_book", [False, True])
def test_retrieval_is_the_union_of_each_heads_top_rows(book_file, with_book):
    path = book_file[0]
    model = tiny_model("llama")
    ids = prompt_tokens(200)
    opts = dict(window=8, sinks=4, top=0.05)
    if with_book:
        opts["codebook"] = str(path)
    with veloxpatch.patched(model, "a2ats", **opts) as patch:
        caches = patch.make_cache()
        model(ids[None, :199], cache=caches)
        patch.end_prompt(caches)
        c, seen = caches[1], {}
        attend = c._attention

        def watched(q, keys, *args):  # the call's rotated queries live in it only
            seen.update(q_far=c._q_far, keys=keys, retrieved=c.retrieve(keys))
            return attend(q, keys, *args)

        c._attention = watched
        model(ids[None, 199:], cache=caches)
        assert c._q_far is None  # not held after the call
    keys, (rows, valid) = seen["keys"], seen["retrieved"]
    B, Hkv, T, D = keys.shape
    qf = np.array(seen["q_far"]).reshape(Hkv, -1, D)  # the decode call's, rotated
    k = np.array(keys[0])
    if with_book:
        lut = np.einsum("hgd,hcd->hgc", qf, np.array(c.book["centroids"]))
        codes = np.array(c.codes[0]).astype(np.int64)
        scores = np.stack([lut[h][:, codes[h]] for h in range(Hkv)])
    else:
        scores = np.einsum("hgd,htd->hgt", qf, k)
    n = int(np.ceil(0.05 * T))
    for h in range(Hkv):
        want = set(range(4)) | set(range(T - 8, T))
        for g in range(qf.shape[1]):
            far = scores[h, g, 4 : T - 8]
            want |= set((np.argsort(-far, kind="stable")[:n] + 4).tolist())
        got = np.array(rows[0, h])[np.array(valid[0, h])]
        assert sorted(got.tolist()) == sorted(want)


def test_nbytes_counts_every_key_and_value_plus_codes(book_file):
    model = tiny_model("llama")
    ids = prompt_tokens(100)
    with veloxpatch.patched(model, "a2ats", codebook=str(book_file[0])) as patch:
        caches = patch.make_cache()
        model(ids[None], cache=caches)
    c = caches[0]
    assert c.codes.dtype == mx.uint16 and c.codes.shape == (1, 2, 100)
    assert c.nbytes == c.keys.nbytes + c.values.nbytes + 2 * 2 * 100


def test_save_load_keeps_codes_and_codebook(book_file, tmp_path):
    model = tiny_model("llama")
    ids = prompt_tokens(150)
    opts = dict(window=8, sinks=4, top=0.1, codebook=str(book_file[0]))
    with veloxpatch.patched(model, "a2ats", **opts) as patch:
        caches = patch.make_cache()
        model(ids[None, :140], cache=caches)
        patch.end_prompt(caches)
        model(ids[None, 140:141], cache=caches)
        veloxpatch.save_cache(tmp_path / "c.safetensors", caches)
        loaded = veloxpatch.load_cache(tmp_path / "c.safetensors")
        outs = []
        for cs in (caches, loaded):
            outs.append([model(mx.array([[t]]), cache=cs) for t in ids[141:].tolist()])
    assert loaded[0].decoding and loaded[0].codes.shape == (1, 2, 150)
    assert all(mx.array_equal(a, b) for a, b in zip(*outs))


def test_codebook_options_must_be_bound_to_a_model(book_file):
    cls = veloxpatch.api.algorithm("a2ats")
    opts = cls.Options.create("a2ats", dict(codebook=str(book_file[0])))
    cache = cls(opts)
    with pytest.raises(OptionError, match="not loaded"):
        cache.attend(
            mx.zeros((1, 4, 2, 16)),
            mx.zeros((1, 2, 2, 16)),
            mx.zeros((1, 2, 2, 16)),
            rope=nn.RoPE(16),
            scale=0.25,
        )


def test_codebook_on_a_model_with_sliding_window_layers(tmp_path):
    model = tiny_model("mistral_swa")
    ids = prompt_tokens(96, seed=4).tolist()
    books, captured = calibrate_codebook(model, ids, size=8, far_position=64)
    assert [b is None for b in books] == [True, False, True]
    save_codebook(tmp_path / "swa.safetensors", books, model, 64)
    loaded = load_codebook(tmp_path / "swa.safetensors", 64, dims_of(model))
    assert loaded[0] is None and loaded[1]["centroids"].shape[:2] == (2, 8)
