"""A request's own KV budget (`"veloxpatch": {"max_kv_bytes": ...}`, serve/
admission.py), on tiny models: the field's checks (400s naming it), the caches
and reservation made with the request's options, and prompt-cache entries
that never cross budgets. The server end to end: test_serve.py."""

import mlx.core as mx
import pytest
from helpers import greedy
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.caches.kv_budget import bound_bytes, budget_for_bytes, kv_dtype_size
from veloxpatch.memory import kv_bytes
from veloxpatch.serve.admission import Budgets, KVEstimate
from veloxpatch.serve.checks import BadRequest, Limits, check_body
from veloxpatch.serve.prompt_cache import BoundedPromptCache

KEY = ("tiny", None, None)
LIMITS = Limits(vocab=512, context=4096)
ASK = [{"role": "user", "content": "hi"}]
PROMPT = prompt_tokens(200, seed=3).tolist()
N = len(PROMPT)


def body(field):
    return {"messages": ASK, "veloxpatch": field}


@pytest.mark.parametrize(
    "field, says",
    [
        ("8MB", "veloxpatch must be an object"),
        ([1], "veloxpatch must be an object"),
        ({"max_kv_bytes": "8MB", "budget": 3}, 'veloxpatch: unknown key(s) "budget"'),
        ({"max_kv_bytes": "lots"}, "veloxpatch.max_kv_bytes must be a share"),
        ({"max_kv_bytes": -5}, "veloxpatch.max_kv_bytes must be at least 1 byte"),
        ({"max_kv_bytes": True}, "veloxpatch.max_kv_bytes must be a share"),
        ({"max_kv_bytes": "120%"}, "at most 100%"),
    ],
)
def test_the_field_of_the_wrong_shape_is_a_400_naming_it(field, says):
    with pytest.raises(BadRequest) as e:
        check_body(body(field), "/v1/chat/completions", LIMITS)
    assert says in str(e.value)


@pytest.mark.parametrize(
    "field", [None, {}, {"max_kv_bytes": "8MB"}, {"max_kv_bytes": "20%"}]
)
def test_the_field_absent_empty_or_well_formed_passes(field):
    check_body(body(field), "/v1/chat/completions", LIMITS)


@pytest.fixture
def snapkv():
    model = tiny_model("llama")
    with veloxpatch.patched(model, "snapkv", budget=64, window=8) as patch:
        yield model, patch


def test_a_size_the_server_cannot_take_is_a_400_before_any_work(snapkv):
    model, patch = snapkv
    budgets = Budgets(patch, KEY, cap=10_000_000)
    for size, says in [
        ("20MB", "is more than the server's --kv-cap (10,000,000 bytes)"),
        ("1KB", "buys"),  # fewer rows than the sinks and the window
    ]:
        with pytest.raises(BadRequest) as e:
            budgets.of(body({"max_kv_bytes": size}), N)
        assert str(e.value).startswith("veloxpatch.max_kv_bytes"), str(e.value)
        assert says in str(e.value)
    assert budgets.of(body(None), N) is None
    assert budgets.of({"messages": ASK}, N) is None


@pytest.mark.parametrize("algo", ["full", "kivi"])
def test_an_algorithm_without_a_budget_takes_no_max_kv_bytes(algo):
    model = tiny_model("llama", head_dim=32)  # kivi's smallest group: 32
    with veloxpatch.patched(model, algo) as patch:
        with pytest.raises(BadRequest) as e:
            Budgets(patch, KEY, cap=None).of(body({"max_kv_bytes": "8MB"}), N)
    message = str(e.value)
    assert message.startswith("veloxpatch.max_kv_bytes: ") and "no budget" in message


def test_the_request_gets_caches_priced_at_its_size_and_others_the_servers(snapkv):
    """The budget its size buys (kv_budget's pricing, the server's other
    options kept), its caches holding at most that many bytes after its
    prompt and decode; a request without the field is served as before."""
    model, patch = snapkv
    limit = 40_000
    budget = Budgets(patch, KEY, cap=None).of(body({"max_kv_bytes": limit}), N)
    dims, dtype = budget.estimate.dims, kv_dtype_size(model)
    rows = budget_for_bytes(budget.options, dims, dtype, limit)
    assert budget.options.budget == rows and 8 < rows < 64
    assert budget.options.window == 8  # the server's other options kept
    assert bound_bytes(budget.options, dims, dtype, rows) <= limit
    store = BoundedPromptCache()  # the server makes its caches in the fetch
    store.fresh[budget.key] = lambda t: patch.make_cache(options=budget.options)
    caches, rest = store.fetch_nearest_cache(budget.key, PROMPT)
    assert rest == PROMPT
    assert [c.options.budget for c in caches] == [rows] * len(caches)
    greedy(model, mx.array(PROMPT), n=8, prompt_cache=caches)
    assert 0 < kv_bytes(caches) <= limit
    plain = model.make_cache()
    assert [c.options.budget for c in plain] == [64] * len(plain)
    greedy(model, mx.array(PROMPT), n=8, prompt_cache=plain)
    assert kv_bytes(plain) > limit  # 64 rows: more than the request's size
    # the reservation is its own bound's, not the server's
    ours = budget.estimate.request_bytes(len(PROMPT), 8)
    servers = KVEstimate(patch).request_bytes(len(PROMPT), 8)
    assert budget.estimate.budget == rows and ours < servers


def test_the_same_size_again_reuses_its_bound_options(snapkv):
    model, patch = snapkv
    budgets = Budgets(patch, KEY, cap=None)
    first = budgets.of(body({"max_kv_bytes": "40KB"}), N)
    assert budgets.of(body({"max_kv_bytes": "40000"}), N) is first
    other = budgets.of(body({"max_kv_bytes": "50KB"}), N)
    assert other.key != first.key != KEY


def test_an_entry_made_under_one_budget_is_never_handed_to_another(snapkv):
    """Prompt-cache entries live under their budget's key: the same prompt
    under the server's options or another size starts over."""
    model, patch = snapkv
    patch.keep_snapshots = True
    budgets = Budgets(patch, KEY, cap=None)
    small = budgets.of(body({"max_kv_bytes": "40KB"}), N)
    other = budgets.of(body({"max_kv_bytes": "50KB"}), N)
    store = BoundedPromptCache()
    caches = patch.make_cache(options=small.options)
    toks, _ = greedy(model, mx.array(PROMPT), n=4, prompt_cache=caches)
    store.insert_cache(small.key, PROMPT + toks, caches)
    assert len(store) == 1
    for key in (KEY, other.key):
        cache, rest = store.fetch_nearest_cache(key, PROMPT + toks + [1])
        assert cache is None and len(rest) == len(PROMPT) + len(toks) + 1
    cache, rest = store.fetch_nearest_cache(small.key, PROMPT + [1])
    assert cache is not None and rest == [1]
    assert [c.options.budget for c in cache] == [small.options.budget] * len(cache)


def test_a_share_in_the_body_is_priced_on_the_requests_own_prompt(snapkv):
    """20% of a long prompt buys more rows than 20% of a short one; its
    entries live under the share's key, not the server's or a size's."""
    model, patch = snapkv
    budgets = Budgets(patch, KEY, cap=None)
    short = budgets.of(body({"max_kv_bytes": "20%"}), 1000)
    long = budgets.of(body({"max_kv_bytes": "20%"}), 2000)
    assert short.options.budget < long.options.budget
    assert short.key == long.key == (*KEY, ("max_kv_bytes", "20%"))
    full = veloxpatch.pricing.full_bytes(model, 2000)
    assert long.max_kv_bytes == int(0.2 * full)
    # too few rows for this prompt: the fewest that work (what the server's
    # own share gives it); a size too small is one line
    assert budgets.of(body({"max_kv_bytes": "1%"}), 40).options.budget == 8 + 1
    with pytest.raises(BadRequest, match="smallest target that works is"):
        budgets.of(body({"max_kv_bytes": 1000}), 40)


def test_the_servers_share_gives_each_new_prompt_its_own_rows():
    """`--max-kv-bytes 20%`: the prompt cache makes a new request's caches
    for its prompt, and the reservation prices the same rows; a prompt too
    short for the share gets the fewest rows snapkv works with."""
    from veloxpatch.serve.server import batch_refusal

    model = tiny_model("llama")
    with veloxpatch.patched(model, "snapkv", window=8, max_kv_bytes="20%") as patch:
        budgets = Budgets(patch, KEY, cap=None)
        store = BoundedPromptCache()
        store.fresh[KEY] = lambda t: patch.make_cache(
            options=budgets.server_options(len(t))
        )
        rows = {}
        for n in (1000, 2000):
            tokens = prompt_tokens(n, seed=5).tolist()
            cache, rest = store.fetch_nearest_cache(KEY, tokens)
            assert rest == tokens and cache[0].offset == 0
            rows[n] = cache[0].options.budget
            estimate = budgets.server_estimate(n, KVEstimate(patch))
            assert estimate.budget == rows[n]
        assert rows[1000] < rows[2000]
        assert budgets.server_options(3).budget == 8 + 1  # the window, and one
        # another key (a request's own budget) still starts from nothing
        assert store.fetch_nearest_cache(("other",), tokens)[0] is None
        assert not batch_refusal(patch.make_cache(options=patch.options))
