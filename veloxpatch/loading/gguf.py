"""Load a llama-architecture GGUF file as an mlx-lm ``llama`` model plus tokenizer.

Only what ``mx.load`` can read is supported: F32/F16/BF16 tensors and the
Q4_0/Q4_1/Q8_0 quants (which mlx maps to affine group-32 quantization).
Nothing here touches the network.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

from ..errors import FileFormatError, VeloxpatchError
from .fileformat import check_gguf

CONVERT_HINT = (
    "Convert the original Hugging Face checkpoint with "
    "`mlx_lm.convert --hf-path <hf repo>` and pass the output directory instead."
)

# llama.cpp pre-tokenizer names whose regex is "split every digit, then GPT-2".
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell"}
# ... and those that are plain GPT-2 byte-level splitting.
_GPT2_PRE = {"gpt2", "mpt", "olmo"}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4


class ModelLoadError(VeloxpatchError):
    """A model could not be loaded; the message says why and what to do instead."""


class ModelFileError(ModelLoadError, FileFormatError):
    """A model file (GGUF, safetensors) that is damaged or that mlx cannot read."""


def _value(meta: dict, key: str, default=None):
    # mx.load returns numeric metadata as 0-d mx.arrays.
    v = meta.get(key, default)
    return v.item() if isinstance(v, mx.array) and v.ndim == 0 else v


def read_gguf(path: str | Path) -> tuple[dict, dict]:
    """Return ``(weights, metadata)`` of a GGUF file, wrapping mlx's errors.
    The header is checked first: mlx trusts it and crashes on a damaged one."""
    try:
        check_gguf(path, ModelFileError)
    except ModelFileError as e:
        raise ModelFileError(f"{e}. {CONVERT_HINT}") from None
    try:
        return mx.load(str(path), return_metadata=True)
    except Exception as e:  # mlx raises bare ValueError/RuntimeError here
        raise ModelLoadError(
            f"mx.load could not read GGUF {path}: {e}. mlx reads only "
            f"F32/F16/BF16/Q4_0/Q4_1/Q8_0 tensors (no K-quants). {CONVERT_HINT}"
        ) from e


def load_gguf(path: str | Path) -> tuple[nn.Module, TokenizerWrapper]:
    """Build an mlx-lm llama model (quantized as stored) and its tokenizer."""
    weights, meta = read_gguf(path)
    arch = _value(meta, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported (only 'llama'). "
            + CONVERT_HINT
        )
    tokenizer = build_tokenizer(meta, path)  # fail fast, before the weights
    args = model_args(meta, weights, path)
    rope_freqs = weights.pop("rope_freqs.weight", None)
    weights = _rename(weights, args, path)

    model = llama.Model(args)

    def quant_params(name, module):
        # Each stored quantized tensor comes with .scales; derive bits and
        # group size from the shapes instead of assuming a quant type.
        scales = weights.get(f"{name}.scales")
        if scales is None:
            return False
        in_dims = module.weight.shape[-1]
        bits = weights[f"{name}.weight"].shape[-1] * 32 // in_dims
        return {"group_size": in_dims // scales.shape[-1], "bits": bits}

    nn.quantize(model, class_predicate=quant_params)
    try:
        model.load_weights(list(weights.items()))
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensors do not fit a llama model: {e}") from e
    if rope_freqs is not None:
        # Llama-3 style per-frequency factors: mx.fast.rope takes wavelengths,
        # which llama.cpp divides the angle by (theta / factor).
        dims = args.head_dim
        base = mx.power(args.rope_theta, mx.arange(0, dims, 2) / dims)
        for layer in model.layers:
            layer.self_attn.rope._freqs = base * rope_freqs.astype(mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model, tokenizer


def model_args(meta: dict, weights: dict, path) -> llama.ModelArgs:
    def get(key, default=None):
        v = _value(meta, f"llama.{key}", default)
        if v is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks 'llama.{key}'")
        return v

    hidden, n_heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // n_heads)
    rope_dims = get("rope.dimension_count", head_dim)
    if rope_dims != head_dim or get("attention.value_length", head_dim) != head_dim:
        raise ModelLoadError(f"{path}: partial RoPE / uneven head sizes unsupported")
    scaling_type = get("rope.scaling.type", "none")
    if "rope_freqs.weight" in weights:
        rope_scaling = {"rope_type": "llama3", "factor": 1.0}  # freqs set later
    elif scaling_type == "linear":
        rope_scaling = {"type": "linear", "factor": get("rope.scaling.factor")}
    elif scaling_type == "none":
        rope_scaling = None
    else:
        raise ModelLoadError(
            f"{path}: RoPE scaling {scaling_type!r} unsupported. " + CONVERT_HINT
        )
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=get("block_count"),
        intermediate_size=get("feed_forward_length"),
        num_attention_heads=n_heads,
        num_key_value_heads=get("attention.head_count_kv", n_heads),
        head_dim=head_dim,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        rope_theta=get("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=get("context_length", 4096),
        vocab_size=weights["token_embd.weight"].shape[0],
        tie_word_embeddings="output.weight" not in weights,
        attention_bias="blk.0.attn_q.bias" in weights,
        mlp_bias="blk.0.ffn_up.bias" in weights,
    )


def _unpermute(w: mx.array, n_heads: int) -> mx.array:
    # llama.cpp interleaves each head's rows for GPT-J style RoPE; mlx-lm's
    # llama uses the rotate-half layout, so undo it (rows = output dim).
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rename(weights: dict, args: llama.ModelArgs, path) -> dict:
    heads = {
        "self_attn.q_proj": args.num_attention_heads,
        "self_attn.k_proj": args.num_key_value_heads,
    }
    out = {}
    for key, w in weights.items():
        stem, suffix = key.rsplit(".", 1)
        if stem.startswith("blk."):
            _, n, name = stem.split(".", 2)
            module = _LAYER_NAMES.get(name)
            new = module and f"model.layers.{n}.{module}"
        else:
            new = module = _TOP_NAMES.get(stem)
        if new is None:
            raise ModelLoadError(f"{path}: unexpected GGUF tensor {key!r}")
        if module in heads:
            w = _unpermute(w, heads[module])
        out[f"{new}.{suffix}"] = w
    return out


def build_tokenizer(meta: dict, path="GGUF") -> TokenizerWrapper:
    """Byte-level BPE tokenizer from ``tokenizer.ggml.*`` metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    kind = _value(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{path}: tokenizer model {kind!r} is not supported (only byte-level "
            "BPE, 'gpt2'; SentencePiece 'llama' is not). " + CONVERT_HINT
        )
    # No pre key: llama.cpp would use its own "default" regex; we choose plain
    # GPT-2 splitting, which is what such older byte-level GGUFs were made from.
    pre = _value(meta, "tokenizer.ggml.pre", "gpt2")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        digits = pre_tokenizers.Digits(individual_digits=True)
        pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    elif pre in _GPT2_PRE:
        pre_tokenizer = byte_level
    else:
        raise ModelLoadError(
            f"{path}: tokenizer pre-type {pre!r} is not supported (known: "
            f"{sorted(_DIGIT_SPLIT_PRE | _GPT2_PRE)}). " + CONVERT_HINT
        )

    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()

    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if types is not None else []
    # Control tokens (<|im_start|> ...) must match whole and count as special.
    tok.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t == _TOKEN_CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(tokens[i], normalized=False)
            for i, t in enumerate(types)
            if t == _TOKEN_USER_DEFINED
        ]
    )

    def token(key):
        i = _value(meta, f"tokenizer.ggml.{key}")
        return None if i is None or i >= len(tokens) else tokens[i]

    bos, eos = token("bos_token_id"), token("eos_token_id")
    if bos is not None and _value(meta, "tokenizer.ggml.add_bos_token", False):
        tok.post_processor = TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))],
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=_value(meta, "tokenizer.chat_template"),
    )
    # End-of-turn ids (e.g. Llama 3's <|eot_id|>) also stop generation.
    eos_ids = [
        _value(meta, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")
    ]
    eos_ids = [i for i in eos_ids if i is not None]
    return TokenizerWrapper(hf, BPEStreamingDetokenizer, eos_token_ids=eos_ids)
