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


def _record_attention(cache, log):
    """Record, at every attention call, the positions each KV head can see."""
    original = cache.attention

    def attention(q, keys, values, mask, scale):
        pos = np.array(cache.positions_view())[0]  # B = 1: [Hkv, T]
        log.append((cache.offset, q.shape[2], pos))
        return original(q, keys, values, mask, scale)

    cache.attention = attention  # instance attribute: this cache only


def run_patched(model, tokens, chunks, algo, end_prompt=False, **options):
    """Logits of every token and, per layer, a [Hkv, N, N] visibility mask built
    from what each attention call really held (kept rows plus the new ones)."""
    N = len(tokens)
    with veloxpatch.patched(model, algo=algo, **options) as patch:
        caches = patch.make_cache()
        logs = [[] for _ in caches]
        for c, log in zip(caches, logs):
            if not isinstance(c, VeloxCache):
                raise AssertionError("oracle expects veloxpatch caches on all layers")
            _record_attention(c, log)
        sizes = list(chunks) + [1] * (N - sum(chunks))
        outs, start = [], 0
        for i, L in enumerate(sizes):
            if end_prompt and i == len(chunks):
                patch.end_prompt(caches)
            x = mx.array(tokens[start : start + L])[None]
            outs.append(model(x, cache=caches)[0])
            mx.eval(outs[-1], [c.state for c in caches] if L > 1 else [])
            start += L
        masks = []
        for log in logs:
            H = log[0][2].shape[0]
            m = np.zeros((H, N, N), bool)
            for offset, L, pos in log:
                for h in range(H):
                    p = pos[h][pos[h] < 2**31 - 1]
                    for q in range(offset, offset + L):
                        m[h, q, p[p <= q]] = True
            masks.append(m)
        for c in caches:
            del c.attention
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


def numpy_decode_scores(q, keys, pos, offset, scale):
    """SnapKV's score under the buffered decode queries q [B, Hq, n, D] at
    positions offset - n..: summed probabilities, max-pooled over 7 positions
    (zero padding), mean over the GQA group; keys [B, Hkv, T, D]."""
    B, hq, n, _ = q.shape
    hkv, T = keys.shape[1], keys.shape[2]
    g = hq // hkv
    out = np.zeros((B, hkv, T))
    qpos = np.arange(offset - n, offset)
    for b in range(B):
        for h in range(hq):
            logits = q[b, h] @ keys[b, h // g].T * scale
            logits = np.where(pos[b, h // g][None, :] <= qpos[:, None], logits, -np.inf)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            summed = (p / p.sum(-1, keepdims=True)).sum(0)
            padded = np.pad(summed, 3)
            pooled = np.max([padded[i : i + T] for i in range(7)], axis=0)
            out[b, h // g] += pooled / g
    return out


def numpy_tail_probs(c) -> np.ndarray:
    """[Hkv, T] each row's largest probability under cache `c`'s buffered tail
    queries (the last n prompt queries, ending at its newest row) and the GQA
    group, a numpy softmax over the rows it holds (batch 1)."""
    q = np.array(c.tail_queries, dtype=np.float64)[0]  # [Hq, n, D]
    keys = np.array(c._view()[0], dtype=np.float64)[0]  # [Hkv, T, D]
    (Hkv, T), n = keys.shape[:2], q.shape[1]
    G = q.shape[0] // Hkv
    logits = np.einsum("hgnd,htd->hgnt", q.reshape(Hkv, G, n, -1), keys) * c.scale
    logits = np.where(np.arange(T) <= np.arange(T - n, T)[:, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p.max(axis=(1, 2))


def watch_decode_cuts(c, sinks: int, window: int) -> list:
    """Check every eviction of cache `c` against `numpy_decode_scores` of its
    buffered decode queries: the scores it cuts by, the sinks and the `window`
    newest rows kept, and every other kept row scoring at least what was
    dropped. Returns the list of each cut's n_keep, filled as cuts happen
    (cuts before any decode query, the prompt's, pass unchecked)."""
    seen = []
    evict = c.evict_to

    def checked(n_keep, scores, counts=None):
        if c.in_prompt or c.decode_queries is None:
            return evict(n_keep, scores, counts)
        keys, _ = c._view()
        pos = np.array(c.positions_view())
        ref = numpy_decode_scores(
            np.array(c.decode_queries, dtype=np.float32),
            np.array(keys, dtype=np.float32),
            pos,
            c.offset,
            c.scale,
        )
        np.testing.assert_allclose(np.array(scores), ref, rtol=1e-4, atol=1e-6)
        evict(n_keep, scores, counts)
        kept = np.array(c.positions_view())
        for b in range(pos.shape[0]):
            for h in range(pos.shape[1]):
                row, held = pos[b, h], set(kept[b, h].tolist())
                must = (row < sinks) | (row >= c.offset - window)
                assert {int(p) for p in row[must]} <= held
                assert len(held) == n_keep
                won = np.array([p in held for p in row]) & ~must
                lost = ~np.array([p in held for p in row]) & ~must
                if won.any() and lost.any():  # ties may go either way
                    assert ref[b, h][won].min() >= ref[b, h][lost].max() - 1e-6
        seen.append(n_keep)

    c.evict_to = checked
    return seen
