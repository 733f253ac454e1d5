"""kvzip and compress-then-reuse: the reconstruction pass, the global choice,
forks, save/load, and what the compressing pass saw."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import greedy, max_abs
from oracle import numpy_tail_probs, watch_decode_cuts
from tiny import VOCAB, prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.caches.kvzip import repeat_inputs
from veloxpatch.caches.kvzip.choice import compress_together
from veloxpatch.context import copy_cache
from veloxpatch.errors import OptionError


class ByteTokenizer:
    """Enough of a tokenizer for the repeat instruction on a tiny model."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [b % VOCAB for b in text.encode()]


TOK = ByteTokenizer()


class Recorder(nn.Module):
    """A layer's q_proj that keeps its inputs (the attention's x)."""

    def __init__(self, inner, seen):
        super().__init__()
        self.inner, self.seen = inner, seen

    def __call__(self, x):
        self.seen.append(np.array(x[0]))
        return self.inner(x)


def reference_scores(model, ids, rng, repeat, sinks, plus=False):
    """numpy: each layer's KVzip score of the context rows in `rng` from one
    repeat chunk, from the probe's q/k (dense full model); KVzip+ with `plus`."""
    seen = {}
    inputs = [[] for _ in model.layers]
    attns = [layer.self_attn for layer in model.layers]
    projs = [a.q_proj for a in attns]
    for a, x in zip(attns, inputs):
        a.q_proj = Recorder(a.q_proj, x)
    try:
        with veloxpatch.patched(model, "full") as patch:
            caches = patch.make_cache(
                probe=lambda s: seen.setdefault(s.layer, []).append(s)
            )
            model(mx.array(ids)[None], cache=caches)
            model(mx.array(repeat)[None], cache=caches)
    finally:
        for a, q in zip(attns, projs):
            a.q_proj = q
    out = []
    start, end = rng
    for layer in sorted(seen):
        ctx, rep = seen[layer]
        k = np.concatenate([np.array(ctx.k[0]), np.array(rep.k[0])], axis=1)
        q = np.array(rep.q[0])  # [Hq, L, D]
        hkv, L = k.shape[0], q.shape[1]
        g = q.shape[0] // hkv
        T = len(ids)
        cols = list(range(min(sinks, start))) + list(range(start, end))
        cols += list(range(T, T + L))
        x_norm = np.linalg.norm(inputs[layer][1], axis=-1)  # the repeat's x
        w_o = np.array(attns[layer].o_proj.weight)  # [hidden, Hq * D]
        v = np.array(ctx.v[0])[:, start:end]  # [Hkv, C, D]
        scores = np.zeros((hkv, end - start))
        for h in range(q.shape[0]):
            kh = k[h // g][cols]
            logits = q[h] @ kh.T * rep.scale
            n_ctx = len(cols) - L
            causal = np.arange(L)[None, :] <= np.arange(L)[:, None]
            logits[:, n_ctx:] = np.where(causal, logits[:, n_ctx:], -np.inf)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            sub = p[:, len(cols) - L - (end - start) : len(cols) - L]
            if plus:
                d = q.shape[2]
                wv = np.linalg.norm(v[h // g] @ w_o[:, h * d : (h + 1) * d].T, axis=-1)
                sub = sub / x_norm[:, None] * wv[None, :]
            scores[h // g] = np.maximum(scores[h // g], sub.max(0))
        out.append(scores)
    return out


def repeat_call(model, ids, rng, repeat, plus):
    """Logits of one reconstruction chunk after the context, and every layer's
    scores [B, Hkv, rows] from it."""
    with veloxpatch.patched(model, "kvzip", budget=12, sinks=2, plus=plus) as patch:
        caches = patch.make_cache()
        for c in caches:
            c.score_prompt = False
        model(mx.array(ids)[None], cache=caches)
        for c in caches:
            c.repeat = rng
        logits = model(mx.array(repeat)[None], cache=caches)
        return np.array(logits), [np.array(c.zscore) for c in caches]


@pytest.mark.parametrize("plus", [False, True], ids=["kvzip", "kvzip+"])
@pytest.mark.parametrize("chunk", [0, 1], ids=["one-chunk", "second-chunk"])
def test_repeat_scores_match_a_numpy_reference(chunk, plus):
    # the second chunk's softmax covers only the sinks, its chunk and the repeat
    model = tiny_model("llama")
    ids = prompt_tokens(40).tolist()
    rng, repeat = repeat_inputs(ids, TOK, chunk=[64, 16][chunk], start=0)[chunk]
    ref = reference_scores(model, ids, rng, repeat, sinks=2, plus=plus)
    _, got = repeat_call(model, ids, rng, repeat, plus)
    for g, r in zip((g[0] for g in got), ref):
        assert np.allclose(g[:, rng[0] :], r, rtol=1e-4, atol=1e-6)
        assert not g[:, : rng[0]].any()


@pytest.mark.parametrize("plus", [False, True], ids=["kvzip", "kvzip+"])
def test_repeat_in_tiles_of_queries_equals_one_piece(plus, monkeypatch):
    # the reconstruction's explicit softmax is taken a tile of queries at a time
    from veloxpatch.caches import attention_math

    model = tiny_model("llama")
    ids = prompt_tokens(40).tolist()
    rng, repeat = repeat_inputs(ids, TOK, chunk=16, start=0)[1]
    whole = repeat_call(model, ids, rng, repeat, plus)
    monkeypatch.setattr(attention_math, "TILE_ELEMENTS", 1)  # one query a tile
    tiled = repeat_call(model, ids, rng, repeat, plus)
    assert np.allclose(whole[0], tiled[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(whole[1], tiled[1]):
        assert np.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_reconstruction_chunks_overlap_by_eight_tokens():
    ids = list(range(20, 60))
    chunks = repeat_inputs(ids, TOK, chunk=16, start=5)
    assert [rng for rng, _ in chunks] == [(5, 21), (21, 37), (37, 45)]
    second = chunks[1][1]
    assert second[-16:] == ids[16:32] and ids[8:16] == second[-16 - 1 - 8 : -16 - 1]


@pytest.mark.parametrize("layerwise", [False, True])
def test_global_choice_sums_to_budget_with_floors(layerwise):
    model = tiny_model("qwen3", num_hidden_layers=4)
    ids = prompt_tokens(60).tolist()
    opts = dict(budget=16, sinks=2, floor=0.25, layerwise=layerwise, window=4)
    with veloxpatch.patched(model, "kvzip", **opts) as patch:
        caches = patch.prefill(ids, tokenizer=TOK)
    held = []
    for c in caches:
        pos = np.array(c.positions_view()[0])
        assert (pos < 2**31 - 1).all() and not c.padded  # every head fills its rows
        assert c.rows >= 4  # floor: ceil(0.25 x 16)
        assert (pos[:, :2] == [0, 1]).all()  # sinks
        assert (pos < 60).all()  # no repeat row left
        assert c.offset == 60
        held.append(c.rows * pos.shape[0])
    total = 16 * 2 * 4  # budget x KV heads x layers
    assert total - 2 * 4 < sum(held) <= total
    if layerwise:
        assert all(h == 32 for h in held)


def test_survivors_keep_their_positions_and_nothing_of_the_repeat_remains():
    model = tiny_model("llama")
    ids = prompt_tokens(50).tolist()
    with veloxpatch.patched(model, "full") as patch:
        dense = patch.prefill(ids)
    with veloxpatch.patched(model, "kvzip", budget=10, sinks=2) as patch:
        caches = patch.prefill(ids, tokenizer=TOK)
    for c, d in zip(caches, dense):
        pos = np.array(c.positions_view()[0])
        keys = np.array(c.keys[0, :, : c.rows])
        full_keys = np.array(d.keys[0, :, : d.rows])
        for h in range(pos.shape[0]):
            for r, p in enumerate(pos[h]):
                if p < 2**31 - 1:  # the row is the original key at its position
                    assert np.allclose(keys[h, r], full_keys[h, p], atol=1e-5)


def test_a_question_on_a_fork_leaves_the_context_bit_identical(tmp_path):
    model = tiny_model("llama")
    ids = prompt_tokens(50).tolist()
    with veloxpatch.patched(model, "kvzip", budget=12, sinks=2) as patch:
        ctx = patch.prefill(ids, tokenizer=TOK)
        before = [{k: mx.array(v) for k, v in c.arrays().items()} for c in ctx]
        meta = [c.meta_state for c in ctx]
        q1 = greedy(model, prompt_tokens(6, seed=3), n=5, prompt_cache=copy_cache(ctx))
        for c, b, m in zip(ctx, before, meta):
            assert c.meta_state == m
            assert all(mx.array_equal(c.arrays()[k], v) for k, v in b.items())
        q1_again = greedy(
            model, prompt_tokens(6, seed=3), 5, prompt_cache=copy_cache(ctx)
        )
        assert q1[0] == q1_again[0]
        veloxpatch.save_cache(tmp_path / "ctx.safetensors", ctx)
        loaded = veloxpatch.load_cache(tmp_path / "ctx.safetensors")
        q1_loaded = greedy(model, prompt_tokens(6, seed=3), 5, prompt_cache=loaded)
    assert q1[0] == q1_loaded[0] and max_abs(q1[1], q1_loaded[1]) == 0.0


def test_the_compressing_pass_never_sees_the_question():
    model = tiny_model("llama")
    ids = prompt_tokens(40).tolist()
    question = prompt_tokens(7, seed=9).tolist()
    seen = []
    with veloxpatch.patched(model, "snapkv", budget=12, window=4) as patch:
        make = patch.make_cache
        patch.make_cache = lambda **kw: make(probe=seen.append, **kw)
        ctx = patch.prefill(ids)
        compressed = len(seen)
        greedy(model, mx.array(question), n=2, prompt_cache=copy_cache(ctx))
    # everything the compression saw was the context (offsets below 40)
    assert all(s.offset + s.q.shape[2] <= 40 for s in seen[:compressed])
    assert any(s.offset >= 40 for s in seen[compressed:])


def test_kvzip_without_a_tokenizer_is_a_clear_error():
    model = tiny_model("llama")
    with veloxpatch.patched(model, "kvzip", budget=12) as patch:
        with pytest.raises(OptionError, match="tokenizer"):
            patch.prefill(prompt_tokens(30).tolist())
        with pytest.raises(OptionError, match="token ids"):
            patch.prefill([])


def test_plain_generation_compresses_with_the_prompts_own_queries():
    model = tiny_model("llama")
    with veloxpatch.patched(model, "kvzip", budget=12, sinks=2, window=4) as patch:
        caches = patch.make_cache()
        greedy(model, prompt_tokens(40), n=10, prompt_cache=caches)
    assert all(c.context_rows is not None for c in caches)
    assert all(c.rows <= c.row_bound() for c in caches)


def test_compress_together_uses_every_layer():
    model = tiny_model("llama", num_hidden_layers=3)
    with veloxpatch.patched(model, "kvzip", budget=8, sinks=1, floor=0.0) as patch:
        caches = patch.make_cache()
        model(prompt_tokens(30)[None], cache=caches)
        for c in caches:  # no reconstruction pass: the prompt's window scores
            c.raise_tail_scores()
        # make layer 0's scores dominate: it takes most of the shared budget
        caches[0].zscore = caches[0].zscore + 10.0
        compress_together(caches)
    rows = [c.rows * 2 for c in caches]
    assert sum(rows) <= 8 * 2 * 3 and rows[0] > rows[1] and rows[0] > rows[2]


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_compressed_layers_hold_no_spare_rows(kv_bits):
    # a layer keeping every context row had grown room for the repeat rows
    model = tiny_model("llama", num_hidden_layers=2, head_dim=32)
    ids = prompt_tokens(50).tolist()
    quant = {} if kv_bits is None else {"kv_bits": kv_bits, "kv_residual": 4}
    with veloxpatch.patched(model, "kvzip", budget=64, sinks=2, **quant) as patch:
        caches = patch.prefill(ids, tokenizer=TOK)
        for c in caches:
            assert c.offset == 50 and c.context_rows == 50
            if kv_bits is None:
                assert c.keys.shape[2] == c.values.shape[2] == c.rows
        text = greedy(model, prompt_tokens(5, seed=4), n=3, prompt_cache=caches)[0]
    assert len(text) == 3


def test_decode_recompression_keeps_the_best_rows_by_the_newest_queries():
    model = tiny_model("llama")
    ids = prompt_tokens(40).tolist()
    with veloxpatch.patched(model, "kvzip", budget=12, sinks=2, window=4) as patch:
        caches = patch.prefill(ids, tokenizer=TOK)
        c = caches[1]
        seen = watch_decode_cuts(c, sinks=2, window=4)
        greedy(model, prompt_tokens(4, seed=3), n=12, prompt_cache=caches)
    assert seen and all(n == 12 for n in seen)  # every layer back to the budget
    assert all(x.rows <= 12 + 4 for x in caches)


def test_recent_context_rows_are_kept_in_every_head():
    model = tiny_model("llama", num_hidden_layers=3)
    ids = prompt_tokens(40).tolist()
    with veloxpatch.patched(model, "kvzip", budget=10, sinks=2, recent=5) as patch:
        caches = patch.prefill(ids, tokenizer=TOK)
    for c in caches:
        pos = np.array(c.positions_view())
        for head in pos.reshape(-1, pos.shape[-1]):
            assert set(range(35, 40)) | {0, 1} <= set(head.tolist())
    with pytest.raises(OptionError, match="protected"):
        veloxpatch.apply(model, "kvzip", budget=6, sinks=2, recent=4)


def test_tail_queries_raise_scores_by_their_attention():
    """`tail=n`: the context's last n queries (buffered during its prefill, not
    the repeat's) raise each row's score to their largest probability over
    the queries and the GQA group, a numpy softmax for reference."""
    model = tiny_model("llama", num_hidden_layers=2)
    ids = prompt_tokens(30).tolist()
    opts = dict(budget=12, sinks=2, tail=4, window=4)
    with veloxpatch.patched(model, "kvzip", **opts) as patch:
        caches = patch.make_cache()
        model(mx.array(ids)[None], cache=caches)  # the prompt is not ended
        for c in caches:
            assert c.tail_queries.shape[2] == 4
            want = numpy_tail_probs(c)  # [Hkv, T]
            Hkv, T = want.shape
            c.zscore = mx.zeros((1, Hkv, T))
            c.score_prompt = False  # as after the reconstruction pass
            c.raise_tail_scores()
            assert c.tail_queries is None  # used once, then dropped
            np.testing.assert_allclose(np.array(c.zscore[0]), want, atol=1e-5)


def spy_reconstruct(monkeypatch) -> list:
    """Every reconstruction pass from now on, as (its context ids, the offset
    it ran at)."""
    from veloxpatch.caches.kvzip import reconstruct

    seen = []
    real = reconstruct.reconstruct

    def spy(model, caches, zipped, ctx, tokenizer):
        seen.append((list(ctx), zipped[0].offset))
        return real(model, caches, zipped, ctx, tokenizer)

    monkeypatch.setattr(reconstruct, "reconstruct", spy)
    return seen


def test_generate_reconstructs_the_prompt_from_its_ids(monkeypatch):
    """Inside mlx-lm's generate functions the patch records the prompt's ids
    and runs the reconstruction over them before the call that ends the
    prompt; the kept rows then match `patch.prefill`'s."""
    model = tiny_model("llama")
    ids = prompt_tokens(40).tolist()
    seen = spy_reconstruct(monkeypatch)
    opts = dict(budget=12, sinks=2, window=4)
    with veloxpatch.patched(model, "kvzip", tokenizer=TOK, **opts) as patch:
        caches = patch.make_cache()
        greedy(model, mx.array(ids), n=2, prefill_step_size=64, prompt_cache=caches)
        via_generate = [np.array(c.positions_view()) for c in caches]
        assert seen == [(ids, 40)]  # once, over the whole prompt, at its end
        ref = patch.prefill(ids, tokenizer=TOK)
        via_prefill = [np.array(c.positions_view()) for c in ref]
    for a, b in zip(via_generate, via_prefill):
        a = [set(x.tolist()) - set(range(40, 50)) for x in a[0]]  # the prompt's
        b = [set(y.tolist()) for y in b[0]]
        assert [len(x) for x in a] == [len(y) for y in b]
        same = np.mean([len(x & y) / len(y) for x, y in zip(a, b)])
        assert same > 0.9  # float noise of a different chunking may swap near-ties


@pytest.mark.parametrize("save", ["mlx_lm", "veloxpatch"])
def test_a_context_saved_mid_prompt_is_reconstructed_when_the_question_ends_it(
    tmp_path, monkeypatch, save
):
    """mlx_lm.cache_prompt saves a context before its prompt ends: the file
    carries the ids the patch recorded, so the question sent next runs the
    reconstruction over context and question, as on the original caches."""
    from mlx_lm.models import cache as mlx_cache

    model = tiny_model("llama")
    context, question = prompt_tokens(40), prompt_tokens(12, seed=3)
    seen = spy_reconstruct(monkeypatch)
    path = str(tmp_path / "c.safetensors")
    with veloxpatch.patched(model, "kvzip", tokenizer=TOK, budget=12, window=4) as p:
        caches = p.make_cache()
        model(context[None], cache=caches)
        mx.eval([c.state for c in caches])
        if save == "mlx_lm":
            mlx_cache.save_prompt_cache(path, caches)
            loaded = mlx_cache.load_prompt_cache(path)
        else:
            veloxpatch.save_cache(path, caches)
            loaded = veloxpatch.load_cache(path)
        t1, l1 = greedy(model, question, n=4, prompt_cache=caches)
        t2, l2 = greedy(model, question, n=4, prompt_cache=loaded)
    whole = context.tolist() + question.tolist()
    assert [ids for ids, _ in seen] == [whole, whole]
    assert t1 == t2 and max_abs(l1, l2) == 0.0


def test_a_second_turn_after_an_answer_reconstructs_the_answer_and_prompt(
    monkeypatch,
):
    """A chat's second prompt follows a generated answer: the pass runs over
    both (their ids are recorded as they are fed), as it does when the answer
    is trimmed away, instead of leaving every row to the prompt's window."""
    model = tiny_model("llama")
    seen = spy_reconstruct(monkeypatch)
    first, second = prompt_tokens(40).tolist(), prompt_tokens(30, seed=3).tolist()
    with veloxpatch.patched(model, "kvzip", tokenizer=TOK, budget=12, window=8) as p:
        caches = p.make_cache()
        answer, _ = greedy(model, mx.array(first), n=4, prompt_cache=caches)
        fed = caches[0].offset - 40  # the answer's tokens the model has seen
        greedy(model, mx.array(second), n=2, prompt_cache=caches)
    assert [offset for _, offset in seen] == [40, 40 + fed + 30]
    assert seen[1][0] == answer[:fed] + second


def test_a_long_later_prompt_is_compressed_to_the_budget():
    """A request that starts from a compressed prefix (the server's prompt
    cache) and adds a long prompt is held to budget + window, not kept whole."""
    model = tiny_model("llama", num_hidden_layers=3)
    opts = dict(budget=12, sinks=2, window=4)
    with veloxpatch.patched(model, "kvzip", tokenizer=TOK, **opts) as patch:
        caches = patch.prefill(prompt_tokens(20).tolist(), tokenizer=TOK)
        greedy(model, prompt_tokens(60, seed=5), n=3, prompt_cache=caches)
    assert sum(c.rows for c in caches) <= (12 + 4) * len(caches)
    assert all(c.offset == caches[0].offset >= 80 for c in caches)


def test_without_a_tokenizer_the_prompt_window_scores(monkeypatch):
    from veloxpatch.caches.kvzip import reconstruct as module

    monkeypatch.setattr(module, "reconstruct", None)  # would fail if called
    model = tiny_model("llama")
    opts = dict(budget=12, sinks=2, window=4)
    with veloxpatch.patched(model, "kvzip", tokenizer=None, **opts):
        caches = model.make_cache()
        greedy(model, prompt_tokens(40), n=3, prompt_cache=caches)
    assert all(c.context_rows is not None for c in caches)
    assert sum(c.rows for c in caches) <= (12 + 4) * len(caches)


def test_a_replayed_prefill_is_reconstructed_like_a_direct_one(monkeypatch):
    """The eval replays one captured prefill into every arm: the replayed
    caches know the prompt's ids, so kvzip reconstructs as in a direct run."""
    from veloxpatch.eval.replay import capture_prefill

    model = tiny_model("llama")
    ids = prompt_tokens(40).tolist()
    captured = capture_prefill(model, ids[:-1])
    seen = spy_reconstruct(monkeypatch)
    opts = dict(budget=12, sinks=2, window=4)
    with veloxpatch.patched(model, "kvzip", tokenizer=TOK, **opts) as patch:
        caches = captured.caches("kvzip", opts, bound=patch.options)
        greedy(model, mx.array(ids[-1:]), n=2, prompt_cache=caches)
    assert [ctx for ctx, _ in seen] == [ids]
