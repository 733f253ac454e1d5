"""scripts/studies/passkey_key_layers.py: a block's keys are widened in those layers
alone, and attention then reads them nearer to exact."""

import sys
from pathlib import Path

import mlx.core as mx
import pytest
from tiny import prompt_tokens, tiny_model

import veloxpatch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "studies"))
import passkey_key_layers  # noqa: E402

# a study's tests: deselected by default, run with `pytest -m study`
pytestmark = pytest.mark.study

OPTS = dict(bits=2, residual=32)


def test_layer_block_reads_ranges():
    assert list(passkey_key_layers.layer_block("15-17")) == [15, 16, 17]
    assert list(passkey_key_layers.layer_block("7")) == [7]


def test_only_the_block_is_widened_and_read_nearer_exact():
    model = tiny_model("llama", head_dim=32, num_hidden_layers=4)
    ids = prompt_tokens(200)[None]
    with veloxpatch.patched(model, "full") as patch:
        exact = patch.make_cache()
        mx.eval(model(ids, cache=exact))
    with veloxpatch.patched(model, "kivi", **OPTS) as patch:
        caches = patch.make_cache()
        passkey_key_layers.widen_keys(caches, passkey_key_layers.layer_block("1-2"), 8)
        mx.eval(model(ids, cache=caches))  # one call: every layer sees exact rows
        assert [c.store.part.key_bits for c in caches] == [2, 8, 8, 2]
        assert [c.options.quant.key_bits for c in caches] == [None, 8, 8, None]
        assert caches[0].options is caches[3].options  # the others keep the arm's
        errors = []
        for c, e in zip(caches, exact):
            keys, _ = c.store.dequantize(mx.float32)
            want = e.keys[:, :, : keys.shape[2]].astype(mx.float32)
            errors.append((mx.abs(keys - want).max() / mx.abs(want).max()).item())
    assert max(errors[1], errors[2]) < 0.1 * min(errors[0], errors[3])
