"""KVzip+'s weights (Jegou et al. 2026, KVzap): a pair's repeat probability times
||W_o v|| of its query head over ||x|| of the repeat query's attention input,
what the pair adds to the residual stream relative to it."""

from __future__ import annotations

import weakref

import mlx.core as mx

# (id of an output projection, query heads) -> (the projection, its weight, gram)
_GRAMS: dict[tuple[int, int], tuple] = {}


def output_gram(o_proj, n_query_heads: int) -> mx.array:
    """[Hq, D, D] W_o^T W_o of each query head's slice of the output projection,
    made once per projection (and its weight) and shared by every cache of the
    layer: it is the model's, not a sequence's state."""
    key = (id(o_proj), n_query_heads)
    hit = _GRAMS.get(key)
    if hit is not None and hit[0]() is o_proj and hit[1] is o_proj.weight:
        return hit[2]
    w = _dense_weight(o_proj).astype(mx.float32)  # [hidden, Hq * D]
    w = w.reshape(w.shape[0], n_query_heads, -1)
    gram = mx.einsum("nhd,nhe->hde", w, w)
    mx.eval(gram)
    gone = weakref.ref(o_proj, lambda _, key=key: _GRAMS.pop(key, None))
    _GRAMS[key] = (gone, o_proj.weight, gram)
    return gram


def plus_scores(probs, values, x, gram) -> mx.array:
    """[B, Hkv, C] KVzip+ scores of C context rows from their probabilities
    [B, Hkv, G, L, C] under L repeat queries whose attention inputs are x
    [B, L, hidden], values [B, Hkv, C, D]: max over queries and the GQA group."""
    B, Hkv, G = probs.shape[:3]
    x_norm = mx.linalg.norm(x.astype(mx.float32), axis=-1)  # [B, L]
    best = (probs / x_norm[:, None, None, :, None]).max(axis=3)  # [B, Hkv, G, C]
    gram = gram.reshape(Hkv, G, *gram.shape[1:])
    v = values.astype(mx.float32)[:, :, None]  # [B, Hkv, 1, C, D]
    wv = mx.sqrt(mx.maximum(((v @ gram) * v).sum(-1), 0))  # ||W_o^h v||
    return (best * wv).max(axis=2)


def _dense_weight(linear) -> mx.array:
    """The weight of an mlx Linear, dequantized if it is a QuantizedLinear."""
    if hasattr(linear, "scales"):
        return mx.dequantize(
            linear.weight,
            linear.scales,
            linear.get("biases"),
            linear.group_size,
            linear.bits,
        )
    return linear.weight
