"""The adapter contract: what differs between architectures, as data plus one function.

An adapter names the mlx-lm attention classes it wraps (with the call signature and
source hash it was written against), finds the attention modules of a model, and
turns one attention call into pre-RoPE queries, keys and values. It never knows
about algorithms.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from veloxpatch.errors import UnsupportedModelError
from veloxpatch.mlx_lm_internals import source_sha256
from veloxpatch.sharding import LOCAL, Shards

from .sharding import model_shards


@dataclass(frozen=True)
class AttentionTarget:
    """One mlx-lm attention class whose ``__call__`` veloxpatch wraps."""

    module: str  # e.g. "mlx_lm.models.llama"
    cls: str  # e.g. "Attention"
    # `python -m model_adapters.check module.Class` prints these two pins for
    # the installed mlx-lm, and whether an adapter's pins still match
    signature: str  # str(inspect.signature(cls.__call__)) when the adapter was written
    source_sha256: str  # of inspect.getsource(cls.__call__), same time
    # (attn, x) -> pre-RoPE q [B, Hq, L, D], k, v [B, Hkv, L, D]
    project: Callable[[Any, mx.array], tuple[mx.array, mx.array, mx.array]]
    # names of the call's parameters after x, in positional order
    params: tuple[str, ...] = ("mask", "cache")
    # (attn, L, offset, call) -> query scale or None (Ministral 3's attn_scale)
    query_scale: Callable[[Any, int, int, dict], Any] | None = None

    @property
    def key(self) -> str:
        return f"{self.module}.{self.cls}"

    def resolve(self) -> type:
        return getattr(importlib.import_module(self.module), self.cls)

    def bind(self, args: tuple, kwargs: dict) -> tuple[mx.array, dict]:
        """Split a call's arguments into x and a dict of the named parameters."""
        x = args[0] if args else kwargs["x"]
        call = dict(zip(self.params, args[1:]))
        call.update((k, v) for k, v in kwargs.items() if k != "x")
        return x, call


def call_source_sha256(cls: type) -> str:

    return source_sha256(cls.__call__)


def split_heads(t: mx.array, n_heads: int) -> mx.array:
    """[B, L, H*D] -> [B, H, L, D]."""
    B, L, _ = t.shape
    return t.reshape(B, L, n_heads, -1).transpose(0, 2, 1, 3)


def project_plain(attn, x: mx.array):
    """q/k/v projections of Llama, Mistral and Qwen2 (biases live in the Linear)."""
    q = split_heads(attn.q_proj(x), attn.n_heads)
    k = split_heads(attn.k_proj(x), attn.n_kv_heads)
    v = split_heads(attn.v_proj(x), attn.n_kv_heads)
    return q, k, v


def project_qk_norm(attn, x: mx.array):
    """Qwen3: RMSNorm per head on q and k before the transpose, as mlx-lm does."""
    B, L, _ = x.shape
    q = attn.q_norm(attn.q_proj(x).reshape(B, L, attn.n_heads, -1))
    k = attn.k_norm(attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1))
    v = split_heads(attn.v_proj(x), attn.n_kv_heads)
    return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v


@dataclass(frozen=True)
class ModelDims:
    """What algorithms may know of a model (through `Options.bind`), per layer."""

    heads: tuple[int, ...]  # query heads
    kv_heads: tuple[int, ...]
    head_dims: tuple[int, ...]
    ropes: tuple[Any, ...]  # each layer's rope module (A2ATS checks it)
    sliding: tuple[bool, ...]  # these layers keep mlx-lm's own cache
    # how the model is split across processes (veloxpatch.sharding); the
    # counts above are this rank's (its heads, its layers)
    shards: Shards = LOCAL
    model: Any = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def fingerprint(self) -> dict:
        """What identifies the model for its calibration files (computed once,
        when a file is read or written)."""
        return fingerprint(self.model, self.shards)

    @property
    def layers(self) -> int:
        return len(self.heads)


@dataclass(frozen=True)
class LayerSite:
    """One transformer block's attention, as the patcher sees it."""

    index: int
    attention: Any
    target: AttentionTarget
    sliding: bool  # sliding-window layers keep mlx-lm's own cache
    shards: Shards = LOCAL  # the model's split; global layer = offset + index


class Adapter:
    """One architecture family. Subclasses set the data and `targets_for`."""

    name: str = ""
    model_types: tuple[str, ...] = ()
    targets: tuple[AttentionTarget, ...] = ()

    def target_for(self, model) -> AttentionTarget:
        """The attention target of this model (some families dispatch on config)."""
        return self.targets[0]

    def sites(self, model) -> list[LayerSite]:
        target = self.target_for(model)
        cls = target.resolve()
        shards = self.shards(model)
        sites = []
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            if type(attn) is not cls:
                raise UnsupportedModelError(
                    f"layer {i} attention is {type(attn).__module__}."
                    f"{type(attn).__name__}, expected {target.key}"
                )
            sliding = _is_sliding(model, shards.layer_offset + i, layer)
            sites.append(LayerSite(i, attn, target, sliding, shards))
        return sites

    def shards(self, model) -> Shards:
        """How mlx-lm split the model across processes (model_adapters.sharding);
        raises if its heads were split unevenly."""
        return model_shards(model, [layer.self_attn for layer in model.layers])

    def dims(self, model) -> ModelDims:
        attn = [layer.self_attn for layer in model.layers]
        shards = self.shards(model)
        return ModelDims(
            heads=tuple(int(a.n_heads) for a in attn),
            kv_heads=tuple(int(a.n_kv_heads) for a in attn),
            head_dims=tuple(head_dim(a) for a in attn),
            ropes=tuple(a.rope for a in attn),
            sliding=tuple(
                _is_sliding(model, shards.layer_offset + i, la)
                for i, la in enumerate(model.layers)
            ),
            shards=shards,
            model=model,
        )


def _is_sliding(model, index: int, layer) -> bool:
    """`index`: the layer's global index (layer types list every layer)."""
    if getattr(layer, "use_sliding", False):
        return True
    types = getattr(getattr(model, "args", None), "layer_types", None)
    return bool(types) and index < len(types) and types[index] == "sliding_attention"


def head_dim(attn) -> int:
    """Per-head width of an mlx-lm attention module."""
    d = getattr(attn, "head_dim", None)
    return int(d) if d else int(attn.q_proj.weight.shape[0] // attn.n_heads)


def model_type(model) -> str:
    mt = getattr(model, "model_type", None)
    if mt is None:
        mt = getattr(getattr(model, "args", None), "model_type", None)
    return str(mt)


def _weight_sample(linear) -> np.ndarray:
    """The first 8 rows x 64 columns of a Linear's weight, dequantized if needed
    (with float32 scales, as models.dequantize_to_float32 does), in fp16."""
    w = linear.weight
    if "scales" in linear:
        biases = linear.get("biases")
        w = mx.dequantize(
            w,
            linear.scales.astype(mx.float32),
            None if biases is None else biases.astype(mx.float32),
            group_size=linear.group_size,
            bits=linear.bits,
        )
    return np.array(w[:8, :64].astype(mx.float16))


def fingerprint(model, shards: Shards = LOCAL) -> dict:
    """What identifies a model for its calibration: shape, RoPE and a hash of a
    fixed sample of attention weights in fp16 (quantized or not, any OS).
    On a split model, the whole model's (`whole_samples`): every rank takes
    part and gets the same answer."""
    attn = [layer.self_attn for layer in model.layers]
    args = getattr(model, "args", None)
    layers = shards.num_layers or len(attn)
    picks = sorted({0, layers // 2, layers - 1})
    if shards.split:
        samples = whole_samples(attn, picks, shards)
    else:
        samples = [
            _weight_sample(getattr(attn[i], name))
            for i in picks
            for name in ("q_proj", "k_proj")
        ]
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(sample.tobytes())
    rope = {
        k: getattr(args, k, None)
        for k in ("rope_theta", "rope_scaling", "rope_traditional")
    }
    q = attn[0]
    return {
        "model_type": model_type(model),
        "layers": layers,
        "heads": int(q.n_heads) * shards.size,
        "kv_heads": int(q.n_kv_heads) * shards.size,
        "head_dim": head_dim(q),
        "rope": json.loads(json.dumps(rope, default=str)),
        "weights_sha256": digest.hexdigest(),
    }


def whole_samples(attn: list, picks: list[int], shards: Shards) -> list:
    """The unsplit model's weight samples of global layers `picks`, summed over
    the ranks: each is taken by the rank holding that layer (pipeline) and the
    first rows of its projections (tensor rank 0: a sharded projection keeps
    a contiguous run of output rows), zeros from every other rank."""
    names = ("q_proj", "k_proj")
    shapes = [_weight_sample(getattr(attn[0], n)).shape for n in names] * len(picks)
    mine = []
    for i in picks:
        local = i - shards.layer_offset
        here = 0 <= local < len(attn) and shards.rank == 0
        for name in names:
            mine.append(_weight_sample(getattr(attn[local], name)) if here else None)
    flat = [
        np.zeros(shape, np.float16) if m is None or m.shape != shape else m
        for m, shape in zip(mine, shapes)
    ]
    # pipeline stages know no group of their own: the world's is theirs
    group = shards.group if shards.size > 1 else mx.distributed.init()
    joined = mx.array(np.concatenate([f.reshape(-1) for f in flat]), mx.float32)
    summed = np.array(mx.distributed.all_sum(joined, group=group).astype(mx.float16))
    cuts = np.cumsum([int(np.prod(shape)) for shape in shapes])[:-1]
    return [part.reshape(shape) for part, shape in zip(np.split(summed, cuts), shapes)]
