"""The server's prompt-cache policy (serve/prompt_cache.py `kept_for_later`): what a
finished request leaves for later requests is never compressed for its own
question. Driven the way mlx-lm's server drives it (generate, insert the
finished caches, fetch the nearest for the next prompt), on tiny models."""

import copy

import mlx.core as mx
import numpy as np
import pytest
from helpers import greedy
from mlx_lm.generate import BatchGenerator
from tiny import SCORER, prompt_tokens, resolve_options, tiny_model

import veloxpatch
from veloxpatch.serve.prompt_cache import BoundedPromptCache, kept_for_later
from veloxpatch.serve.replay import ReplayingModel

# an algorithm of each kind of prompt-cache entry: reconstructed, predicted,
# prompt-end compressed, full
REPLAY_ARMS = [
    ("kvzip", dict(budget=24)),
    ("kvzap", dict(budget=48, scorer=SCORER)),
    ("snapkv", dict(budget=24, window=8)),
    ("full", {}),
]

DOC = prompt_tokens(60).tolist()
ASK_A = prompt_tokens(6, seed=11).tolist()
ASK_B = prompt_tokens(6, seed=12).tolist()
KEY = ("tiny", None, None)


def serve(model, cache_store, prompt, n=6):
    """One request as mlx-lm's server runs it, the model called through
    ReplayingModel as the server calls it: (tokens, logprob rows, how many
    prompt tokens came from the prompt cache)."""
    cache, rest = cache_store.fetch_nearest_cache(KEY, prompt)
    if cache is None:
        cache, rest = model.make_cache(), prompt
    served = ReplayingModel(model)
    toks, rows = greedy(served, mx.array(rest), n=n, prompt_cache=cache)
    cache_store.insert_cache(KEY, prompt + toks, cache)
    return toks, rows, len(prompt) - len(rest)


@pytest.mark.parametrize(
    "algo,opts",
    [
        ("snapkv", dict(budget=24, window=8)),
        ("adakv", dict(budget=24, window=8)),
        ("full", {}),
    ],
)
def test_an_answer_never_depends_on_another_users_question(algo, opts):
    """The same document with question B: alone, or after a user who asked A
    on the same server. Same tokens, same logprobs (to float noise)."""
    model = tiny_model("llama")
    with veloxpatch.patched(model, algo, **opts) as patch:
        patch.keep_snapshots = True
        alone = serve(model, BoundedPromptCache(), DOC + ASK_B)
        shared = BoundedPromptCache()
        serve(model, shared, DOC + ASK_A)
        after = serve(model, shared, DOC + ASK_B)
    assert after[2] >= len(DOC)  # the document came from the first user's cache
    assert after[0] == alone[0]
    np.testing.assert_allclose(np.array(after[1]), np.array(alone[1]), atol=2e-4)


@pytest.mark.parametrize("algo", ["snapkv", "adakv"])
def test_a_question_shorter_than_the_trimmed_one_still_reads_a_full_window(algo):
    """An entry trimmed back past its question lost the window's queries of
    the document that question pushed out: reused only when the new question
    is at least as long as what was lost, so its window is a fresh one's."""
    model = tiny_model("llama")
    longer, shorter = prompt_tokens(12, seed=13).tolist(), prompt_tokens(4, seed=14)
    with veloxpatch.patched(model, algo, budget=24, window=8) as patch:
        patch.keep_snapshots = True
        alone = serve(model, BoundedPromptCache(), DOC + ASK_B)
        for first, reused in ((longer, False), (shorter.tolist(), True)):
            shared = BoundedPromptCache()
            serve(model, shared, DOC + first)
            after = serve(model, shared, DOC + ASK_B)
            assert (after[2] >= len(DOC)) == reused
            assert after[0] == alone[0]
            np.testing.assert_allclose(
                np.array(after[1]), np.array(alone[1]), atol=2e-4
            )


@pytest.mark.parametrize(
    "algo,opts",
    [
        ("streaming_llm", {}),
        ("knorm", {}),
        ("kvzip", {}),
        ("kvzap", dict(scorer=SCORER)),  # its model-wide choice saw the question
    ],
)
def test_a_cache_evicted_past_the_shared_prefix_is_not_reused(algo, opts):
    """Rows evicted after the shared document were chosen with what followed it
    (the first user's question, or its length): the second user starts over
    and gets what it gets alone. The first user's next turn still reuses."""
    from test_kvzip import TOK

    model = tiny_model("llama")
    opts = resolve_options(model, opts)
    ask_long = prompt_tokens(20, seed=13).tolist()
    with veloxpatch.patched(model, algo, tokenizer=TOK, budget=40, **opts) as patch:
        patch.keep_snapshots = True
        alone = serve(model, BoundedPromptCache(), DOC + ASK_B)
        store = BoundedPromptCache()
        toks, _, _ = serve(model, store, DOC + ask_long)
        after = serve(model, store, DOC + ASK_B)
        turn2 = serve(model, store, DOC + ask_long + toks[:-1] + ASK_A)
    assert after[2] == 0 and after[0] == alone[0]
    np.testing.assert_allclose(np.array(after[1]), np.array(alone[1]), atol=2e-4)
    assert turn2[2] >= len(DOC + ask_long)


def test_expected_attention_keeps_nothing_for_later():
    model = tiny_model("llama")
    with veloxpatch.patched(model, "expected_attention", budget=40) as patch:
        patch.keep_snapshots = True
        store = BoundedPromptCache()
        serve(model, store, DOC + ASK_A)
        assert len(store) == 0


def test_the_kept_cache_is_the_prompt_uncompressed_and_continues_the_prompt():
    model = tiny_model("llama")
    with veloxpatch.patched(model, "snapkv", budget=24, window=8) as patch:
        patch.keep_snapshots = True
        caches = model.make_cache()
        prompt = DOC + ASK_A
        toks, _ = greedy(model, mx.array(prompt), n=5, prompt_cache=caches)
        assert caches[0].rows <= 24 + 8  # the working cache was compressed
        tokens, kept, kind = kept_for_later(prompt + toks, caches)
    assert tokens == prompt and kind == "user"
    assert all(c.rows == len(prompt) and c.offset == len(prompt) for c in kept)
    assert all(c.in_prompt for c in kept)  # the next request continues the prompt


def test_h2o_keeps_nothing_for_later_and_full_keeps_its_cache():
    model = tiny_model("llama")
    for algo, opts, stored in (("h2o", dict(budget=24), False), ("full", {}, True)):
        with veloxpatch.patched(model, algo, **opts) as patch:
            patch.keep_snapshots = True
            store = BoundedPromptCache()
            serve(model, store, DOC + ASK_A)
            assert (len(store) == 1) == stored, algo


@pytest.mark.parametrize("tail", [32, 0])
def test_a_short_kvzap_request_reserves_what_it_and_its_snapshot_hold(tail):
    # capped by its tokens, the reservation still covers the working cache, its
    # prompt-end snapshot (a compressed cache too) and the tail buffers in it
    from veloxpatch.memory import kv_bytes
    from veloxpatch.serve.admission import KVEstimate

    model = tiny_model("llama")
    opts = dict(budget=256, chunk=512, tail=tail, scorer=SCORER)
    opts = resolve_options(model, opts)  # (buffers grow to the budget)
    prompt = DOC + ASK_A
    with veloxpatch.patched(model, "kvzap", **opts) as patch:
        patch.keep_snapshots = True
        need = KVEstimate(patch).request_bytes(len(prompt), 6)
        cache = model.make_cache()
        toks, _ = greedy(model, mx.array(prompt), n=6, prompt_cache=cache)
        held = kv_bytes(cache)
        tokens, kept, _ = kept_for_later(prompt + toks, cache)
    assert tokens == prompt and held + kv_bytes(kept) <= need
    # the snapshot holds no prompt-only buffers (the tail) in any layer
    assert all(c.tail_x is None and c.tail_queries is None for c in kept)


@pytest.mark.parametrize("algo, opts", REPLAY_ARMS)
@pytest.mark.parametrize("n", [20, 250])
def test_the_reservation_covers_the_request_and_what_it_leaves(algo, opts, n):
    # the working cache and the entry kept for later, each with its side state;
    # a prompt shorter than the budget keeps its rows only (the snapshot too)
    from veloxpatch.memory import kv_bytes
    from veloxpatch.serve.admission import KVEstimate

    model = tiny_model("llama")
    prompt = prompt_tokens(n, seed=9).tolist()
    with veloxpatch.patched(model, algo, **resolve_options(model, opts)) as patch:
        patch.keep_snapshots = True
        need = KVEstimate(patch).request_bytes(n, 6)
        cache = model.make_cache()
        toks, _ = greedy(model, mx.array(prompt), n=6, prompt_cache=cache)
        kept = kept_for_later(prompt + toks, cache)[1]
        held = kv_bytes(cache) + (kv_bytes(kept) if kept is not cache else 0)
    assert 0 < held <= need, (held, need)


def test_a_kvzap_request_is_priced_below_the_full_cache_it_replaces():
    # reading holds budget + one chunk, at most the prompt; then the budget and
    # the snapshot, a compressed cache too: never mlx-lm's whole prompt
    from veloxpatch.serve.admission import KVEstimate

    model = tiny_model("llama")
    opts = resolve_options(model, dict(budget=64, chunk=512, scorer=SCORER))
    with veloxpatch.patched(model, "kvzap", **opts) as patch:
        est = KVEstimate(patch)
        for n in (30, 300, 3000):
            assert est.request_bytes(n, 256) < est.full_bytes(n, 256)


def test_the_reservation_counts_the_snapshot():
    from veloxpatch.serve.admission import KVEstimate

    model = tiny_model("llama")
    with veloxpatch.patched(model, "snapkv", budget=40) as snap:
        with_snapshot = KVEstimate(snap).request_bytes(2000, 16)
    with veloxpatch.patched(model, "streaming_llm", budget=40) as plain:
        without = KVEstimate(plain).request_bytes(2000, 16)
    assert with_snapshot > without


@pytest.mark.parametrize("algo", ["snapkv", "kvzip"])
def test_a_request_continuing_a_kept_cache_is_kept_for_the_next_turn(algo):
    """Turn 2 starts from turn 1's kept cache; what it leaves covers turn 2's
    prompt, so turn 3 reuses that."""
    from test_kvzip import TOK

    model = tiny_model("llama")
    opts = dict(budget=24, window=8)
    with veloxpatch.patched(model, algo, tokenizer=TOK, **opts) as patch:
        patch.keep_snapshots = True
        store = BoundedPromptCache()
        first = DOC + ASK_A
        toks, _, _ = serve(model, store, first)
        second = first + toks + ASK_B
        _, _, reused = serve(model, store, second)
        assert reused >= len(first)
        _, _, again = serve(model, store, second + ASK_A)
        assert again >= len(second)


def test_the_same_prompt_again_has_a_token_left_to_prefill():
    model = tiny_model("llama")
    with veloxpatch.patched(model, "snapkv", budget=24, window=8) as patch:
        patch.keep_snapshots = True
        store = BoundedPromptCache()
        first = serve(model, store, DOC + ASK_A)
        again = serve(model, store, DOC + ASK_A)
    assert again[2] == len(DOC + ASK_A) - 1 and again[0] == first[0]


@pytest.mark.parametrize(
    "algo,opts,reused",
    [
        ("expected_attention", dict(budget=40), False),
        ("h2o", dict(budget=200), False),
        ("snapkv", dict(budget=24, window=8), True),
    ],
)
def test_a_segment_cache_trimmed_past_another_question_is_reused_only_if_exact(
    algo, opts, reused
):
    """mlx-lm's server also keeps the cache at the end of a message, mid-prompt
    (a "user" entry, not seen by kept_for_later). Trimmed back to the shared
    document it must be the state the document alone leaves: not so where
    running statistics keep the first user's question (expected_attention's
    query moments, h2o's accumulated attention), so that entry is refused."""
    import copy

    model = tiny_model("llama")
    with veloxpatch.patched(model, algo, **opts) as patch:
        patch.keep_snapshots = True
        alone = serve(model, BoundedPromptCache(), DOC + ASK_B)
        store = BoundedPromptCache()
        cache = model.make_cache()
        first = DOC + ASK_A
        model(mx.array(first)[None], cache=cache)  # a prefill chunk, prompt going on
        mx.eval([c.state for c in cache])
        store.insert_cache(KEY, first, copy.deepcopy(cache), cache_type="user")
        after = serve(model, store, DOC + ASK_B)
    assert (after[2] >= len(DOC)) == reused, after[2]
    assert after[0] == alone[0]
    np.testing.assert_allclose(np.array(after[1]), np.array(alone[1]), atol=2e-4)


def serve_with_system(model, store, system, ask, n=6):
    """`serve`, with the system prompt's caches inserted as it is read, as
    mlx-lm's server does with a request's system segment."""
    prompt = system + ask
    cache, rest = store.fetch_nearest_cache(KEY, prompt)
    if cache is None:
        cache, rest = model.make_cache(), prompt
    head = len(system) - (len(prompt) - len(rest))
    if head > 0:
        model(mx.array(rest[:head])[None], cache=cache)
        store.insert_cache(KEY, system, copy.deepcopy(cache), cache_type="system")
        rest = rest[head:]
    toks, rows = greedy(model, mx.array(rest), n=n, prompt_cache=cache)
    store.insert_cache(KEY, prompt + toks, cache)
    return toks, rows, len(prompt) - len(rest) - max(head, 0)


@pytest.mark.parametrize(
    "algo,opts",
    [
        ("kivi", dict(bits=2, group=32, residual=8)),
        # keys rounded for the system prompt's queries: its entry keeps them
        ("kivi", dict(bits=2, group=32, residual=8)),
        ("streaming_llm", dict(budget=40)),
        ("kvzip", dict(budget=40)),
    ],
)
def test_users_sharing_a_system_prompt_reuse_it_after_another_users_request(algo, opts):
    """A finished request's entry extends the shared system prompt's entry but
    cannot be trimmed back to it (a quantized group, an eviction, a compression
    past it): the system prompt's entry stays, and the next user with the same
    system prompt starts from it, with what that user gets alone."""
    from test_kvzip import TOK

    model = tiny_model("llama", head_dim=32)
    system = prompt_tokens(60, seed=21).tolist()
    with veloxpatch.patched(model, algo, tokenizer=TOK, **opts) as patch:
        patch.keep_snapshots = True
        alone = serve_with_system(model, BoundedPromptCache(), system, ASK_B)
        store = BoundedPromptCache()
        assert serve_with_system(model, store, system, ASK_A)[2] == 0
        after = serve_with_system(model, store, system, ASK_B)
    assert after[2] == len(system)
    assert after[0] == alone[0]
    np.testing.assert_allclose(np.array(after[1]), np.array(alone[1]), atol=2e-4)


def serve_one_at_a_time(model, store, system, ask, step=16):
    """`serve` as the server runs a request one at a time: the system
    prompt's entry kept first (`keep_system`), the request from there."""
    store.keep_system(model, KEY, system + ask, len(system), step)
    return serve(model, store, system + ask)


ONE_AT_A_TIME = [
    ("kvzip", dict(budget=40)),
    ("kivi", dict(bits=2, group=32, residual=8)),
    ("snapkv", dict(budget=24, window=8)),
    ("kivi", dict(bits=2, group=32, residual=8)),
]


@pytest.mark.parametrize("algo,opts", ONE_AT_A_TIME)
def test_requests_served_one_at_a_time_keep_the_system_prompt(algo, opts, monkeypatch):
    """mlx-lm's one-at-a-time path inserts only a request's end, which kvzip's
    compression (or a quantized group) cannot be trimmed back to: the system
    prompt's own entry, read once, lets the next user start from it, with
    what that user gets alone (snapkv's end entry is trimmed back to it)."""
    from test_kvzip import TOK

    from veloxpatch.serve import prompt_cache as kv

    reads = []
    pieces = kv.prompt_pieces
    monkeypatch.setattr(kv, "prompt_pieces", lambda *a: reads.append(a) or pieces(*a))

    model = tiny_model("llama", head_dim=32)
    system = prompt_tokens(60, seed=21).tolist()
    with veloxpatch.patched(model, algo, tokenizer=TOK, **opts) as patch:
        patch.keep_snapshots = True
        alone = serve_one_at_a_time(model, BoundedPromptCache(), system, ASK_B)
        store = BoundedPromptCache()
        reads.clear()
        assert serve_one_at_a_time(model, store, system, ASK_A)[2] == len(system)
        after = serve_one_at_a_time(model, store, system, ASK_B)
    assert len(reads) == 1  # the system prompt read once, for the first user
    assert after[2] >= len(system)
    assert after[0] == alone[0]
    np.testing.assert_allclose(np.array(after[1]), np.array(alone[1]), atol=2e-4)


@pytest.mark.parametrize("algo,opts", ONE_AT_A_TIME[:2])
def test_the_system_prompt_is_never_read_in_a_lone_token(algo, opts):
    """Calls of 59 would leave the system prompt's 60th token alone, where the
    phase must guess whether the prompt ended (and kivi quantizes after every
    call): it joins the call before it, so the entry is the one a single call
    of 60 leaves."""
    from test_kvzip import TOK

    model = tiny_model("llama", head_dim=32)
    system = prompt_tokens(60, seed=21).tolist()
    with veloxpatch.patched(model, algo, tokenizer=TOK, **opts) as patch:
        patch.keep_snapshots = True
        runs = [
            serve_one_at_a_time(model, BoundedPromptCache(), system, ASK_B, step)
            for step in (60, 59)
        ]
    assert runs[0][0] == runs[1][0]
    np.testing.assert_allclose(np.array(runs[1][1]), np.array(runs[0][1]), atol=2e-4)


def test_a_system_prompt_compressed_alone_is_compressed_once_for_every_user(
    monkeypatch,
):
    """`--compress-system-prompt`: the entry is the system prompt read alone and
    compressed by kvzip's reconstruction pass, once; each user's question is
    read on it, so a user gets the same alone as after another user."""
    from test_kvzip import TOK

    from veloxpatch.memory import full_kv_bytes, kv_bytes

    model = tiny_model("llama", head_dim=32)
    system = prompt_tokens(60, seed=21).tolist()
    with veloxpatch.patched(model, "kvzip", tokenizer=TOK, budget=24) as patch:
        passes = []
        finish = patch.cache_cls.finish_context

        def compress(caches, ids):
            passes.append(ids)
            finish(model, caches, ids, TOK)
            patch.end_prompt(caches)

        def keep(store, ask):
            store.keep_system(model, KEY, system + ask, len(system), 16, compress)

        patch.keep_snapshots = True
        fresh = BoundedPromptCache()
        keep(fresh, ASK_B)
        alone = serve(model, fresh, system + ASK_B)
        store = BoundedPromptCache()
        passes.clear()
        keep(store, ASK_A)
        entry = store._trie.get(KEY, system).prompt_cache
        assert serve(model, store, system + ASK_A)[2] == len(system)
        keep(store, ASK_B)
        after = serve(model, store, system + ASK_B)
    assert passes == [system]  # once, over the system prompt alone
    assert kv_bytes(entry) < full_kv_bytes(entry) / 2  # compressed
    assert after[2] >= len(system)
    assert after[0] == alone[0]
    np.testing.assert_allclose(np.array(after[1]), np.array(alone[1]), atol=2e-4)


@pytest.mark.parametrize("algo,opts", REPLAY_ARMS)
def test_the_same_prompt_again_continues_from_its_entry(algo, opts):
    """A retry (the same prompt): every algorithm whose entry holds the prompt
    reuses all but its last token, and gives the same tokens and logprobs.
    kvzip's and kvzap's entries were compressed as the prompt ended: their
    last token's logits come from the entry, not from trimming it."""
    from test_kvzip import TOK

    model = tiny_model("llama")
    opts = resolve_options(model, opts)
    with veloxpatch.patched(model, algo, tokenizer=TOK, **opts) as patch:
        patch.keep_snapshots = True
        store = BoundedPromptCache()
        first = serve(model, store, DOC + ASK_A)
        assert first[2] == 0
        again = serve(model, store, DOC + ASK_A)
        thrice = serve(model, store, DOC + ASK_A)
    for retry in (again, thrice):
        assert retry[2] == len(DOC + ASK_A) - 1
        assert retry[0] == first[0]
        np.testing.assert_allclose(np.array(retry[1]), np.array(first[1]), atol=1e-5)


def serve_batched(model, store, prompts, n=6):
    """Requests inserted together into one of mlx-lm's BatchGenerators, as its
    server's batched path runs them (fetch, insert, keep each finished cache):
    (tokens, logprob rows, cached prompt tokens) per prompt."""
    gen = BatchGenerator(ReplayingModel(model), stop_tokens=[[-1]], prefill_step_size=7)
    uids, cached = [], []
    for p in prompts:
        cache, rest = store.fetch_nearest_cache(KEY, p)
        uids += gen.insert([rest], [n], caches=[cache], all_tokens=[p[: -len(rest)]])
        cached.append(len(p) - len(rest))
    toks, rows, done = {u: [] for u in uids}, {u: [] for u in uids}, 0
    while done < len(uids):
        for r in gen.next_generated():
            toks[r.uid].append(r.token)
            rows[r.uid].append(r.logprobs)
            if r.finish_reason is not None:
                store.insert_cache(KEY, r.all_tokens, r.prompt_cache)
                done += 1
    gen.close()
    return [(toks[u], mx.stack(rows[u]), c) for u, c in zip(uids, cached)]


@pytest.mark.parametrize("algo,opts", REPLAY_ARMS[1:3])
def test_a_retry_inside_a_batch_continues_from_its_entry(algo, opts):
    """In a batch (mlx-lm's server under load), a retry reads nothing: its
    first token comes from the logits its entry kept, beside a follow-up whose
    one new token the same model call reads, and a new prompt being read.
    Each gets what it gets alone."""
    model = tiny_model("llama")
    opts = resolve_options(model, opts)
    other = prompt_tokens(66, seed=31).tolist()  # ends its prompt with DOC + ASK_A
    waves = [[DOC + ASK_A, other], [DOC + ASK_A, other + [7], ASK_B * 4]]
    with veloxpatch.patched(model, algo, **opts) as patch:
        patch.keep_snapshots = True
        batched, alone = BoundedPromptCache(), BoundedPromptCache()
        first = serve_batched(model, batched, waves[0])
        again = serve_batched(model, batched, waves[1])
        ref = [serve(model, alone, p) for wave in waves for p in wave]
    assert [r[2] for r in again] == [len(DOC + ASK_A) - 1, len(other), 0]
    assert again[0][0] == first[0][0]
    for got, want in zip(first + again, ref):
        assert got[0] == want[0] and got[2] == want[2]
        np.testing.assert_allclose(np.array(got[1]), np.array(want[1]), atol=1e-4)


@pytest.mark.parametrize(
    "algo,opts",
    [("kvzip", dict(budget=256)), ("snapkv", dict(budget=256, window=8))],
)
def test_a_short_prompts_entry_holds_no_more_than_mlx_lms_cache(algo, opts):
    """A 33-token prompt under a budget of 256: its entry holds its rows (and
    kvzip's query buffer, the last token's logits), not the 256-row buffer
    step; mlx-lm's own cache for the request holds 256 rows."""
    from mlx_lm.models.cache import make_prompt_cache
    from test_kvzip import TOK

    model = tiny_model("llama")
    prompt = prompt_tokens(33, seed=5).tolist()
    plain = make_prompt_cache(model)
    greedy(model, mx.array(prompt), n=4, prompt_cache=plain)
    mlx_bytes = sum(c.nbytes for c in plain)
    with veloxpatch.patched(model, algo, tokenizer=TOK, **opts) as patch:
        patch.keep_snapshots = True
        store = BoundedPromptCache()
        serve(model, store, prompt, n=4)
    assert len(store) == 1
    assert store.nbytes <= mlx_bytes, (store.nbytes, mlx_bytes)
