"""`max_kv_bytes`: budgets priced in bytes (caches/kv_budget.py)."""

import mlx.core as mx
import pytest
from tiny import SCORER, prompt_tokens, resolve_options, tiny_model

import veloxpatch
from model_adapters import adapter_for
from veloxpatch.caches.kv_budget import bound_bytes, parse_size
from veloxpatch.errors import OptionError, UnsupportedCacheOperation

# tiny llama, head dim 32, float32: 3 layers x 2 KV heads (4 query heads)
LAYERS_HEADS = 3 * 2
DENSE_ROW = 2 * 32 * 4 + 4  # keys and values, and a position


def window_queries(window: int) -> int:
    """The bytes of snapkv's buffered queries in every layer: query heads x
    window x head dim, float32."""
    return 3 * 4 * window * 32 * 4


def budget_of(algo, **opts):
    model = tiny_model("llama", head_dim=32)
    with veloxpatch.patched(model, algo, **opts) as patch:
        return patch.options.budget


@pytest.mark.parametrize(
    "text,n",
    [
        (4096, 4096),
        ("4096", 4096),
        ("48MB", 48 * 10**6),
        ("48 mb", 48 * 10**6),
        ("1.5KiB", 1536),
        ("2GiB", 2 * 2**30),
        ("10kb", 10_000),
        ("7B", 7),
    ],
)
def test_sizes_parse(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize(
    "bad", ["12XB", "MB", "-5MB", "", "1e3", 0, -1, "0MB", "0.4B", 1.5, True, None]
)
def test_bad_sizes_are_one_line_errors(bad):
    with pytest.raises(OptionError) as e:
        parse_size(bad)
    assert "\n" not in str(e.value) and "max_kv_bytes" in str(e.value)


@pytest.mark.parametrize(
    "algo,extra,row_side,side",
    [
        ("h2o", 0, 4, 0),  # each row's accumulated attention
        ("tova", 0, 0, 0),
        ("snapkv", 4, 0, window_queries(4)),  # its window's rows and queries
    ],
)
def test_dense_rows_convert_exactly(algo, extra, row_side, side):
    opts = dict(window=4) if algo == "snapkv" else {}
    per_row = (DENSE_ROW + row_side) * LAYERS_HEADS  # a row in every layer and head
    for budget in (40, 41, 100):
        held = per_row * (budget + extra) + side
        assert budget_of(algo, max_kv_bytes=held, **opts) == budget
        assert budget_of(algo, max_kv_bytes=held - 1, **opts) == budget - 1
        assert budget_of(algo, max_kv_bytes=f"{held}B", **opts) == budget


def quantized_bound(budget):
    """kv_bits=4, group 32, residual 8, head dim 32, float32 (kv_budget's rule);
    h2o's rows also hold their accumulated attention."""
    slots = budget + max(32, budget // 4)  # rows and holes not yet compacted
    full = min(slots, 8 + 31)  # the residual, full precision
    quant = 2 * 32 * 4 // 8 + 4 * 32 * 4 // 32  # codes, scales and biases
    # a position, a slot and the accumulated attention of each row
    per_row = 8 + 4
    return LAYERS_HEADS * (
        full * (2 * 32 * 4) + (slots - full) * quant + per_row * budget
    )


def test_quantized_rows_convert_exactly():
    assert quantized_bound(64) == 80928  # worked by hand: see the docstring
    for budget in (40, 64, 200):
        limit = quantized_bound(budget)
        opts = dict(kv_bits=4, kv_residual=8)
        assert budget_of("h2o", max_kv_bytes=limit, **opts) == budget
        assert budget_of("h2o", max_kv_bytes=limit - 1, **opts) == budget - 1
    # fewer bits buy more rows for the same bytes
    opts = dict(max_kv_bytes=200_000, kv_residual=8)
    rows = [budget_of("h2o", kv_bits=b, **opts) for b in (8, 4, 2)]
    dense = budget_of("h2o", max_kv_bytes=200_000)
    assert dense < rows[0] < rows[1] < rows[2]


@pytest.mark.parametrize(
    "algo,opts",
    [
        ("h2o", {}),
        ("snapkv", dict(window=4)),
        ("expected_attention", dict(window=4)),
        ("kvzip", dict(window=4)),
        ("h2o", dict(kv_bits=4, kv_residual=8)),
        ("snapkv", dict(window=4, kv_bits=2, kv_residual=8)),
        ("tova", dict(kv_bits=3, kv_residual=8)),
        ("h2o", dict(kv_bits=2, kv_residual=0)),  # a dense sink, the factor
        ("h2o", dict(kv_bits=2)),  # all within the residual: no holes
        ("snapkv", dict(window=4, kv_bits=2, kv_key_bits=4, kv_recipe="kivi")),
    ],
)
def test_bytes_held_stay_within_max_kv_bytes(algo, opts):
    model = tiny_model("llama", head_dim=32)
    limit = 100_000
    with veloxpatch.patched(model, algo, max_kv_bytes=limit, **opts) as patch:
        caches = patch.make_cache()
        y = prompt_tokens(20)[None]
        held = []
        for _ in range(300):
            logits = model(y, cache=caches)
            y = mx.argmax(logits[:, -1:], axis=-1)
            mx.eval(y)
            held.append(sum(c.nbytes for c in caches))
    # the bound is the decode's: kvzip reads its prompt (two calls here, the
    # lone one may be mlx-lm's last chunk) whole, with its tail's queries
    decoding = held[2:] if algo == "kvzip" else held
    assert max(decoding) <= limit
    assert max(held) > 0.5 * limit  # the budget is not wasted either


def test_rows_within_the_residual_cost_what_dense_rows_cost():
    # nothing is quantized before the residual is full, so nothing is evicted
    # from quantized slots: no holes to price (kv_bits once bought a third)
    dense = budget_of("h2o", max_kv_bytes=60_000)
    assert dense < 128  # the default residual
    for bits in (2, 4):
        assert budget_of("h2o", max_kv_bytes=60_000, kv_bits=bits) >= 0.9 * dense


def test_the_query_recipe_prices_its_dense_sink_and_rounding_factor():
    # each KV head holds its first row dense, and an 8-bit triangle a head
    from veloxpatch import KVQuant
    from veloxpatch.caches import ALGORITHMS
    from veloxpatch.caches.kv_budget import slot_bytes

    model = tiny_model("llama", head_dim=32)
    dims = adapter_for(model).dims(model)
    h2o = ALGORITHMS["h2o"].Options
    plain = h2o(budget=64, quant=KVQuant(2, residual=0, recipe="kivi"))
    query = h2o(budget=64, quant=KVQuant(2, residual=0, recipe="query"))
    extra = bound_bytes(query, dims, 4, 64) - bound_bytes(plain, dims, 4, 64)
    q = query.quant
    per_row = slot_bytes(q, 32, 4, False) - slot_bytes(q, 32, 4, True)
    factor = 32 * 31 // 2 + 4
    assert extra == pytest.approx((per_row + factor) * LAYERS_HEADS)


def test_kvzap_prices_the_tail_it_holds_while_the_prompt_is_read():
    # its bound covers the prompt (budget + a chunk): the tail's queries and
    # their hidden states are held then, on top of the rows

    model = tiny_model("llama", head_dim=32)
    dims = adapter_for(model).dims(model)
    bound = {}
    for tail in (0, 32):
        opts = resolve_options(model, dict(scorer=SCORER, tail=tail, chunk=64))
        with veloxpatch.patched(model, "kvzap", **opts) as patch:
            bound[tail] = bound_bytes(patch.options, dims, 4, 100)
    per_layer = 32 * (4 * 32 + model.args.hidden_size) * 4  # 4 query heads
    assert bound[32] - bound[0] == 3 * per_layer


@pytest.mark.parametrize(
    "opts,match",
    [
        (dict(max_kv_bytes="12XB"), "size like 48MB"),
        (dict(max_kv_bytes=0), "at least 1 byte"),
        (dict(max_kv_bytes="0MB"), "at least 1 byte"),
        (dict(max_kv_bytes="100KB", budget=64), "budget or max_kv_bytes, not both"),
        (dict(max_kv_bytes=2_000), "buys 0 rows"),
        # 10 rows and the window of 16 it holds while decoding: 10 <= 16 protected
        (
            dict(
                max_kv_bytes=DENSE_ROW * LAYERS_HEADS * 26 + window_queries(16),
                window=16,
            ),
            "protected",
        ),
    ],
)
def test_bad_budgets_are_clear_errors_that_change_nothing(opts, match):
    model = tiny_model("llama", head_dim=32)
    with pytest.raises(OptionError, match=match) as e:
        veloxpatch.apply(model, "snapkv", **opts)
    assert "\n" not in str(e.value)
    assert veloxpatch.api.patch_of(model) is None


def test_the_bytes_buy_the_same_rows_whoever_chose_and_whatever_the_chunk():
    """max_kv_bytes is what is held once the prompt is read: a chunk read past
    the budget does not change the rows it buys (snapkv's chunks, kvzap's),
    and auto's pricing (`pricing.held_options`) is the algorithm's own."""
    from veloxpatch import pricing

    model = tiny_model("llama", head_dim=32)
    limit = 200_000
    bought = set()
    for opts in (dict(compress="chunks", chunk=16), dict(compress="chunks", chunk=64)):
        with veloxpatch.patched(
            model, "snapkv", max_kv_bytes=limit, window=4, **opts
        ) as p:
            bought.add(p.options.budget)
    with veloxpatch.patched(model, "snapkv", max_kv_bytes=limit, window=4) as p:
        bought.add(p.options.budget)
    assert len(bought) == 1
    kvzap = resolve_options(model, dict(scorer=SCORER))
    with veloxpatch.patched(model, "kvzap", max_kv_bytes=limit, **kvzap) as p:
        named = p.options.budget
    assert pricing.held_options(model, "kvzap", limit, kvzap)["budget"] == named


def test_algorithms_without_a_budget_refuse_max_kv_bytes():
    model = tiny_model("llama", head_dim=32)
    with pytest.raises(OptionError, match="unknown option"):
        veloxpatch.apply(model, "kivi", max_kv_bytes="1MB")


def test_mlx_lm_max_kv_size_and_max_kv_bytes_together_are_refused():
    model = tiny_model("llama", head_dim=32)
    with veloxpatch.patched(model, "h2o", max_kv_bytes="1MB") as patch:
        with pytest.raises(UnsupportedCacheOperation, match="both set"):
            patch.make_cache(max_kv_size=64)


def test_priced_options_save_as_their_budget(tmp_path):
    model = tiny_model("llama", head_dim=32)
    opts = dict(max_kv_bytes=100_000, kv_bits=4, kv_residual=8)
    with veloxpatch.patched(model, "h2o", **opts) as patch:
        caches = patch.make_cache()
        model(prompt_tokens(30)[None], cache=caches)
        veloxpatch.save_cache(tmp_path / "c.safetensors", caches)
        loaded = veloxpatch.load_cache(tmp_path / "c.safetensors")
    assert loaded[0].options.budget == patch.options.budget
    assert loaded[0].options.max_kv_bytes is None


def test_memory_sizes_expand_every_arm_with_a_budget():
    from veloxpatch.eval.arms import expand

    arms = expand(
        ["snapkv:window=4", "h2o:kv_bits=4", "mlx.rotating", "mlx.quantized:kv_bits=4"]
        + ["kivi", "full", "tova:budget=64"],
        max_kv_bytes=["6MB", "12MB"],
    )
    assert [a.label for a in arms] == [
        "snapkv:max_kv_bytes=6MB,window=4",
        "snapkv:max_kv_bytes=12MB,window=4",
        "h2o:kv_bits=4,max_kv_bytes=6MB",
        "h2o:kv_bits=4,max_kv_bytes=12MB",
        "mlx.rotating:max_kv_bytes=6MB",
        "mlx.rotating:max_kv_bytes=12MB",
        "mlx.quantized:kv_bits=4",  # at its own size
        "kivi",
        "full",
        "tova:budget=64",  # names its budget
    ]
    assert arms[0].family == arms[1].family == "snapkv:window=4"
    with pytest.raises(OptionError, match="not both"):
        expand(["snapkv"], budgets=[64], max_kv_bytes=["6MB"])


def test_arms_at_equal_bytes_hold_at_most_those_bytes():
    # ours (dense and quantized) and mlx-lm's rotating cache, priced in bytes,
    # through the evaluation's own continuation run
    from veloxpatch.eval.arms import expand
    from veloxpatch.eval.metrics import evaluate_continuation
    from veloxpatch.eval.peers import mlx_caches

    model = tiny_model("llama", head_dim=32)
    limit = 100_000
    rows = limit // (LAYERS_HEADS * 2 * 32 * 4)  # rotating: keys and values only
    rotating = mlx_caches(model, "rotating", {"max_kv_bytes": limit})
    assert {c.max_size for c in rotating} == {rows}
    arms = expand(
        ["h2o", "snapkv:window=4", "tova:kv_bits=4,kv_residual=8", "mlx.rotating"],
        max_kv_bytes=[limit],
    )
    ids = prompt_tokens(200).tolist()
    results = evaluate_continuation(model, arms, ids[:120], ids[120:], 32)
    for r in results:
        assert 0.3 * limit < r.kv_bytes <= limit, (r.arm, r.kv_bytes)


def test_a_share_prices_a_named_algorithm_by_each_prompts_length():
    """max_kv_bytes="20%" with an algorithm you name: the rows are what 20% of
    each prompt's full KV buys it, priced as that many bytes would be, wherever
    the prompt is known (make_cache(n_tokens=), prefill, generate, eval's arms)."""
    from veloxpatch import pricing
    from veloxpatch.eval.arms import Arm, chosen

    model = tiny_model("llama")
    opts = dict(window=4)
    for n in (120, 240):
        size = pricing.full_bytes(model, n) // 5
        with veloxpatch.patched(model, "snapkv", max_kv_bytes=size, **opts) as p:
            bytes_budget = p.options.budget
        with veloxpatch.patched(model, "snapkv", max_kv_bytes="20%", **opts) as p:
            assert p.make_cache(n_tokens=n)[0].options.budget == bytes_budget
            caches = p.prefill(prompt_tokens(n).tolist())
            assert caches[0].options.budget == bytes_budget
            assert sum(c.nbytes for c in caches) <= size
        arm = chosen(model, Arm("snapkv", {"max_kv_bytes": "20%", **opts}), n)
        assert arm.options["max_kv_bytes"] == size
    with veloxpatch.patched(model, "snapkv", max_kv_bytes="20%", **opts) as p:
        with pytest.raises(OptionError, match="sets the rows by each prompt"):
            p.make_cache()  # no prompt known
    for bad, match in (("kivi", "takes no max_kv_bytes"), ("snapkv", "at most 100%")):
        with pytest.raises(OptionError, match=match):
            veloxpatch.apply(
                model, bad, max_kv_bytes="120%" if bad == "snapkv" else "20%"
            )
        assert veloxpatch.api.patch_of(model) is None


def test_compress_takes_a_share_for_a_named_algorithm(monkeypatch, tmp_path):
    from click.testing import CliRunner
    from test_kvzip import TOK

    from veloxpatch import pricing
    from veloxpatch.caches.io import load_cache
    from veloxpatch.cli import main
    from veloxpatch.loading import models

    model = tiny_model("llama")
    monkeypatch.setattr(models, "load", lambda *a, **k: (model, TOK))
    context = tmp_path / "doc.txt"
    context.write_text("word " * 60)
    args = ["compress", "--algo", "snapkv", "--algo-arg", "window=4", "--no-chat"]
    out = tmp_path / "doc.safetensors"
    res = CliRunner().invoke(
        main, [*args, "--max-kv-bytes", "20%", "--context", context, "--out", out]
    )
    assert res.exit_code == 0, res.output
    size = pricing.full_bytes(model, len(TOK.encode(context.read_text()))) // 5
    with veloxpatch.patched(model, "snapkv", max_kv_bytes=size, window=4) as p:
        caches, meta = load_cache(out, return_metadata=True)
        assert caches[0].options.budget == p.options.budget
    assert f'"max_kv_bytes": {size}' in meta["options"]  # bytes, not the share
