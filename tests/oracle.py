"""The masked-dense oracle (DESIGN: "Evaluation protocol").

Run the patched model through chunked prefill and single-token decode, recording
which (layer, KV head, position) entries each call could see. Then run the
*unpatched* model densely over the whole sequence with, in every layer, a mask
that hides exactly the evicted entries, and compare the logits of every token.
This checks the eviction machinery independently of how rows are scored.
"""

from __future__ import annotations

import contextlib
import importlib

import mlx.core as mx
import numpy as np

import veloxpatch
from veloxpatch.caches.base import VeloxCache


def _visible_rows(cache, B, H):
    """Positions each KV head holds before a call, as a list of int arrays (B=1)."""
    if cache.empty():
        return [np.zeros(0, np.int64) for _ in range(H)]
    pos = np.array(
        cache.positions_view()
        if hasattr(cache, "positions_view")
        else mx.broadcast_to(mx.arange(cache.rows), (B, H, cache.rows))
    )
    return [p[p < 2**31 - 1] for p in pos[0]]


def run_patched(model, tokens, chunks, algo, end_prompt=False, **options):
    """Logits of every token and, per layer, a [Hkv, N, N] visibility mask."""
    N = len(tokens)
    with veloxpatch.patched(model, algo=algo, **options) as patch:
        caches = patch.make_cache()
        sizes = list(chunks) + [1] * (N - sum(chunks))
        masks, outs, start = None, [], 0
        for i, L in enumerate(sizes):
            if end_prompt and i == len(chunks):
                patch.end_prompt(caches)
            before = []
            for c in caches:
                if not isinstance(c, VeloxCache):
                    raise AssertionError(
                        "oracle expects veloxpatch caches on all layers"
                    )
                before.append(c)
            x = mx.array(tokens[start : start + L])[None]
            snapshot = None
            if masks is not None:
                snapshot = [_visible_rows(c, 1, masks[0].shape[0]) for c in caches]
            outs.append(model(x, cache=caches)[0])
            mx.eval(outs[-1])
            if masks is None:
                H = caches[0].keys.shape[1]
                masks = [np.zeros((H, N, N), bool) for _ in caches]
                snapshot = [[np.zeros(0, np.int64)] * H for _ in caches]
            for layer, rows in enumerate(snapshot):
                for h, kept in enumerate(rows):
                    for q in range(start, start + L):
                        masks[layer][h, q, kept] = True
                        masks[layer][h, q, start : q + 1] = True
            start += L
        return mx.concatenate(outs, axis=0), masks, caches


@contextlib.contextmanager
def per_layer_masks(model, masks):
    """Make the model file's attention use masks[layer] (expanded to query heads)."""
    module = importlib.import_module(type(model.layers[0].self_attn).__module__)
    original = module.scaled_dot_product_attention
    state = {"layer": 0}

    def masked_sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        m = masks[state["layer"] % len(masks)]
        state["layer"] += 1
        n_rep = queries.shape[1] // m.shape[0]
        full = mx.array(np.repeat(m, n_rep, axis=0))[None]
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=full
        )

    module.scaled_dot_product_attention = masked_sdpa
    try:
        yield
    finally:
        module.scaled_dot_product_attention = original


def oracle_logits(model, tokens, masks):
    with per_layer_masks(model, masks):
        return model(mx.array(tokens)[None])[0]


def check_oracle(model, tokens, chunks, algo, atol=1e-5, **options):
    """Max |patched - oracle| over all logits; also returns the caches."""
    patched, masks, caches = run_patched(model, tokens, chunks, algo, **options)
    dense = oracle_logits(model, tokens, masks)
    evicted = sum(int((~m).sum()) for m in masks)  # includes causal zeros
    return mx.abs(patched - dense).max().item(), masks, caches, evicted
