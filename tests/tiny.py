"""Tiny seeded fp32 models of every supported architecture, for structure tests.

Weights are random but scaled up so attention is far from uniform (otherwise an
eviction bug could hide behind nearly flat softmaxes).
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes

VOCAB = 97
SHARPEN = 1.5
_COMMON = dict(
    hidden_size=64,
    num_hidden_layers=3,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=VOCAB,
    max_position_embeddings=4096,
)
# ministral3: attn_scale = 1 + beta*log(1 + floor(pos / 16)) differs from 1 after
# 16 tokens, well inside the test length; the rope is YaRN, as in the real model.
_MINISTRAL3 = dict(
    _COMMON,
    model_type="ministral3",
    head_dim=16,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "llama_4_scaling_beta": 0.5,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)
CONFIGS = {
    "llama": dict(
        _COMMON,
        model_type="llama",
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(_COMMON, model_type="mistral", tie_word_embeddings=False),
    "mistral_swa": dict(
        _COMMON,
        model_type="mistral",
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=8,
    ),
    "ministral3": _MINISTRAL3,
    "mistral3": dict(model_type="mistral3", text_config=dict(_MINISTRAL3)),
    "mistral3_llama": dict(
        model_type="mistral3", text_config=dict(_COMMON, model_type="llama")
    ),
    "qwen2": dict(_COMMON, model_type="qwen2"),
    "qwen2_moe": dict(
        _COMMON,
        model_type="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    "qwen3": dict(
        _COMMON,
        model_type="qwen3",
        head_dim=16,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
    "qwen3_moe": dict(
        _COMMON,
        model_type="qwen3_moe",
        head_dim=16,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
}
ARCHS = list(CONFIGS)


def tiny_model(arch: str, seed: int = 0, dtype=mx.float32, **overrides) -> nn.Module:
    config = copy.deepcopy(CONFIGS[arch])
    config.update(overrides)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    # Sharpen attention: larger q/k weights (and Qwen3's q/k norms) give peaked,
    # position-dependent softmaxes.
    params = []
    for name, p in tree_flatten(model.parameters()):
        if name.endswith(
            ("q_proj.weight", "k_proj.weight", "q_norm.weight", "k_norm.weight")
        ):
            p = p * SHARPEN
        params.append((name, p.astype(dtype)))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    model.eval()
    return model


def prompt_tokens(n: int, seed: int = 1) -> mx.array:
    mx.random.seed(seed)
    return mx.random.randint(0, VOCAB, (n,))


# kvzap needs a scorer file fitted to its model: contract options name this
# placeholder, and `resolve_options` writes a seeded random linear surrogate for
# the model at hand (structure, not quality: test_kvzap.py calibrates for real).
SCORER = "<tiny kvzap scorer>"
_SCORERS = None  # the directory, removed when the test process exits


def resolve_options(model, options: dict) -> dict:
    """`options` with the placeholder scorer replaced by a file for `model`."""
    if options.get("scorer") != SCORER:
        return options
    return {**options, "scorer": str(tiny_scorer(model))}


def dims_of(model):
    """The model's dims as its adapter reports them (what calibration files are
    loaded against)."""
    from model_adapters import adapter_for

    return adapter_for(model).dims(model)


def tiny_scorer(model, seed: int = 0):
    """A seeded random linear kvzap scorer for `model`, written once per model
    fingerprint: scores about N(0, 1), so threshold 0 drops about half."""
    import hashlib
    import json
    import tempfile
    from pathlib import Path

    from model_adapters.base import fingerprint
    from veloxpatch.calibration.kvzap import save_scorer

    global _SCORERS
    if _SCORERS is None:
        _SCORERS = tempfile.TemporaryDirectory(prefix="veloxpatch-scorers-")
    key = json.dumps(fingerprint(model), sort_keys=True) + str(seed)
    path = Path(_SCORERS.name) / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.st"
    if not path.exists():
        args = model.args
        attn = model.layers[0].self_attn
        mx.random.seed(seed)
        layers = [
            {
                "w1": mx.random.normal((args.hidden_size, attn.n_kv_heads))
                / args.hidden_size**0.5,
                "b1": mx.zeros((attn.n_kv_heads,)),
            }
            for _ in model.layers
        ]
        save_scorer(path, layers, model, "linear")
    return path
