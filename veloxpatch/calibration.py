"""Calibration from the model's real queries, captured through the patch seam.

Q-Filters (Godey et al., 2025): per layer and query head, the first right
singular vector of post-RoPE queries (the frame the cache scores keys in),
oriented so that most queries project positively, averaged over each GQA group.

A filters file (safetensors) carries a model fingerprint and a format version;
loading it for another model, or a damaged file, raises CalibrationError.
"""

from __future__ import annotations

import hashlib
import json
import os

import mlx.core as mx
import numpy as np

from .caches.full import FullCache
from .errors import CalibrationError

FORMAT = "veloxpatch-qfilters/1"
MAX_VECTORS = 3000  # queries kept per layer and query head


# ---- model fingerprint ------------------------------------------------------------
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


def fingerprint(model) -> dict:
    """What identifies a model for its calibration: shape, RoPE and a hash of a
    fixed sample of attention weights in fp16 (quantized or not, any OS)."""
    from model_adapters.base import head_dim, model_type

    attn = [layer.self_attn for layer in model.layers]
    args = getattr(model, "args", None)
    digest = hashlib.sha256()
    for i in sorted({0, len(attn) // 2, len(attn) - 1}):
        for name in ("q_proj", "k_proj"):
            digest.update(_weight_sample(getattr(attn[i], name)).tobytes())
    rope = {
        k: getattr(args, k, None)
        for k in ("rope_theta", "rope_scaling", "rope_traditional")
    }
    q = attn[0]
    return {
        "model_type": model_type(model),
        "layers": len(attn),
        "heads": int(q.n_heads),
        "kv_heads": int(q.n_kv_heads),
        "head_dim": head_dim(q),
        "rope": json.loads(json.dumps(rope, default=str)),
        "weights_sha256": digest.hexdigest(),
    }


# ---- query capture ---------------------------------------------------------------
class QueryCapture(FullCache):
    """A full cache that keeps the post-RoPE queries at chosen positions."""

    name = "query-capture"

    def __init__(self, *args, positions=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.wanted = np.asarray(sorted(positions), dtype=np.int64)
        self.kept: list[mx.array] = []  # [B, Hq, n, D] pieces

    def after_attend(self, q, new_rows):
        start = self.offset - new_rows
        lo, hi = np.searchsorted(self.wanted, [start, self.offset])
        if hi > lo:
            idx = mx.array(self.wanted[lo:hi] - start)
            self.kept.append(q[:, :, idx].astype(mx.float32))

    def side_arrays(self):
        return super().side_arrays() + self.kept[-1:]

    def queries(self) -> mx.array:
        """[Hq, n, D]"""
        return mx.concatenate(self.kept, axis=2)[0]


def capture_queries(model, ids, chunk=1024, max_vectors=MAX_VECTORS, seed=0, tick=None):
    """Per layer [Hq, n, D] post-RoPE queries at up to `max_vectors` positions of
    `ids` (a seeded sample), the model run over `ids` in chunks of `chunk`."""
    from . import api

    rng = np.random.default_rng(seed)
    n = min(max_vectors, len(ids))
    positions = rng.choice(len(ids), size=n, replace=False)
    with api.patched(model, algo=QueryCapture) as patch:
        layers = len(patch.sites)
        caches = [QueryCapture(positions=positions, layer=i) for i in range(layers)]
        for start in range(0, len(ids), chunk):
            piece = mx.array(ids[start : start + chunk])[None]
            mx.eval(model(piece, cache=caches))
            if tick is not None:
                tick(piece.shape[1])
    return [c.queries() for c in caches]


def query_filters(queries: mx.array) -> mx.array:
    """[Hq, D] unit filters: per head, v1 of the SVD of its queries [Hq, n, D],
    signed so that most queries project positively. SVD runs on the CPU."""
    with mx.stream(mx.cpu):
        _, _, vt = mx.linalg.svd(queries.astype(mx.float32))
        v1 = vt[:, 0, :]  # [Hq, D]
        proj = (queries * v1[:, None, :]).sum(-1)  # [Hq, n]
        positive = (proj > 0).mean(-1) >= 0.5
        v1 = mx.where(positive[:, None], v1, -v1)
        mx.eval(v1)
    return v1


def group_mean(filters: mx.array, kv_heads: int) -> mx.array:
    """[Hq, D] -> [Hkv, D]: the mean over the query heads sharing a KV head."""
    hq, d = filters.shape
    return filters.reshape(kv_heads, hq // kv_heads, d).mean(axis=1)


# ---- files -----------------------------------------------------------------------
def save_filters(path, per_head: list[mx.array], model, info: dict | None = None):
    """Write per-layer query-head filters (and their GQA means) with the model's
    fingerprint."""
    kv = fingerprint(model)["kv_heads"]
    arrays = {}
    for i, f in enumerate(per_head):
        arrays[f"layer.{i}.query_heads"] = f
        arrays[f"layer.{i}.kv_heads"] = group_mean(f, kv)
    meta = {
        "format": FORMAT,
        "algo": "qfilters",
        "fingerprint": json.dumps(fingerprint(model), sort_keys=True),
        "info": json.dumps(info or {}, sort_keys=True),
    }
    mx.save_safetensors(os.fspath(path), arrays, metadata=meta)


def read_checked(path, model, fmt: str, what: str):
    """(arrays, metadata, our fingerprint) of a calibration file, after checking
    that it exists, is readable, has format `fmt` and matches `model`."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CalibrationError(f"{what} file not found: {path}")
    try:
        arrays, meta = mx.load(path, return_metadata=True)
    except Exception as e:  # mlx raises RuntimeError/ValueError on bad files
        raise CalibrationError(f"cannot read {what} file {path}: {e}") from None
    if meta.get("format") != fmt:
        raise CalibrationError(
            f"{path} is not a veloxpatch {what} file (format "
            f"{meta.get('format')!r}, expected {fmt!r})"
        )
    try:
        theirs = json.loads(meta["fingerprint"])
    except (KeyError, ValueError):
        raise CalibrationError(f"{path}: damaged fingerprint") from None
    ours = fingerprint(model)
    if theirs != ours:
        diff = sorted(k for k in ours if theirs.get(k) != ours[k])
        raise CalibrationError(
            f"{path} was calibrated for another model (differs in: "
            f"{', '.join(diff) or 'fields'})"
        )
    return arrays, meta, ours


def load_filters(path, model) -> list[mx.array]:
    """Per layer [Hkv, D] filters from `path`, checked against `model`."""
    arrays, _, ours = read_checked(path, model, FORMAT, "Q-Filters")
    filters = []
    for i in range(ours["layers"]):
        f = arrays.get(f"layer.{i}.kv_heads")
        if f is None or f.shape != (ours["kv_heads"], ours["head_dim"]):
            raise CalibrationError(f"{path}: damaged, layer {i} filters missing")
        if not bool(mx.isfinite(f).all().item()):
            raise CalibrationError(f"{path}: damaged, layer {i} filters not finite")
        filters.append(f.astype(mx.float32))
    return filters


ALGOS = ("qfilters", "a2ats")


def check_algo(algo: str) -> None:
    if algo not in ALGOS:
        raise CalibrationError(
            f"calibration exists for {' and '.join(ALGOS)} only, not {algo!r}"
        )


# ---- the whole job -----------------------------------------------------------------
def calibrate(
    model,
    tokenizer,
    algo="qfilters",
    *,
    tokens=4096,
    text="calibration",
    out=None,
    seed=0,
    tick=None,
    codebook_size=4096,
    far_position=2048,
):
    """Calibrate `algo` on `tokens` tokens of calibration prose (the half never
    used for evaluation, or a file), written to `out` with the model's
    fingerprint when given. qfilters: per layer [Hq, D] query-head filters and
    the queries; a2ats: per layer codebooks and the captured (keys, queries)."""
    from .eval.text import prose_tokens

    check_algo(algo)
    ids = prose_tokens(tokenizer, tokens, text)
    info = {"tokens": tokens, "text": str(text), "seed": seed}
    if algo == "a2ats":
        from .codebook import calibrate_codebook, save_codebook

        books, captured = calibrate_codebook(
            model,
            ids,
            size=codebook_size,
            far_position=far_position,
            seed=seed,
            tick=tick,
        )
        if out is not None:
            info.update(size=codebook_size, vectors=int(captured[0][0].shape[1]))
            save_codebook(out, books, model, far_position, info)
        return books, captured
    queries = capture_queries(model, ids, seed=seed, tick=tick)
    per_head = [query_filters(q) for q in queries]
    if out is not None:
        info["vectors"] = int(queries[0].shape[1])
        save_filters(out, per_head, model, info)
    return per_head, queries
