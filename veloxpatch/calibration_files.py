"""Calibration files: their formats, the model fingerprint they carry, reading
and writing them. Caches read these files (through `Options.bind`); running a
calibration, which patches a model, lives apart (`calibration.py`, `codebook.py`).

A file is safetensors with a format string, the model's fingerprint and, per
patched layer, its arrays. Loading it for another model, or a damaged file,
raises CalibrationError. Sliding-window layers keep mlx-lm's cache and have no
calibration arrays.
"""

from __future__ import annotations

import hashlib
import json
import os

import mlx.core as mx
import numpy as np

from .caches.qfilters import group_mean
from .errors import CalibrationError

QFILTERS_FORMAT = "veloxpatch-qfilters/1"
CODEBOOK_FORMAT = "veloxpatch-a2ats/1"


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


# ---- files -----------------------------------------------------------------------
def _write(path, arrays: dict, model, fmt: str, algo: str, info, **extra) -> None:
    meta = {
        "format": fmt,
        "algo": algo,
        "fingerprint": json.dumps(fingerprint(model), sort_keys=True),
        "info": json.dumps(info or {}, sort_keys=True),
        **extra,
    }
    mx.save_safetensors(os.fspath(path), arrays, metadata=meta)


def _patched_layers(model, dims) -> list[int]:
    """The layers a veloxpatch cache serves (sliding-window layers do not)."""
    if dims is None:
        from model_adapters import adapter_for

        dims = adapter_for(model).dims(model)
    return [i for i, sliding in enumerate(dims.sliding) if not sliding]


def save_filters(path, per_head: list, model, info: dict | None = None):
    """Write per-layer query-head filters (and their GQA means) with the model's
    fingerprint; layers given as None (sliding-window layers) are left out."""
    kv = fingerprint(model)["kv_heads"]
    arrays = {}
    for i, f in enumerate(per_head):
        if f is not None:
            arrays[f"layer.{i}.query_heads"] = f
            arrays[f"layer.{i}.kv_heads"] = group_mean(f, kv)
    _write(path, arrays, model, QFILTERS_FORMAT, "qfilters", info)


def read_checked(path, model, fmt: str, what: str):
    """(arrays, metadata, our fingerprint) of a calibration file, after checking
    that it exists, is readable, has format `fmt` and matches `model`."""
    path = os.fspath(path)
    from model_adapters import adapter_for

    if adapter_for(model).shards(model).split:
        # the fingerprint and the per-head arrays describe the whole model
        raise CalibrationError(
            f"{what} files cannot be used on a sharded model (model.shard or "
            "pipeline) yet; run without the file"
        )
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


def load_filters(path, model, dims=None) -> list:
    """Per layer [Hkv, D] filters from `path`, checked against `model` (None for
    sliding-window layers)."""
    arrays, _, ours = read_checked(path, model, QFILTERS_FORMAT, "Q-Filters")
    filters = [None] * ours["layers"]
    for i in _patched_layers(model, dims):
        f = arrays.get(f"layer.{i}.kv_heads")
        if f is None or f.shape != (ours["kv_heads"], ours["head_dim"]):
            raise CalibrationError(f"{path}: damaged, layer {i} filters missing")
        if not bool(mx.isfinite(f).all().item()):
            raise CalibrationError(f"{path}: damaged, layer {i} filters not finite")
        filters[i] = f.astype(mx.float32)
    return filters


def with_norms(book: dict) -> dict:
    return {**book, "tnorm2": (book["tcentroids"] ** 2).sum(-1)}


def save_codebook(path, books: list, model, far_position: int, info=None):
    """Write per-layer codebooks (None for sliding-window layers) with the
    model's fingerprint and the far position b the queries were rotated to."""
    arrays = {
        f"layer.{i}.{k}": v
        for i, b in enumerate(books)
        if b is not None
        for k, v in b.items()
        if k != "tnorm2"  # derived, recomputed on load
    }
    far = str(far_position)
    _write(path, arrays, model, CODEBOOK_FORMAT, "a2ats", info, far_position=far)


def load_codebook(path, model, far_position: int, dims=None) -> list:
    """Per layer {transform, tcentroids, centroids, tnorm2} (None for
    sliding-window layers), checked against `model` and against the b the caches
    will rotate queries to."""
    arrays, meta, ours = read_checked(path, model, CODEBOOK_FORMAT, "A2ATS codebook")
    if meta.get("far_position") != str(far_position):
        raise CalibrationError(
            f"{path} was calibrated with far_position {meta.get('far_position')}, "
            f"not {far_position}"
        )
    books = [None] * ours["layers"]
    for i in _patched_layers(model, dims):
        book = {
            k: arrays.get(f"layer.{i}.{k}")
            for k in ("transform", "tcentroids", "centroids")
        }
        ok = all(
            v is not None and v.ndim == 3 and v.shape[0] == ours["kv_heads"]
            for v in book.values()
        )
        if not ok or not all(bool(mx.isfinite(v).all().item()) for v in book.values()):
            raise CalibrationError(f"{path}: damaged, layer {i} codebook")
        books[i] = with_norms(book)
    return books
