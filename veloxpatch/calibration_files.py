"""Calibration files: writing them with the model's fingerprint, and reading
them for a model (the caches read them through `Options.bind` with
`calibration_format`, which this wraps). Running a calibration, which patches a
model, lives apart (`calibration.py`, `codebook.py`).

A file is safetensors with a format string, the model's fingerprint and, per
patched layer, its arrays, written at exactly the path given with a checksum
(`checked_io`). Loading it for another model, or a damaged file, raises
CalibrationError: the header is checked before mlx reads it, the checksum after,
then the values against what the calibration guarantees (unit Q-Filters, a
Cholesky factor and consistent centroids), which catches a file that was
written damaged. Sliding-window layers keep mlx-lm's cache and have no
calibration arrays.
"""

from __future__ import annotations

import json

import mlx.core as mx

from model_adapters import adapter_for
from model_adapters.base import fingerprint

from . import calibration_format
from .calibration_format import (
    CODEBOOK_FORMAT,
    KVZAP_FORMAT,
    QFILTERS_FORMAT,
    group_mean,
    with_norms,
)
from .checked_io import save_checked
from .errors import CalibrationError

__all__ = [
    "fingerprint",
    "load_codebook",
    "load_filters",
    "load_scorer",
    "save_codebook",
    "save_filters",
    "save_scorer",
    "with_norms",
]


# ---- files -----------------------------------------------------------------------
def _write(path, arrays: dict, model, fmt: str, algo: str, info, **extra) -> None:
    meta = {
        "format": fmt,
        "algo": algo,
        "fingerprint": json.dumps(fingerprint(model), sort_keys=True),
        "info": json.dumps(info or {}, sort_keys=True),
        **extra,
    }
    save_checked(path, arrays, meta, CalibrationError)


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


def save_scorer(path, layers: list, model, kind: str, info=None, target="kvzip+"):
    """Write per-layer kvzap surrogates ({w1, b1[, w2, b2]}, None for
    sliding-window layers) of `kind` ("linear" or "mlp"), predicting `target`
    scores ("kvzip+" or "kvzip"), with the model's fingerprint."""
    arrays = {
        f"layer.{i}.{k}": v.astype(mx.float32)
        for i, w in enumerate(layers)
        if w is not None
        for k, v in w.items()
    }
    _write(path, arrays, model, KVZAP_FORMAT, "kvzap", info, kind=kind, target=target)


def load_scorer(path, model, dims=None) -> calibration_format.Surrogates:
    """kvzap surrogates of `path` checked against `model`."""
    from .caches.kvzap import hidden_size

    dims = dims or adapter_for(model).dims(model)
    return calibration_format.load_scorer(path, dims, hidden_size(model))


def load_filters(path, model, dims=None) -> list:
    """Q-Filters of `path` checked against `model` (`calibration_format`)."""
    return calibration_format.load_filters(path, dims or adapter_for(model).dims(model))


def load_codebook(path, model, far_position: int, dims=None) -> list:
    """A2ATS codebooks of `path` checked against `model` and its far position."""
    dims = dims or adapter_for(model).dims(model)
    return calibration_format.load_codebook(path, far_position, dims)
