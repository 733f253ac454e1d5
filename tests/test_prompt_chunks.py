"""Compression during the prompt (`compress="chunks"`): rows held never exceed
budget + one chunk at any point of a prefill, whatever the caller's prefill
chunks; the algorithms that evict every call hold budget + the caller's chunk.
Tiny models; the masked-dense oracle and the rest of the contract run over the
chunked variants in test_contract.py."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import greedy, step_peak
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.errors import OptionError

PROMPT = prompt_tokens(150).tolist()
CHUNK = 16
CHUNKED = {
    "snapkv": dict(budget=24, window=4),
    "pyramidkv": dict(budget=24, window=4, beta=4),
    "adakv": dict(budget=24, window=4),
    "expected_attention": dict(budget=24, sinks=2, window=4),
}
PER_CALL = {  # evict after every call: the caller's chunk is theirs
    "streaming_llm": dict(budget=24, sinks=2),
    "knorm": dict(budget=24, sinks=2),
    "h2o": dict(budget=24, sinks=2),
    "tova": dict(budget=24, sinks=2),
    "keyformer": dict(budget=24, sinks=1, recent=3),
}


def rows_seen(caches):
    """Record, inside every attention call, the rows each cache attends over
    (what it holds then, the new rows included)."""
    seen = []
    for c in caches:
        original = c.attention

        def attention(q, keys, values, mask, scale, c=c, original=original):
            seen.append((c.layer, keys.shape[2]))
            return original(q, keys, values, mask, scale)

        c.attention = attention
    return seen


def run(algo, opts, step, n=6, prompt=PROMPT, **model_args):
    model = tiny_model("llama", **model_args)
    with veloxpatch.patched(model, algo, **opts) as patch:
        caches = patch.make_cache()
        seen = rows_seen(caches)
        toks, rows = greedy(model, mx.array(prompt), n, step, prompt_cache=caches)
        bounds = [c.head_bound(c.row_budget()) for c in caches]
    return toks, np.array(rows), seen, bounds


@pytest.mark.parametrize("step", [1, 7, 64])
@pytest.mark.parametrize("algo", sorted(CHUNKED))
def test_chunked_rows_never_exceed_budget_plus_one_chunk(algo, step):
    opts = {**CHUNKED[algo], "compress": "chunks", "chunk": CHUNK}
    _, _, seen, bounds = run(algo, opts, step)
    assert max(n for _, n in seen) > CHUNKED[algo]["budget"]  # came, were cut
    for layer, n in seen:
        assert n <= bounds[layer] + CHUNK, (layer, n)


@pytest.mark.parametrize("step", [1, 7, 64])
@pytest.mark.parametrize("algo", sorted(PER_CALL))
def test_per_call_evictors_hold_budget_plus_the_callers_chunk(algo, step):
    _, _, seen, bounds = run(algo, PER_CALL[algo], step)
    for layer, n in seen:
        assert n <= bounds[layer] + step, (layer, n)


@pytest.mark.parametrize("algo", sorted(CHUNKED))
def test_prompt_end_mode_holds_the_whole_prompt(algo):
    # the control: what "chunks" removes
    _, _, seen, _ = run(algo, CHUNKED[algo], 64)
    assert max(n for _, n in seen) >= len(PROMPT) - 1


@pytest.mark.parametrize("algo", sorted(CHUNKED))
def test_chunks_and_prompt_end_agree_when_the_budget_exceeds_the_context(algo):
    big = {**CHUNKED[algo], "budget": 2000}  # every layer of the pyramid too
    a = run(algo, big, 7)
    b = run(algo, {**big, "compress": "chunks", "chunk": CHUNK}, 7)
    assert a[0] == b[0]
    np.testing.assert_array_equal(a[1], b[1])


@pytest.mark.parametrize("algo", sorted(CHUNKED))
def test_the_callers_chunking_changes_nothing(algo):
    """Cuts fall at multiples of `chunk` whatever the prefill chunks: the same
    queries score the same rows (logprobs to float noise)."""
    opts = {**CHUNKED[algo], "compress": "chunks", "chunk": CHUNK}
    runs = [run(algo, opts, step) for step in (5, CHUNK, 2048)]
    for toks, rows, _, _ in runs[1:]:
        assert toks == runs[0][0]
        np.testing.assert_allclose(rows, runs[0][1], atol=1e-4)


@pytest.mark.parametrize("algo", ["snapkv", "expected_attention"])
def test_quantized_rows_wait_for_the_prompt_end_whatever_the_chunking(algo):
    """With `kv_bits` the prompt is held at full precision until it ends, as
    without: a later prefill chunk never reads rows quantized by an earlier."""
    opts = {**CHUNKED[algo], "kv_bits": 2, "kv_residual": 4}
    runs = [run(algo, opts, step, head_dim=32) for step in (5, 2048)]
    assert runs[1][0] == runs[0][0]
    np.testing.assert_allclose(runs[1][1], runs[0][1], atol=1e-4)


def test_chunked_compression_changes_what_is_kept():
    # the chunks' own windows choose, not the last window alone: outputs differ
    a = run("snapkv", CHUNKED["snapkv"], 64, n=8)
    b = run("snapkv", {**CHUNKED["snapkv"], "compress": "chunks", "chunk": 16}, 64, n=8)
    assert np.abs(a[1] - b[1]).max() > 1e-3


@pytest.mark.parametrize(
    "opts,message",
    [
        (dict(compress="sometimes"), "compress"),
        (dict(compress="chunks", chunk=0), "chunk"),
        (dict(compress="chunks", lookahead=2), "lookahead"),
    ],
)
def test_bad_compress_options_are_refused(opts, message):
    model = tiny_model("llama")
    with pytest.raises(OptionError, match=message):
        veloxpatch.apply(model, "snapkv", budget=24, window=4, **opts)
    assert veloxpatch.api.patch_of(model) is None


def test_kvzip_has_no_chunked_mode():
    # its reconstruction pass scores the whole context: inherent to the method
    model = tiny_model("llama")
    with pytest.raises(OptionError, match="compress"):
        veloxpatch.apply(model, "kvzip", budget=24, compress="chunks")


def test_chunked_mode_bounds_reading_to_one_chunk_past_max_kv_bytes():
    """max_kv_bytes buys both modes the same rows (what is held once the prompt
    is read); while reading, the chunked mode holds at most one chunk more
    (its bound with decode=False, what the server reserves), inside every
    attention call of the prefill; the prompt-end mode holds the prompt."""
    from model_adapters import adapter_for
    from veloxpatch.caches.kv_budget import bound_bytes

    limit = 60_000
    peaks, budgets, reading = {}, {}, None
    for mode in ("chunks", "prompt_end"):
        model = tiny_model("llama")
        opts = dict(max_kv_bytes=limit, window=4, compress=mode, chunk=CHUNK)
        with veloxpatch.patched(model, "snapkv", **opts) as patch:
            budgets[mode] = patch.options.budget
            if mode == "chunks":
                dims = adapter_for(model).dims(model)
                reading = bound_bytes(patch.options, dims, 4, budgets[mode])
            caches = patch.make_cache()
            held = peaks[mode] = []
            for c in caches:
                original = c.attention

                def attention(
                    q,
                    keys,
                    values,
                    mask,
                    scale,
                    original=original,
                    kept=caches,
                    held=held,
                ):
                    held.append(sum(x.nbytes for x in kept))
                    return original(q, keys, values, mask, scale)

                c.attention = attention
            greedy(model, mx.array(PROMPT), 4, 64, prompt_cache=caches)
    assert budgets["chunks"] == budgets["prompt_end"]
    assert max(peaks["chunks"]) <= reading < max(peaks["prompt_end"])
    assert reading > limit  # the chunk is on top of what max_kv_bytes bought


def test_the_prompt_end_compresses_one_layer_at_a_time():
    """Quantized rows wait for the prompt's end, then are cut and quantized:
    each layer's compression is evaluated when it runs, so the step's peak
    does not grow with the layers (left lazy, every layer's compression and
    what it read were held at once until the next step: 3.7x at 16 layers)."""
    opts = dict(budget=200, window=4, kv_bits=2, kv_residual=4)
    assert step_peak(32, "snapkv", opts) < 3 * step_peak(2, "snapkv", opts)


def test_the_server_keeps_nothing_of_a_chunked_prompt_and_reserves_its_bound():
    from test_serve_policy import ASK_A, DOC, serve

    from veloxpatch.serve.admission import KVEstimate
    from veloxpatch.serve.prompt_cache import BoundedPromptCache

    model = tiny_model("llama")
    opts = dict(budget=24, window=4)
    with veloxpatch.patched(model, "snapkv", compress="chunks", **opts) as patch:
        patch.keep_snapshots = True
        store = BoundedPromptCache()
        serve(model, store, DOC + ASK_A)
        assert len(store) == 0  # its cuts read the question's queries
        chunked = KVEstimate(patch).request_bytes(5000, 16)
    with veloxpatch.patched(model, "snapkv", **opts) as patch:
        prompt_end = KVEstimate(patch).request_bytes(5000, 16)
    assert chunked < prompt_end / 5


def test_a_short_request_reserves_no_more_rows_than_its_tokens():
    # the bound of budget + a chunk is for a long prompt: a short request can
    # hold only its own tokens' rows, and reserving more refused it (413)
    from veloxpatch.memory import full_rows
    from veloxpatch.serve.admission import KVEstimate

    model = tiny_model("llama")
    opts = dict(budget=300, window=4, chunk=512, compress="chunks")
    with veloxpatch.patched(model, "snapkv", **opts) as patch:
        est = KVEstimate(patch)
        short, long = est.request_bytes(40, 8), est.request_bytes(5000, 16)
        per_row = est.patched_row + est.sliding_row
    assert short < long  # a long one: budget + chunk, whatever its length
    # one growth step of rows, plus snapkv's buffered queries and row scores
    assert short <= full_rows(48) * per_row * 1.5
    assert long == est.request_bytes(9000, 16)


def kvzip_calls(limit, monkeypatch):
    """A tiny model patched with kvzip under max_kv_bytes, and a count of the
    whole-model calls the patch let through. The count is installed before the
    patch, which then wraps it: the test's undo never puts back a stale wrapper
    of the patch on the model class every tiny llama shares."""
    from test_kvzip import TOK

    model = tiny_model("llama")
    calls = []
    real = type(model).__call__

    def counted(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(type(model), "__call__", counted)
    patch = veloxpatch.apply(model, "kvzip", tokenizer=TOK, max_kv_bytes=limit)
    return model, patch, calls


def test_kvzip_under_max_kv_bytes_reads_any_context_and_keeps_within_it(monkeypatch):
    """max_kv_bytes bounds what kvzip keeps once the prompt is read, as it does
    for every algorithm, whoever chose it: a context whose reconstruction pass
    holds more than the bytes (the prompt held as the unpatched model holds it)
    is read, in `prefill` and inside mlx-lm's generate, and kept within them."""
    from test_kvzip import TOK

    model, patch, calls = kvzip_calls(80_000, monkeypatch)
    caches = patch.prefill(PROMPT, tokenizer=TOK)
    assert sum(c.nbytes for c in caches) <= 80_000 and calls
    caches = patch.make_cache()
    greedy(model, mx.array(PROMPT), 2, 16, prompt_cache=caches)
    assert sum(c.nbytes for c in caches) <= 80_000
    patch.restore()


def test_kvzip_without_its_pass_is_not_refused_under_max_kv_bytes():
    """Without a reconstruction pass (no tokenizer) kvzip holds the prompt as
    snapkv does: nothing to refuse, and decode stays within the bytes."""
    model = tiny_model("llama")
    opts = dict(max_kv_bytes=80_000)
    with veloxpatch.patched(model, "kvzip", tokenizer=None, **opts) as patch:
        caches = patch.make_cache()
        greedy(model, mx.array(PROMPT), 4, 16, prompt_cache=caches)
        assert sum(c.nbytes for c in caches) <= 80_000


def test_kvzip_without_max_kv_bytes_takes_any_context():
    from test_kvzip import TOK

    model = tiny_model("llama")
    with veloxpatch.patched(model, "kvzip", tokenizer=TOK, budget=24) as patch:
        patch.prefill(PROMPT, tokenizer=TOK)
