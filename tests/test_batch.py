"""mlx-lm batch generation (BatchGenerator, batch_generate) on patched models.

Every sequence of a batch must get what it gets alone: the same tokens and the
same kept sets (positions per layer and KV head), whatever the others do;
`full` must be bit-identical to unpatched mlx-lm's batched output.
"""

import copy
from types import SimpleNamespace

import mlx.core as mx
import pytest
from helpers import greedy
from mlx_lm.generate import BatchGenerator, batch_generate, generate_step
from mlx_lm.models.cache import make_prompt_cache
from test_contract import HEAD_DIM, variants
from tiny import ARCHS, CONFIGS, prompt_tokens, resolve_options, tiny_model

import veloxpatch
from veloxpatch.caches.snapkv import SnapKVCache
from veloxpatch.errors import UnsupportedCacheOperation, UnsupportedModelError

TOKENIZER = SimpleNamespace(eos_token_ids=[-1], decode=lambda t: "")
LENGTHS, MAX_TOKENS = (19, 33, 50), [4, 10, 7]  # sequences finish at different steps
STEP = 16  # prefill chunk: the longer prompts take several
ALGOS = {
    "snapkv": dict(budget=16, window=4),
    "h2o": dict(budget=12, sinks=2),
    "tova": dict(budget=12, sinks=2),
    "kivi": dict(bits=8, residual=4),
    "a2ats": dict(window=8, sinks=2, top=1.0),
}


def prompts():
    return [prompt_tokens(n, seed=s).tolist() for s, n in enumerate(LENGTHS, 1)]


def kept(caches):
    """What each layer holds: tokens seen and the position of every row."""
    ours = [c for c in caches if hasattr(c, "positions_view")]
    return [(c.offset, c.positions_view().tolist()) for c in ours]


def run_batch(model, **kw):
    return batch_generate(
        model,
        TOKENIZER,
        prompts(),
        max_tokens=MAX_TOKENS,
        prefill_step_size=STEP,
        return_token_ids=True,
        **kw,
    )


def check_alone(model, patch, token_ids, caches, max_tokens=MAX_TOKENS):
    """Each prompt alone through mlx_lm's generate_step: same tokens, kept sets;
    nothing of a call (its layer input, the model's o_proj) is left in a cache."""
    for i, p in enumerate(prompts()):
        assert all(getattr(c, "layer_input", None) is None for c in caches[i])
        own = patch.make_cache()
        toks, rows = greedy(model, mx.array(p), max_tokens[i], STEP, prompt_cache=own)
        if token_ids[i] != toks and grids_from_queries(patch):
            assert_first_swap_is_a_near_tie(token_ids[i], toks, rows)
        else:
            assert token_ids[i] == toks, f"sequence {i}"
        if kept(caches[i]) != kept(own) and patch.algo == "knorm":
            assert_swaps_are_near_ties(caches[i], own)
        else:
            assert kept(caches[i]) == kept(own), f"sequence {i}"
        if patch.algo != "full":  # full's extracted rows drop the spare capacity
            assert sum(c.nbytes for c in caches[i]) == sum(c.nbytes for c in own)


def grids_from_queries(patch) -> bool:
    """Quantized rows whose map or rounding is set from the queries' moment."""
    quant = getattr(patch.options, "quant", None)
    return quant is not None and quant.rounds


def assert_first_swap_is_a_near_tie(batched, alone, logprobs, tol=0.02):
    """Queries computed in a batch of three and alone differ by float noise
    (BLAS kernels differ by shape); rows at 2 bits whose grid they set may then
    round a code the other way and move the logits a little. Greedy tokens may
    part where the alone run's two best are within `tol` (snapkv-kv2-basis:
    0.0089 on the tiny model), never elsewhere."""
    step = next(j for j, (a, b) in enumerate(zip(batched, alone)) if a != b)
    row = logprobs[step]
    gap = (row[alone[step]] - row[batched[step]]).item()
    assert 0 <= gap <= tol, (step, gap)


def assert_swaps_are_near_ties(batched, alone, rtol=1e-4):
    """knorm ranks keys by their norm: keys computed in a batch of three and
    alone differ by float noise (BLAS kernels differ by shape), which may swap
    rows whose norms tie to that noise. Every row one set has and the other
    lacks must have a norm within `rtol` of a row the other has instead."""
    ours = [(a, b) for a, b in zip(batched, alone) if hasattr(a, "positions_view")]
    for a, b in ours:
        assert a.offset == b.offset and a.rows == b.rows
        pa, pb = a.positions_view().tolist(), b.positions_view().tolist()
        na = mx.linalg.norm(a._view()[0], axis=-1).tolist()
        nb = mx.linalg.norm(b._view()[0], axis=-1).tolist()
        for h in range(len(pa[0])):
            only_a = [n for p, n in zip(pa[0][h], na[0][h]) if p not in pb[0][h]]
            only_b = [n for p, n in zip(pb[0][h], nb[0][h]) if p not in pa[0][h]]
            assert len(only_a) == len(only_b) <= 2, (a.layer, h)
            for x, y in zip(sorted(only_a), sorted(only_b)):
                assert abs(x - y) <= rtol * max(abs(x), abs(y)), (a.layer, h, x, y)


def model_for(arch, algo):
    """Quantized rows need heads of 32 channels (kivi's smallest group)."""
    if algo != "kivi":
        return tiny_model(arch)
    config = CONFIGS[arch]
    nested = "text_config" in config
    wide = dict(config["text_config"] if nested else {}, hidden_size=128)
    if "head_dim" in (config["text_config"] if nested else config):
        wide["head_dim"] = 32
    return tiny_model(arch, **({"text_config": wide} if nested else wide))


def apply_or_skip(model, algo, opts):
    try:
        return veloxpatch.apply(model, algo, **opts)
    except UnsupportedModelError as e:  # A2ATS refuses YaRN ropes
        pytest.skip(f"{algo} refuses this model: {e}")


@pytest.mark.parametrize("arch", ARCHS)
def test_full_batches_are_bit_identical_to_unpatched_mlx_lm(arch):
    model = tiny_model(arch)
    ref = run_batch(model, return_logprobs=True)
    with veloxpatch.patched(model, "full"):
        got = run_batch(model, return_logprobs=True)
    assert got.token_ids == ref.token_ids and got.logprobs == ref.logprobs


@pytest.mark.parametrize("algo", list(ALGOS))
@pytest.mark.parametrize("arch", ARCHS)
def test_each_sequence_of_a_batch_gets_what_it_gets_alone(arch, algo):
    model = model_for(arch, algo)
    patch = apply_or_skip(model, algo, ALGOS[algo])
    try:
        got = run_batch(model, return_prompt_caches=True)
        check_alone(model, patch, got.token_ids, got.caches)
    finally:
        patch.restore()


@pytest.mark.parametrize("algo,opts", variants())
def test_every_algorithm_batches(algo, opts):
    model = tiny_model("llama", head_dim=HEAD_DIM)
    opts = resolve_options(model, opts)
    with veloxpatch.patched(model, algo, **opts) as patch:
        got = run_batch(model, return_prompt_caches=True)
        check_alone(model, patch, got.token_ids, got.caches)


def generate_with_a_late_joiner(model):
    """Two prompts start; after three steps (and a prompt-cache extraction, as
    mlx-lm's server does) the third joins the running batch."""
    gen = BatchGenerator(model, stop_tokens=[[-1]], prefill_step_size=STEP)
    first = gen.insert(prompts()[:2], MAX_TOKENS[:2])
    tokens, caches = {}, {}

    def step():
        for r in gen.next_generated():
            tokens.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None:
                caches[r.uid] = r.prompt_cache

    for _ in range(3):
        step()
    extracted = gen.extract_cache(first)  # copies: the batch goes on unchanged
    held = [kept(c) for c, _ in extracted.values()]
    late = gen.insert(prompts()[2:], MAX_TOKENS[2:])
    while len(caches) < 3:
        step()
    assert [kept(c) for c, _ in extracted.values()] == held
    gen.close()
    uids = first + late
    return [tokens[u] for u in uids], [caches[u] for u in uids]


@pytest.mark.parametrize("algo", ["full", "snapkv", "h2o", "kivi"])
def test_a_sequence_joining_a_running_batch_changes_nothing(algo):
    model = tiny_model("qwen3", head_dim=32)  # kivi quantizes groups of 32
    ref, _ = generate_with_a_late_joiner(model)
    with veloxpatch.patched(model, algo, **ALGOS.get(algo, {})) as patch:
        token_ids, caches = generate_with_a_late_joiner(model)
        check_alone(model, patch, token_ids, caches)
    if algo == "full":
        assert token_ids == ref


def prefilled(model, make):
    """Caches that already hold a first turn (what mlx-lm's server reuses)."""
    out = []
    for n, seed in ((12, 5), (30, 6)):
        caches = make()
        history = prompt_tokens(n, seed=seed)
        for _ in generate_step(history, model, max_tokens=0, prompt_cache=caches):
            pass
        out.append(caches)
    return out


@pytest.mark.parametrize("algo", ["full", "snapkv"])
def test_a_second_turn_batches_on_caches_that_hold_the_first(algo):
    model = tiny_model("llama")
    turn = [prompt_tokens(n, seed=s).tolist() for n, s in ((5, 7), (9, 8))]
    kw = dict(max_tokens=6, prefill_step_size=STEP, return_token_ids=True)
    ref = batch_generate(
        model,
        TOKENIZER,
        turn,
        prompt_caches=prefilled(model, lambda: make_prompt_cache(model)),
        return_logprobs=True,
        **kw,
    )
    with veloxpatch.patched(model, algo, **ALGOS.get(algo, {})) as patch:
        given = prefilled(model, patch.make_cache)
        held = [kept(c) for c in given]
        got = batch_generate(
            model,
            TOKENIZER,
            turn,
            prompt_caches=given,
            return_prompt_caches=True,
            return_logprobs=True,
            **kw,
        )
        assert [kept(c) for c in given] == held  # mlx-lm's caches stay as given
        for i, own in enumerate(prefilled(model, patch.make_cache)):
            toks, _ = greedy(model, mx.array(turn[i]), 6, STEP, prompt_cache=own)
            assert got.token_ids[i] == toks and kept(got.caches[i]) == kept(own)
    if algo == "full":
        assert got.token_ids == ref.token_ids and got.logprobs == ref.logprobs


def test_an_algorithm_that_does_not_batch_is_refused_in_one_line(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(SnapKVCache, "batchable", False)
    monkeypatch.setattr(SnapKVCache, "batch_refusal", "no reason")
    calls = []
    with veloxpatch.patched(model, "snapkv", budget=16, window=4) as patch:
        own = [patch.make_cache(probe=calls.append) for _ in LENGTHS]
        with pytest.raises(UnsupportedCacheOperation, match="no reason") as err:
            run_batch(model, prompt_caches=own)
    assert "\n" not in str(err.value) and not calls  # refused before any work


def test_deep_copies_keep_one_phase_per_sequence():
    model = tiny_model("llama")
    with veloxpatch.patched(model, "snapkv", budget=16, window=4) as patch:
        caches = patch.make_cache()
        model(mx.array(prompts()[1])[None], cache=caches)
        before = kept(caches)
        twin = copy.deepcopy(caches)
        assert len({id(c.phase) for c in twin}) == 1
        assert twin[0].phase is not caches[0].phase
        assert [r() for r in twin[0].phase.members] == twin
        for t in ([[3]], [[4]], [[5]]):  # the copy ends its prompt, evicts
            model(mx.array(t), cache=twin)
        assert kept(caches) == before and twin[0].offset == caches[0].offset + 3
        assert twin[0].phase.ends == 1 and caches[0].phase.ends == 0


@pytest.mark.parametrize(
    "algo,opts",
    [
        ("kivi", dict(bits=8, residual=4)),
        ("snapkv", dict(budget=40, kv_bits=8, kv_residual=4)),
    ],
)
def test_deep_copies_of_quantized_rows_are_independent(algo, opts):
    # the quantized store is an object, not an array: the server's prompt
    # cache copies once shared it with the sequence they were taken from
    model = tiny_model("llama", head_dim=HEAD_DIM)
    with veloxpatch.patched(model, algo, **opts) as patch:
        caches = patch.make_cache()
        model(prompt_tokens(70)[None], cache=caches)
        patch.end_prompt()  # the prompt ends: rows quantized
        assert caches[0].store is not None and caches[0].store.rows
        twin = copy.deepcopy(caches)
        held = [(c.rows, c.slots, c.quantized) for c in twin]
        for t in prompt_tokens(40, seed=2).tolist():  # flushes more groups
            model(mx.array([[t]]), cache=caches)
        assert [(c.rows, c.slots, c.quantized) for c in twin] == held
        assert greedy(model, prompt_tokens(3, seed=5), n=2, prompt_cache=twin)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_kvzip_reconstructs_each_prompt_of_a_batch_from_its_own_ids(arch, monkeypatch):
    """Told the tokenizer, kvzip reconstructs every prompt of a batch, each
    from its own ids (not the padding), on its own caches: each sequence gets
    what it gets alone."""
    from test_kvzip import TOK

    from veloxpatch.caches.kvzip import reconstruct as module

    contexts, real = [], module.reconstruct

    def counted(model, caches, zipped, context, tokenizer):
        contexts.append(list(context))
        return real(model, caches, zipped, context, tokenizer)

    model = tiny_model(arch)
    with veloxpatch.patched(model, "kvzip", tokenizer=TOK, budget=12) as patch:
        monkeypatch.setattr(module, "reconstruct", counted)
        got = run_batch(model, return_prompt_caches=True)
        assert sorted(contexts) == sorted(prompts())
        check_alone(model, patch, got.token_ids, got.caches)
