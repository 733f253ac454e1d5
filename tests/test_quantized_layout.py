"""Quantized rows on mlx's kernels (caches/quantized.py, qview.py, kv_bits.py):
what attention computes in place equals dense attention on the dequantized
values, bytes are the analytic count, and eviction leaves holes that attention
masks until compaction."""

import mlx.core as mx
import pytest
from helpers import rel
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch import KVQuant
from veloxpatch.api import make_options
from veloxpatch.caches.kivi import KIVICache, KIVIOptions
from veloxpatch.caches.quantized import QuantizedRows
from veloxpatch.caches.storage import PAD_POSITION


def dense_slots(view):
    """The view's slots as dense keys and values (dequantized store, residual)."""
    keys, values = view.keys, view.values
    if view.store is not None and view.store.rows:
        dk, dv = view.store.dequantize(mx.float32)
        keys = mx.concatenate([dk, keys.astype(mx.float32)], axis=2)
        values = mx.concatenate([dv, values.astype(mx.float32)], axis=2)
    return keys, values


def reference(view, q, scale):
    """Dense attention over the dequantized slots, query heads repeated, masked
    by slot position (holes and the future hidden)."""
    keys, values = dense_slots(view)
    B, Hq, L, D = q.shape
    rep = Hq // keys.shape[1]
    keys, values = mx.repeat(keys, rep, 1), mx.repeat(values, rep, 1)
    S = keys.shape[2]
    if view.slot_pos is None:
        pos = mx.broadcast_to(mx.arange(S), (B, keys.shape[1] // rep, S))
    else:
        pos = view.slot_pos
    qpos = mx.arange(view.qstart, view.qstart + L)
    mask = mx.repeat(pos[:, :, None, :] <= qpos[:, None], rep, 1)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def check_attention(view, q, out, scale) -> int:
    """Output, q.K and p.V of a quantized view against dense references on its
    dequantized slots (at call time: the store changes after the call)."""
    if not hasattr(view, "store"):
        return 0  # nothing quantized yet: plain dense attention
    assert rel(out, reference(view, q, scale)) <= 1e-5
    keys, values = dense_slots(view)
    B, H = keys.shape[:2]
    qg = q.reshape(B, H, -1, q.shape[-1])
    want = qg @ keys.swapaxes(-1, -2)
    if view.slot is not None:
        want = mx.take_along_axis(want, view.slot[:, :, None, :], axis=-1)
    assert rel(view.logits(qg), want) <= 1e-5
    p = mx.softmax(mx.random.normal((B, H, qg.shape[2], keys.shape[2])), -1)
    assert rel(view.weighted(p), p @ values) <= 1e-5
    return view.store.rows


def spy(cache, seen):
    """Check every attention call of `cache`; record the quantized slots."""
    original = cache.attention

    def attention(q, keys, values, mask, scale):
        out = original(q, keys, values, mask, scale)
        seen.append(check_attention(keys, q, out, scale))
        return out

    cache.attention = attention


def identity_rope(x, offset=0):
    return x


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (3, 3)])  # GQA and MHA
def test_attention_on_the_layout_equals_dense_on_dequantized(bits, hq, hkv):
    mx.random.seed(bits)
    D, g = 64, 32
    cache = KIVICache(KIVIOptions(KVQuant(bits, group=g, residual=20, recipe="kivi")))
    seen = []
    spy(cache, seen)
    chunks = [45, 30, 33] + [1] * 40  # chunked prefill, then decode
    offset = 0
    for L in chunks:
        q = mx.random.normal((1, hq, L, D))
        k = mx.random.normal((1, hkv, L, D)) * mx.linspace(0.2, 3, D)
        v = mx.random.normal((1, hkv, L, D))
        cache.attend(q, k, v, rope=identity_rope, scale=D**-0.5)
        offset += L
    assert cache.quantized == (offset - 20) // g * g  # flushed in whole groups
    assert len(set(seen) - {0}) >= 3  # checked across several flushes


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_rows_are_mlx_layout_and_groups_move_exactly(bits):
    mx.random.seed(0)
    B, H, T, D, g = 1, 2, 128, 64, 32
    k, v = mx.random.normal((B, H, T, D)), mx.random.normal((B, H, T, D))
    rows = QuantizedRows(bits, g)
    rows.append(k[:, :, :64], v[:, :, :64])
    rows.append(k[:, :, 64:], v[:, :, 64:])
    assert rows.kw.shape == (B, H, D, T * bits // 32) and rows.ks.shape == (B, H, D, 4)
    assert rows.vw.shape == (B, H, T, D * bits // 32) and rows.vs.shape == (B, H, T, 2)
    dk, dv = rows.dequantize(mx.float32)
    gid = mx.array([[[3, 0], [1, 1]]])
    rows.take_groups(gid)
    tk, tv = rows.dequantize(mx.float32)
    for h in range(H):
        for j, src in enumerate(gid[0, h].tolist()):
            a, b = slice(j * g, (j + 1) * g), slice(src * g, (src + 1) * g)
            assert mx.array_equal(tk[0, h, a], dk[0, h, b])
            assert mx.array_equal(tv[0, h, a], dv[0, h, b])


def test_nbytes_is_the_analytic_count_at_4000_tokens():
    B, H, T, D = 1, 3, 4000, 64
    mx.random.seed(0)
    for dtype, size in ((mx.float16, 2), (mx.float32, 4)):
        k = mx.random.normal((B, H, T, D)).astype(dtype)
        v = mx.random.normal((B, H, T, D)).astype(dtype)
        for bits in (2, 3, 4, 8):
            c = KIVICache(
                KIVIOptions(KVQuant(bits, group=32, residual=128, recipe="kivi"))
            )
            c._append(k, v, 0)
            c.after_attend(None, T)
            tq = (T - 128) // 32 * 32
            codes = 2 * B * H * tq * D * bits // 8
            # a scale and a bias (the model's dtype) per channel and 32 keys,
            # per 32 channels of a value
            scales = 2 * size * (B * H * D * tq // 32 + B * H * tq * D // 32)
            residual = 2 * B * H * (T - tq) * D * size
            assert c.nbytes == codes + scales + residual


def test_eviction_leaves_holes_then_compaction_keeps_whole_groups_exact():
    cls, opts = make_options("streaming_llm", dict(budget=64, kv_bits=4, kv_residual=0))
    cache = cls.for_options(opts)(opts)
    mx.random.seed(3)
    k, v = mx.random.normal((1, 2, 112, 32)), mx.random.normal((1, 2, 112, 32))
    cache._append(k, v, 0)
    cache._settle()
    assert (cache.quantized, cache.keys.shape[2], cache.rows) == (96, 16, 112)
    before, _ = cache._view()
    bk, bv = dense_slots(before)
    store = cache.store.arrays()
    # head 0 keeps groups 0 and 1 whole; head 1 group 0, then parts of 1 and 2
    idx = mx.array(
        [
            [
                list(range(64)) + list(range(100, 106)),
                list(range(32)) + list(range(40, 72)) + list(range(106, 112)),
            ]
        ]
    )
    cache.keep_rows(idx)
    assert all(a is b for a, b in zip(cache.store.arrays(), store))  # nothing moved
    assert (cache.rows, cache.slots, cache.holes) == (70, 112, 42)
    assert cache.positions_view().tolist() == idx.tolist()
    view, _ = cache._view(qstart=112, L=1)
    assert (view.slot_pos == PAD_POSITION).sum(-1).tolist() == [[42, 42]]
    q = mx.random.normal((1, 2, 1, 32))
    want = mx.take_along_axis(bk, idx[..., None], 2)
    assert rel(view.logits(q), q @ want.swapaxes(-1, -2)) <= 1e-5
    cache._compact()
    assert (cache.rows, cache.holes, cache.quantized) == (70, 0, 64)
    after, _ = cache._view()
    ak, av = dense_slots(after)
    rows_k = mx.take_along_axis(ak, cache.slot[..., None], 2)  # in row order
    rows_v = mx.take_along_axis(av, cache.slot[..., None], 2)
    ref_k = mx.take_along_axis(bk, idx[..., None], 2)
    ref_v = mx.take_along_axis(bv, idx[..., None], 2)
    # whole groups (head 0: rows 0-63, head 1: rows 0-31) kept bit for bit, and
    # the rows left in the residual (the last 6) too
    for h, n in ((0, 64), (1, 32)):
        for got, ref in ((rows_k, ref_k), (rows_v, ref_v)):
            assert mx.array_equal(got[0, h, :n], ref[0, h, :n])
            assert mx.array_equal(got[0, h, 64:], ref[0, h, 64:])
    # head 1's survivors of broken groups are requantized: values (grouped
    # within their own row, on a grid whose ends are codes 0 and 2^bits - 1)
    # come back as they were; keys share their grid with rows of another group
    # now, so they move, within that grid's step
    assert rel(rows_v[0, 1, 32:64], ref_v[0, 1, 32:64]) <= 1e-6
    got, ref = rows_k[0, 1, 32:64], ref_k[0, 1, 32:64]
    assert rel(got, ref) < 0.2 and not mx.array_equal(got, ref)
    assert cache.positions_view().tolist() == idx.tolist()


@pytest.mark.parametrize("tiles", [False, True], ids=["one call", "tiles"])
@pytest.mark.parametrize("algo", ["h2o", "snapkv", "knorm", "adakv"])
def test_quantized_eviction_masks_exactly_the_evicted_rows(algo, tiles, monkeypatch):
    # At every attention call the slots attention can see are exactly the rows
    # the cache holds (by position), and the output equals dense attention on
    # the dequantized slots with that mask, also in tiles of a few queries
    # (attention_math.fused_attention; adakv's heads hold padding rows).
    from veloxpatch.caches import attention_math

    if tiles:
        monkeypatch.setattr(attention_math, "FUSED_TILE_ELEMENTS", 2048)
    model = tiny_model("llama", head_dim=32)
    extra = dict(window=4) if algo in ("snapkv", "adakv") else dict(sinks=2)
    ids = prompt_tokens(140)
    with veloxpatch.patched(
        model, algo, budget=48, kv_bits=4, kv_residual=8, **extra
    ) as patch:
        caches = patch.make_cache()
        seen = []
        for c in caches:
            spy(c, seen)
        model(ids[None, :90], cache=caches)
        patch.end_prompt(caches)
        holes = []
        for t in ids[90:].tolist():
            model(mx.array([[t]]), cache=caches)
            holes.append(caches[0].holes)
            rows = caches[0].positions_view()
            view, _ = caches[0]._view(qstart=caches[0].offset, L=1)
            if view is not caches[0].keys and view.slot_pos is not None:
                for h in range(rows.shape[1]):
                    a = sorted(p for p in rows[0, h].tolist() if p != PAD_POSITION)
                    s = view.slot_pos[0, h].tolist()
                    assert sorted(p for p in s if p != PAD_POSITION) == a
        # a second turn: a chunk long enough to be attended densely, over slots
        # with holes (masked by position, not "causal")
        assert caches[0].holes > 0 or algo in ("snapkv", "adakv")
        model(prompt_tokens(40, seed=5)[None], cache=caches)
    assert max(holes) > 0  # rows were evicted from quantized slots
    assert any(seen)  # and attention read quantized slots


def test_a_dense_call_over_holes_attends_the_rows_alone(monkeypatch):
    # A prompt chunk over quantized slots with holes reads the dequantized rows
    # (holes dropped) under "causal": an [L, slots] mask array per call was
    # most of compress="chunks" with kv_bits's prefill peak.
    model = tiny_model("llama", head_dim=32)
    ids = prompt_tokens(140)
    with veloxpatch.patched(model, "h2o", budget=48, kv_bits=4, kv_residual=8) as p:
        caches = p.make_cache()
        model(ids[None, :90], cache=caches)
        p.end_prompt(caches)
        for t in ids[90:].tolist():
            model(mx.array([[t]]), cache=caches)
        rows, holes = caches[0].rows, caches[0].holes
        assert holes > 0
        calls = []
        sdpa = mx.fast.scaled_dot_product_attention

        def spy_sdpa(q, k, v, *, scale, mask=None, **kw):
            calls.append((q.shape[2], k.shape[2], mask))
            return sdpa(q, k, v, scale=scale, mask=mask, **kw)

        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy_sdpa)
        model(prompt_tokens(40, seed=5)[None], cache=caches)
    L, keys, mask = calls[0]
    assert (L, keys) == (40, rows + 40)
    assert isinstance(mask, str) and mask == "causal"


def test_many_query_rows_read_one_dense_copy_on_the_cpu(monkeypatch):
    # mlx's quantized matmul on the CPU is linear in query rows: a call of 4
    # queries (12 rows per KV head) and H2O's probabilities of its queries read
    # the rows dequantized once; a decode step (3 rows) stays on the kernels.
    from veloxpatch.caches import qview

    assert mx.default_device() == mx.cpu and qview.CPU_DENSE_ROWS <= 12
    model = tiny_model("llama", head_dim=32)  # 3 query heads per KV head
    ids = prompt_tokens(120)
    with veloxpatch.patched(model, "h2o", budget=64, kv_bits=4, kv_residual=8) as p:
        caches = p.make_cache()
        model(ids[None, :100], cache=caches)
        p.end_prompt(caches)
        model(ids[None, 100:101], cache=caches)
        assert caches[0].quantized > 0
        kernel_rows = []
        qmm = mx.quantized_matmul

        def spy(x, *a, **kw):
            kernel_rows.append(x.shape[-2])
            return qmm(x, *a, **kw)

        monkeypatch.setattr(mx, "quantized_matmul", spy)
        model(ids[None, 101:105], cache=caches)
        assert kernel_rows == []
        model(ids[None, 105:106], cache=caches)
        assert kernel_rows and max(kernel_rows) < qview.CPU_DENSE_ROWS
