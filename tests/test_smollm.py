"""Real-model checks on the embedded SmolLM2-135M-Instruct (30 layers, GQA 9/3)."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import smollm
from helpers import greedy, max_abs
from oracle import oracle_logits, run_patched

import veloxpatch
from veloxpatch.prose import prose_tokens

ROOT = Path(__file__).resolve().parents[1]


@smollm
def test_full_parity_600_token_prompt(loaded):
    # three prefill chunks and a decode past them, bit for bit
    model, tokenizer = loaded
    prompt = mx.array(prose_tokens(tokenizer, 600, start=5000))
    ref_toks, ref_lp = greedy(model, prompt, n=16, prefill_step_size=256)
    with veloxpatch.patched(model, algo="full") as patch:
        caches = patch.make_cache()
        toks, lp = greedy(
            model, prompt, n=16, prefill_step_size=256, prompt_cache=caches
        )
    assert toks == ref_toks
    assert max_abs(lp, ref_lp) == 0.0
    assert caches[0].offset == 616


@smollm
@pytest.mark.parametrize("algo", ["streaming_llm", "knorm"])
def test_oracle_on_smollm(loaded, algo):
    # fp32 through 30 layers: the dense oracle and the chunked patched run sum in
    # different orders, so allow float noise (measured ~1e-4 on logits of ~20).
    model, tokenizer = loaded
    tokens = prose_tokens(tokenizer, 200, start=9000)
    patched, masks, caches = run_patched(model, tokens, [80, 70], algo, budget=64)
    dense = oracle_logits(model, tokens, masks)
    err = mx.abs(patched - dense).max().item()
    causal = np.tril(np.ones((200, 200), bool))
    assert sum(int((causal & ~m).sum()) for m in masks) > 0
    assert err < 2e-3, err
    assert all(c.rows == 64 for c in caches)


@smollm
def test_qfilters_file_fits_the_model_quantized_or_not(loaded, tmp_path):
    # The fingerprint hashes fp16 weight samples: the GGUF-quantized model and
    # its float32 dequantization are the same model for a filters file.
    from tiny import dims_of

    from model_adapters.base import fingerprint
    from veloxpatch.caches.calibration_files import load_filters
    from veloxpatch.calibration.qfilters import save_filters

    model, _ = loaded
    quantized, _ = veloxpatch.load(quantized=True)
    assert "scales" in quantized.layers[0].self_attn.q_proj
    assert fingerprint(quantized) == fingerprint(model)
    filters = [mx.ones((9, 64)) / 8 for _ in model.layers]  # unit vectors
    save_filters(tmp_path / "f.safetensors", filters, quantized)
    assert len(load_filters(tmp_path / "f.safetensors", dims_of(model))) == 30


@smollm
def test_qfilters_calibration_orientation_on_smollm(loaded):
    # Every layer and query head: most calibration queries project positively
    # on its filter, and the filters differ between heads (not one bias vector).
    from veloxpatch.calibration.run import calibrate

    model, tokenizer = loaded
    per_head, queries = calibrate(model, tokenizer, tokens=256)
    assert len(per_head) == 30 and queries[0].shape == (9, 256, 64)
    for q, f in zip(queries, per_head):
        share = ((q * f[:, None, :]).sum(-1) > 0).mean(-1)
        assert (share > 0.5).all().item()
    cos = per_head[0] @ per_head[0].T
    assert (mx.abs(cos) < 0.999).sum().item() > 0


@smollm
def test_generate_with_kvzip_answers_a_passkey_prompt():
    """`veloxpatch generate --algo kvzip` reconstructs the prompt inside
    mlx-lm's generate (the patch knows the tokenizer) and finds the number in
    a held-out passkey prompt at 256 rows of about 800 (it printed garbage
    when the prompt's own queries scored at 256 of 1,400)."""
    from click.testing import CliRunner

    from veloxpatch.cli import main
    from veloxpatch.eval.passkey import QUESTION, hidden_key

    _, tokenizer = veloxpatch.load()
    key, body = hidden_key(tokenizer, 800, 0.4, 7, "evaluation")
    args = ["generate", "--algo", "kvzip", "--budget", "256", "--max-tokens", "16"]
    res = CliRunner().invoke(main, [*args, "--prompt", body + QUESTION])
    assert res.exit_code == 0, res.output
    assert key in res.output.replace(" ", ""), res.output


@pytest.mark.slow
@smollm
def test_bench_decode_patches_each_arm_as_its_caches_were_made(tmp_path, monkeypatch):
    # The script decodes every arm's replayed caches through one model: each arm
    # must be patched with its own algorithm (the patch refuses another's caches).
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_decode

    out = tmp_path / "decode.json"
    args = ["--context", "200", "--repeats", "1", "--decode-tokens", "3"]
    args += ["--early", "1", "--arms", "kivi:bits=2,snapkv:budget=64"]
    args += ["--baseline", "kivi:bits=2", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", *args])
    bench_decode.main()
    table = {row["arm"]: row for row in json.loads(out.read_text())["table"]}
    assert set(table) == {"unpatched", "full", "kivi:bits=2", "snapkv:budget=64"}
    assert table["kivi:bits=2"]["ratio_vs_baseline_median"] == 1.0
    assert all(row["decode_tok_per_s_median"] > 0 for row in table.values())
    assert table["kivi:bits=2"]["kv_bytes"] < table["full"]["kv_bytes"]
    assert table["snapkv:budget=64"]["kv_bytes"] < table["full"]["kv_bytes"]


@smollm
def test_auto_at_a_share_answers_a_one_line_question(loaded):
    """A 37-token question is too short for 20% of its KV to buy kvzap's
    fewest rows: it gets them, as the server gives every prompt, and answers."""
    import mlx_lm

    model, tokenizer = loaded
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True)
    with veloxpatch.patched(model, "auto", max_kv_bytes="20%") as patch:
        text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=12)
        line = str(patch.auto)
    assert "Paris" in text, text
    assert "so it keeps its fewest" in line, line
