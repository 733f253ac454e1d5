"""KIVI: per-channel keys, per-token values, a full-precision residual."""

import mlx.core as mx
import numpy as np
import pytest
from tiny import prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.caches.quantized import QuantizedRows
from veloxpatch.errors import OptionError


def _check_bound(x, y, groups_axis_last, bits):
    """Every value within half a step of its group's grid, the step being
    (max - min) / (2^bits - 1), plus rounding of the scale and zero point."""
    g, e = groups_axis_last(np.array(x)), groups_axis_last(np.abs(np.array(y - x)))
    step = (g.max(-1) - g.min(-1)) / (2**bits - 1)
    slack = 2e-3 * np.abs(g).max(-1)
    assert (e.max(-1) <= 0.5 * step * (1 + 1e-3) + slack).all()
    if bits < 8:
        assert (e.max(-1) > 0.1 * step).any()  # really quantized


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_round_trip_error_bound(bits):
    # The paper's min/max grid: keys in groups of 32 rows per channel, values in
    # groups of 32 channels per row, every value within half a step.
    mx.random.seed(bits)
    B, H, T, D = 2, 3, 64, 128
    k = mx.random.normal((B, H, T, D)) * mx.linspace(0.1, 4, D)
    v = mx.random.normal((B, H, T, D))
    rows = QuantizedRows(bits, 32)
    rows.append(k[:, :, :32], v[:, :, :32])
    rows.append(k[:, :, 32:], v[:, :, 32:])
    dk, dv = rows.dequantize(mx.float32)

    def key_groups(a):  # [..., T, D] -> [..., T/32, D, 32]
        return a.reshape(B, H, T // 32, 32, D).swapaxes(-1, -2)

    _check_bound(k, dk, key_groups, bits)
    _check_bound(v, dv, lambda a: a.reshape(B, H, T, D // 32, 32), bits)
    assert rows.kw.dtype == mx.uint32 and rows.kw.shape[-1] == T * bits // 32


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_residual_covering_the_context_equals_full(arch):
    model = tiny_model(arch, head_dim=32)
    ids = prompt_tokens(40)
    outs = {}
    for algo, opts in [("full", {}), ("kivi", dict(bits=2, group=32, residual=64))]:
        with veloxpatch.patched(model, algo, **opts) as p:
            caches = p.make_cache()
            logits = [model(ids[None, :30], cache=caches)]
            for t in ids[30:].tolist():
                logits.append(model(mx.array([[t]]), cache=caches))
            outs[algo] = mx.concatenate(logits, axis=1)
    assert mx.array_equal(outs["full"], outs["kivi"])


def test_quantized_attention_stays_close_and_flushes_whole_groups():
    model = tiny_model("llama", head_dim=32)
    ids = prompt_tokens(100)
    ref = model(ids[None])
    err = {}
    for bits in (8, 4, 2):
        with veloxpatch.patched(
            model, "kivi", bits=bits, residual=8, recipe="kivi"
        ) as p:
            caches = p.make_cache()
            got = [model(ids[None, :50], cache=caches)]
            for t in ids[50:].tolist():
                got.append(model(mx.array([[t]]), cache=caches))
        got = mx.concatenate(got, axis=1)
        lp = got - mx.logsumexp(got, -1, keepdims=True)
        lr = ref - mx.logsumexp(ref, -1, keepdims=True)
        err[bits] = mx.abs(lp - lr).max().item()
        for c in caches:
            assert c.quantized % 32 == 0 and c.quantized + c.keys.shape[2] == 100
            assert 8 <= c.keys.shape[2] < 8 + 32
    assert err[8] < 0.05 and err[8] < err[4] < err[2]


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model("llama", head_dim=32)
    ids = prompt_tokens(80)
    with veloxpatch.patched(model, "kivi", bits=4, residual=16) as p:
        caches = p.make_cache()
        model(ids[None, :79], cache=caches)
        veloxpatch.save_cache(tmp_path / "c.safetensors", caches)
        loaded = veloxpatch.load_cache(tmp_path / "c.safetensors")
        a = model(ids[None, 79:], cache=caches)
        b = model(ids[None, 79:], cache=loaded)
    assert mx.array_equal(a, b)
    assert loaded[0].quantized == caches[0].quantized == 64  # 32 + a flush


@pytest.mark.parametrize(
    "opts",
    [dict(bits=5), dict(bits="2"), dict(group=16), dict(residual=-1), dict(group=64)],
)
def test_option_errors(opts):
    model = tiny_model("llama", head_dim=32)  # head dim 32: group 64 cannot divide
    with pytest.raises(OptionError):
        veloxpatch.apply(model, "kivi", **opts)
    assert veloxpatch.api.patch_of(model) is None
