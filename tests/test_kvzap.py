"""kvzap: the surrogate's forward and fits against numpy, the scorer file's
checks, scores taken from the hidden state as each row enters, and what each
mode keeps (the contract test runs both modes through everything else)."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import greedy
from oracle import numpy_tail_probs
from tiny import VOCAB, dims_of, prompt_tokens, tiny_model, tiny_scorer

import veloxpatch
from veloxpatch.caches import calibration_files as format
from veloxpatch.caches.kvzap import hidden_size, surrogate_scores
from veloxpatch.calibration.kvzap import (
    calibrate_scorer,
    fit_mlp,
    fit_quality,
    fit_ridge,
    held_out,
    save_scorer,
    segments_of,
)
from veloxpatch.checked_io import save_checked
from veloxpatch.errors import CalibrationError, OptionError
from veloxpatch.probe import run_probe


def load_scorer(path, model):
    """The scorer file as a kvzap cache bound to `model` reads it."""
    return format.load_scorer(path, dims_of(model), hidden_size(model))


class ByteTokenizer:
    """Enough of a tokenizer for kvzip's repeat instruction on a tiny model."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [b % VOCAB for b in text.encode()]


def gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def test_surrogate_forward_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 12)).astype(np.float32)
    lin = {"w1": rng.normal(size=(12, 3)), "b1": rng.normal(size=3)}
    mlp = {**lin, "w1": rng.normal(size=(12, 7)), "b1": rng.normal(size=7)}
    mlp.update(w2=rng.normal(size=(7, 3)), b2=rng.normal(size=3))
    for w, ref in (
        (lin, x @ lin["w1"] + lin["b1"]),
        (mlp, gelu(x @ mlp["w1"] + mlp["b1"]) @ mlp["w2"] + mlp["b2"]),
    ):
        got = surrogate_scores(
            {k: mx.array(v, mx.float32) for k, v in w.items()}, mx.array(x)
        )
        assert got.shape == (2, 3, 5)
        np.testing.assert_allclose(
            np.array(got), ref.transpose(0, 2, 1), rtol=1e-4, atol=1e-4
        )


def test_ridge_fit_equals_least_squares_of_the_augmented_system():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(200, 10)) + 3.0
    Y = X @ rng.normal(size=(10, 2)) + rng.normal(size=(200, 2)) + 1.5
    w = fit_ridge(X, Y, ridge=0.05)
    Xc, Yc = X - X.mean(0), Y - Y.mean(0)
    lam = 0.05 * np.trace(Xc.T @ Xc) / 10
    A = np.vstack([Xc, math.sqrt(lam) * np.eye(10)])
    B = np.vstack([Yc, np.zeros((10, 2))])
    ref = np.linalg.lstsq(A, B, rcond=None)[0]
    np.testing.assert_allclose(w["w1"], ref, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(w["b1"], Y.mean(0) - X.mean(0) @ ref, atol=1e-10)


def test_mlp_fit_learns_what_a_line_cannot():
    rng = np.random.default_rng(2)
    X = rng.normal(size=(2000, 8)).astype(np.float32)
    Y = np.stack([np.abs(X[:, 0]), X[:, 1] ** 2], axis=1)  # no linear part
    train, test = slice(0, 1600), slice(1600, None)
    mlp = fit_mlp(X[train], Y[train], hidden=32, epochs=40, lr=1e-2, batch=128)
    lin = fit_ridge(X[train], Y[train])

    def r2(w):
        from veloxpatch.calibration.kvzap import predict

        return fit_quality(predict(w, X[test]), Y[test])["r2"]

    assert r2(lin) < 0.1 and r2(mlp) > 0.8


def test_a_standardized_mlp_folds_its_scaling_into_the_first_layer():
    # trained on X standardized, read on raw X: the same function as the MLP
    # trained (same seed, same steps) on the standardized X and read there
    rng = np.random.default_rng(3)
    X = (rng.normal(size=(600, 6)) * [1, 10, 0.1, 5, 1, 50] + 3).astype(np.float32)
    Y = np.stack([np.tanh(X[:, 1] / 10), X[:, 3] / 5], axis=1).astype(np.float32)
    mean, std = X.mean(0), X.std(0) + 1e-6
    folded = fit_mlp(X, Y, hidden=16, epochs=3, standardize=True, weight_decay=0.01)
    plain = fit_mlp(
        ((X - mean) / std).astype(np.float32), Y, hidden=16, epochs=3, weight_decay=0.01
    )
    from veloxpatch.calibration.kvzap import predict

    ref = predict(plain, ((X - mean) / std).astype(np.float32))
    np.testing.assert_allclose(predict(folded, X), ref, rtol=1e-4, atol=1e-4)
    assert not np.allclose(folded["w1"], plain["w1"])  # the scaling is in w1


def test_segments_and_held_out_split():
    assert segments_of(600, 1024) == [(0, 300), (300, 600)]
    assert len(segments_of(5000, 1024)) == 4
    assert held_out(2) == [False, True]
    assert held_out(10) == [False] * 4 + [True] + [False] * 4 + [True]


# ---- the scorer file ---------------------------------------------------------------
def test_a_scorer_file_for_another_model_or_damaged_is_refused(tmp_path):
    model = tiny_model("llama")
    path = tiny_scorer(model)
    assert len(load_scorer(path, model)) == len(model.layers)
    other = tiny_model("llama", seed=3)
    with pytest.raises(CalibrationError, match="another model"):
        veloxpatch.apply(other, "kvzap", scorer=str(path))
    assert veloxpatch.api.patch_of(other) is None
    broken = tmp_path / "broken.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    broken.write_bytes(bytes(data))
    with pytest.raises(CalibrationError, match="damaged|checksum"):
        veloxpatch.apply(model, "kvzap", scorer=str(broken))
    # written damaged (a consistent checksum): a layer's weights of the wrong width
    layers = load_scorer(path, model)
    layers[1] = {"w1": mx.zeros((5, 2)), "b1": mx.zeros((2,))}
    wrong = tmp_path / "wrong.safetensors"
    save_scorer(wrong, layers, model, "linear")
    with pytest.raises(CalibrationError, match="width"):
        veloxpatch.apply(model, "kvzap", scorer=str(wrong))
    layers[1] = {"w1": mx.full((64, 2), mx.nan), "b1": mx.zeros((2,))}
    save_scorer(wrong, layers, model, "linear")
    with pytest.raises(CalibrationError, match="not finite"):
        veloxpatch.apply(model, "kvzap", scorer=str(wrong))
    meta = {"format": "veloxpatch-qfilters/1"}
    save_checked(tmp_path / "q.safetensors", {"a": mx.zeros(2)}, meta, CalibrationError)
    with pytest.raises(CalibrationError, match="not a veloxpatch kvzap scorer"):
        veloxpatch.apply(model, "kvzap", scorer=str(tmp_path / "q.safetensors"))
    with pytest.raises(OptionError, match="scorer=FILE"):
        veloxpatch.apply(model, "kvzap")
    assert veloxpatch.api.patch_of(model) is None


# ---- scores as rows enter ----------------------------------------------------------
def entry_scores(model, ids):
    """Per layer [Hkv, N] the surrogate applied to the hidden state each token
    brought into the layer (an unpatched-model probe)."""
    scorer = load_scorer(tiny_scorer(model), model)
    xs = {}

    def keep(seen):
        xs.setdefault(seen.layer, []).append(seen.x)

    run_probe(model, ids, keep, chunk=7)
    return [
        np.array(surrogate_scores(scorer[i], mx.concatenate(xs[i], axis=1))[0])
        for i in range(len(model.layers))
    ]


def prefill(model, ids, caches, chunk=9):
    for a in range(0, len(ids), chunk):
        mx.eval(model(mx.array(ids[a : a + chunk])[None], cache=caches))


def test_a_rows_score_is_its_hidden_states_and_never_depends_on_later_tokens():
    model = tiny_model("qwen3")
    ids = prompt_tokens(40).tolist()
    other = ids[:25] + prompt_tokens(15, seed=9).tolist()
    ref = entry_scores(model, ids)
    scorer = str(tiny_scorer(model))
    with veloxpatch.patched(model, "kvzap", scorer=scorer, budget=100) as patch:
        a, b = patch.make_cache(), patch.make_cache()
        prefill(model, ids, a)
        prefill(model, other, b)
    for i, (ca, cb) in enumerate(zip(a, b)):
        za, zb = np.array(ca.row_scores()[0]), np.array(cb.row_scores()[0])
        np.testing.assert_allclose(za, ref[i], rtol=1e-5, atol=1e-5)
        assert np.array_equal(za[:, :25], zb[:, :25])


def test_threshold_mode_keeps_exactly_the_sinks_the_window_and_what_scores_over():
    model = tiny_model("llama")
    ids = prompt_tokens(50).tolist()
    scorer = load_scorer(tiny_scorer(model), model)
    opts = dict(scorer=str(tiny_scorer(model)), threshold=0.0, sinks=2, window=5)
    xs = {}  # what entered each layer (after eviction in the layers below)

    def keep(seen):
        xs.setdefault(seen.layer, []).append(seen.x)

    with veloxpatch.patched(model, "kvzap", **opts) as patch:
        caches = patch.make_cache(probe=keep)
        prefill(model, ids, caches)
    ref = [
        np.array(surrogate_scores(scorer[i], mx.concatenate(xs[i], axis=1))[0])
        for i in range(len(caches))
    ]
    compared = 0
    for c, s in zip(caches, ref):
        pos = np.array(c.positions_view()[0])
        for h in range(s.shape[0]):
            held = set(pos[h][pos[h] < 2**31 - 1].tolist())
            for p in range(50):
                if abs(s[h, p]) < 1e-4:
                    continue  # a near-tie with the threshold: float noise decides
                want = p < 2 or p >= 45 or s[h, p] >= 0.0
                assert (p in held) == want, (c.layer, h, p, s[h, p])
                compared += 1
        dropped = 1 - c.kept_fraction()
        assert 0.2 < dropped < 0.8  # a random scorer: about half is under 0
    assert compared > 250


def test_budget_mode_holds_share_plus_chunk_and_shares_the_model_budget():
    model = tiny_model("llama", num_hidden_layers=4)
    opts = dict(scorer=str(tiny_scorer(model)), budget=12, sinks=2, window=3, chunk=8)
    worst = {}
    with veloxpatch.patched(model, "kvzap", **opts) as patch:
        caches = patch.make_cache()
        for c in caches:  # rows held after every piece of every call
            real = c._attend_piece

            def watched(*args, c=c, real=real):
                out = real(*args)
                allowed = c.row_budget() + 8
                worst[c.layer] = max(worst.get(c.layer, 0), c.rows - allowed)
                return out

            c._attend_piece = watched
        prefill(model, prompt_tokens(60).tolist(), caches, chunk=21)
        shares = [c.share for c in caches]
        model(mx.array([[3]]), cache=caches)  # the prompt ends
    assert max(worst.values()) <= 0
    assert sum(shares) <= 12 * 4 and len(set(shares)) > 1  # one choice, uneven
    assert all(c.rows <= c.share for c in caches)  # chosen again at the end


def test_calls_ending_on_a_chunk_are_cut_by_the_model_wide_choice():
    # mlx-lm's prefill calls end on multiples of its step, the default `chunk`:
    # each such cut is the model-wide choice at the call's end, as with no chunk
    # cut at all (each layer was cut to its share alone first, for any prompt
    # over 2,048 tokens at the defaults)
    model = tiny_model("llama", num_hidden_layers=4)
    kept = {}
    for chunk in (16, 4096):
        opts = dict(scorer=str(tiny_scorer(model)), budget=12, window=3, chunk=chunk)
        with veloxpatch.patched(model, "kvzap", **opts) as patch:
            caches = patch.make_cache()
            greedy(
                model, prompt_tokens(60), n=2, prefill_step_size=16, prompt_cache=caches
            )
            kept[chunk] = [c.positions_view().tolist() for c in caches]
            shares = [c.share for c in caches]
    assert kept[16] == kept[4096] and len(set(shares)) > 1


def test_calibration_on_a_tiny_model_writes_a_file_the_cache_loads(tmp_path):
    model = tiny_model("llama")
    ids = prompt_tokens(400).tolist()
    layers, info = calibrate_scorer(model, ByteTokenizer(), ids, "linear", segment=100)
    assert info["segments"] == 4 and info["held_out_segments"] == 1
    assert len(info["held_out"]) == len(model.layers)
    assert all(-10 < r["r2"] <= 1 for r in info["held_out"])
    path = tmp_path / "s.safetensors"
    save_scorer(path, layers, model, "linear", info)
    opts = dict(scorer=str(path), budget=8, sinks=2, window=2)
    with veloxpatch.patched(model, "kvzap", **opts) as patch:
        caches = patch.make_cache()
        prefill(model, ids[:40], caches)
    assert veloxpatch.api.patch_of(model) is None
    with veloxpatch.patched(model, "full"):
        with pytest.raises(CalibrationError, match="restore"):
            calibrate_scorer(model, ByteTokenizer(), ids, "linear")


def test_ridge_strength_follows_the_noise():
    rng = np.random.default_rng(4)
    X = rng.normal(size=(300, 20))
    clean = X @ rng.normal(size=(20, 1))
    noise = rng.normal(size=(300, 1))
    weak = np.abs(fit_ridge(X, noise)["w1"]).max()  # nothing to learn: shrunk
    strong = fit_ridge(X, clean + 0.01 * noise)
    assert weak < 0.1
    np.testing.assert_allclose(predict_linear(strong, X), clean, atol=0.05)


def predict_linear(w, X):
    return X @ w["w1"] + w["b1"]


def test_decode_cuts_by_the_answers_attention():
    from oracle import watch_decode_cuts

    model = tiny_model("llama")
    opts = dict(scorer=str(tiny_scorer(model)), budget=12, sinks=2, window=4)
    with veloxpatch.patched(model, "kvzap", **opts) as patch:
        caches = patch.make_cache()
        prefill(model, prompt_tokens(40).tolist(), caches)
        c = caches[1]
        seen = watch_decode_cuts(c, sinks=2, window=4)
        greedy(model, prompt_tokens(4, seed=3), n=12, prompt_cache=caches)
    assert seen and all(n == c.share for n in seen)  # the layer keeps its share
    assert all(x.rows <= x.share + 4 for x in caches)


def test_the_prompt_cache_policy_each_mode_implies():
    from veloxpatch.caches.kvzap import KVzapCache, KVzapOptions

    policy = KVzapCache.policy_for
    assert policy(KVzapOptions()) == "prompt"  # the answer's queries cut rows
    assert policy(KVzapOptions(threshold=0.0)) == "as_is"


# ---- surrogates of KVzip's own scores ------------------------------------------------
def test_a_kvzip_target_fits_kvzips_own_scores_and_the_file_says_so(tmp_path):
    """`target="kvzip"`: the collected targets are log KVzip scores (the
    maximum repeat probability, so never above 0), not KVzip+'s; the file
    carries the target, an unknown one is refused as damaged."""
    from veloxpatch.calibration.kvzap import collect

    model = tiny_model("llama")
    ids = prompt_tokens(200).tolist()
    plain = collect(model, ByteTokenizer(), ids, segment=100, target="kvzip")
    plus = collect(model, ByteTokenizer(), ids, segment=100)
    for (_, y_plain), (_, y_plus) in zip(plain, plus):
        assert all((y <= 1e-6).all() for y in y_plain)
        assert not np.allclose(y_plain[0], y_plus[0])
    layers, info = calibrate_scorer(
        model, ByteTokenizer(), ids, "linear", segment=100, target="kvzip"
    )
    assert info["target"] == "kvzip"
    path = tmp_path / "plain.safetensors"
    save_scorer(path, layers, model, "linear", info, target="kvzip")
    assert load_scorer(path, model).target == "kvzip"
    assert load_scorer(tiny_scorer(model), model).target == "kvzip+"
    save_scorer(path, layers, model, "linear", info, target="kvzip++")
    with pytest.raises(CalibrationError, match="damaged, surrogate target"):
        veloxpatch.apply(model, "kvzap", scorer=str(path))
    assert veloxpatch.api.patch_of(model) is None
    with pytest.raises(CalibrationError, match="not 'plus'"):
        calibrate_scorer(model, ByteTokenizer(), ids, target="plus")


@pytest.mark.parametrize("target", ["kvzip", "kvzip+"])
def test_tail_queries_are_weighed_as_the_scores_the_surrogate_predicts(
    tmp_path, target
):
    """With a KVzip-target scorer the tail raises a row to its largest
    probability under the tail queries and the GQA group (a numpy softmax for
    reference), as kvzip's; with a KVzip+ one to KVzip+'s weights (not that)."""
    model = tiny_model("llama", num_hidden_layers=2)
    layers = load_scorer(tiny_scorer(model), model)
    path = tmp_path / "s.safetensors"
    save_scorer(path, list(layers), model, "linear", target=target)
    ids = prompt_tokens(30).tolist()
    opts = dict(scorer=str(path), budget=100, sinks=2, tail=4, window=4)
    with veloxpatch.patched(model, "kvzap", **opts) as patch:
        caches = patch.make_cache()
        model(mx.array(ids)[None], cache=caches)  # the prompt is not ended
        for c in caches:
            want = np.log(numpy_tail_probs(c))  # [Hkv, T]
            c.raise_tail_scores()
            got = np.array(c.tail_scores[0])
            close = np.allclose(got, want, atol=1e-4)
            assert close if target == "kvzip" else not close
        veloxpatch.save_cache(tmp_path / "c.safetensors", caches)
    loaded = veloxpatch.load_cache(tmp_path / "c.safetensors")
    assert [c.target for c in loaded] == [target] * len(caches)


def _kept(caches) -> list:
    """Each layer's kept positions per KV head (padding left out)."""
    out = []
    for c in caches:
        pos = np.array(c.positions_view()[0])
        out.append([sorted(p for p in row.tolist() if p < 2**31 - 1) for row in pos])
    return out


def test_a_cache_saved_while_decoding_cuts_as_if_never_saved(tmp_path):
    # the next decode cut ranks by the last `window` decode queries: they are
    # saved with the state (without them a loaded cache kept other rows)
    model = tiny_model("llama")
    opts = dict(scorer=str(tiny_scorer(model)), budget=12, sinks=2, window=6)
    tokens = prompt_tokens(30, seed=5).tolist()
    with veloxpatch.patched(model, "kvzap", **opts) as patch:
        caches = patch.make_cache()
        ids = prompt_tokens(40).tolist()
        for a in range(0, len(ids), 9):
            model(mx.array(ids[a : a + 9])[None], cache=caches)
        cut, fed = False, 0
        while not (cut and caches[1].rows == caches[1].share + 3):
            rows = caches[1].rows  # until 3 tokens after the first cut
            model(mx.array([[tokens[fed]]]), cache=caches)
            cut, fed = cut or caches[1].rows < rows, fed + 1
        veloxpatch.save_cache(tmp_path / "c.safetensors", caches)
        loaded = veloxpatch.load_cache(tmp_path / "c.safetensors")
        for t in tokens[fed:]:  # past the next cut
            a = model(mx.array([[t]]), cache=caches)
            b = model(mx.array([[t]]), cache=loaded)
            assert mx.array_equal(a, b)
    assert _kept(loaded) == _kept(caches)


def test_a_cache_saved_before_its_prompt_ends_keeps_the_tail_queries(tmp_path):
    # the model-wide choice as the prompt ends ranks rows by the prompt's
    # newest `tail` queries too; the scorer's bias is lowered so they decide
    model = tiny_model("llama")
    layers = load_scorer(tiny_scorer(model), model)
    low = [{**w, "b1": w["b1"] - 6.0} for w in layers]
    save_scorer(tmp_path / "s.safetensors", low, model, "linear")
    opts = dict(scorer=str(tmp_path / "s.safetensors"), budget=12, sinks=2)
    ids = prompt_tokens(61, seed=1).tolist()
    with veloxpatch.patched(model, "kvzap", **opts, window=2, tail=16) as patch:
        runs = []
        for saved in (False, True):
            caches = patch.make_cache()
            for a in range(0, 60, 20):
                model(mx.array(ids[a : a + 20])[None], cache=caches)
            if saved:
                veloxpatch.save_cache(tmp_path / "c.safetensors", caches)
                caches = veloxpatch.load_cache(tmp_path / "c.safetensors")
            model(mx.array(ids[60:])[None], cache=caches)  # the prompt's end
            runs.append((caches, model(mx.array([[7]]), cache=caches)))
    (ref, a), (loaded, b) = runs
    assert _kept(loaded) == _kept(ref)
    assert mx.array_equal(a, b)


def test_an_empty_saved_cache_keeps_its_scorer_and_trims_keep_the_fraction(tmp_path):
    model = tiny_model("llama")
    opts = dict(scorer=str(tiny_scorer(model)), threshold=0.0, window=4)
    ids = prompt_tokens(40)[None]
    with veloxpatch.patched(model, "kvzap", **opts) as patch:
        veloxpatch.save_cache(tmp_path / "e.safetensors", patch.make_cache())
        loaded = veloxpatch.load_cache(tmp_path / "e.safetensors")
        fresh = patch.make_cache()
        assert mx.array_equal(model(ids, cache=loaded), model(ids, cache=fresh))
        c = fresh[0]
        assert c.nbytes == sum(a.nbytes for a in c.held_arrays())
        assert any(a is c.zscore for a in c.held_arrays())  # nbytes counts scores
        c.trim(30)  # kept over the 10 tokens left
        held = (np.array(c.positions_view()) < 2**31 - 1).sum(-1).mean()
        assert c.kept_fraction() == pytest.approx(held / 10)
