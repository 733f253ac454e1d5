"""Calibration files: their formats, writing one (`write`, with the
fingerprint of the model it was calibrated on) and loading one checked against
the model it is bound to (`Options.bind` hands over the model's dims, which
carry its fingerprint). Each kind's module (`qfilters`, `a2ats`, `kvzap`)
writes its own arrays through `write`; the caches load them from here.

A file is safetensors with a format string, the model's fingerprint and, per
patched layer, its arrays, written with a checksum (`checked_io`). Loading it
for another model, or a damaged file, raises CalibrationError: the header is
checked before mlx reads it, the checksum after, then the values against what
the calibration guarantees (unit Q-Filters, a Cholesky factor and consistent
centroids), which catches a file that was written damaged. Sliding-window
layers keep mlx-lm's cache and have no calibration arrays.

Files also live in a per-user cache, `$VELOXPATCH_HOME` (default
`~/.cache/veloxpatch`), one folder per model fingerprint and one fixed name per
kind (`home_path`): `calibrate` without `out` writes there, and an option
naming no file is looked up there (`find`) for the model being bound, then
among the files the package ships (`shipped/`: the embedded model's kvzap
scorer, so auto can choose kvzap on a fresh install).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..checked_io import load_checked, save_checked, verify
from ..errors import CalibrationError

QFILTERS_FORMAT = "veloxpatch-qfilters/1"
CODEBOOK_FORMAT = "veloxpatch-a2ats/1"
KVZAP_FORMAT = "veloxpatch-kvzap/1"
SCORER_KINDS = ("linear", "mlp")
SCORER_TARGETS = ("kvzip+", "kvzip")  # what a surrogate predicts (absent: kvzip+)
RIDGE = 1e-3  # A2ATS: H is regularised by RIDGE x I (relative to trace D)
HOME_ENV = "VELOXPATCH_HOME"
SUFFIX = ".safetensors"
# files the package ships, one folder per model as in the cache (package data)
SHIPPED = Path(__file__).with_name("shipped")

log = logging.getLogger("veloxpatch.calibration")


# ---- the per-user cache ------------------------------------------------------------
def home() -> Path:
    """The calibration cache: `$VELOXPATCH_HOME`, else ~/.cache/veloxpatch
    (absolute, so the options that record a file from it stay valid)."""
    given = os.environ.get(HOME_ENV)
    return Path(os.path.abspath(os.path.expanduser(given or "~/.cache/veloxpatch")))


def model_key(fingerprint: dict) -> str:
    """The folder of one model: its type (for people) and a hash of its whole
    fingerprint (what tells two models apart)."""
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode())
    kind = re.sub(r"[^A-Za-z0-9_.-]", "_", str(fingerprint.get("model_type")))
    return f"{kind}-{digest.hexdigest()[:16]}"


def home_path(algo: str, fingerprint: dict) -> Path:
    """Where `calibrate` writes `algo`'s file for the model of `fingerprint`
    without `out`: one name per kind and model, so a re-run replaces it."""
    return home() / model_key(fingerprint) / f"{algo}{SUFFIX}"


def home_for_writing(algo: str, fingerprint: dict) -> Path:
    """`home_path`, its folder made (a refusal is one CalibrationError)."""
    path = home_path(algo, fingerprint)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CalibrationError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def shipped_path(algo: str, fingerprint: dict) -> Path:
    """`algo`'s file for the model of `fingerprint` as the package ships it
    (the embedded model's kvzap scorer), looked up after the cache."""
    return SHIPPED / model_key(fingerprint) / f"{algo}{SUFFIX}"


def find(algo: str, dims, load):
    """(path, `load(path)`) of `algo`'s file for the model of `dims`: the
    calibration cache's, else the one the package ships; None when there is
    none or none can be used (then one warning says why: damaged, or made for
    another model or other options)."""
    for path in (
        home_path(algo, dims.fingerprint),
        shipped_path(algo, dims.fingerprint),
    ):
        if not path.is_file():  # (split: every rank takes part)
            continue
        try:
            loaded = load(str(path))
        except CalibrationError as e:
            log.warning("%s: skipped %s: %s", algo, path, e)
            continue
        log.info("%s: calibration file %s", algo, path)
        return str(path), loaded
    return None


def missing(algo: str, option: str, where) -> str:
    """The error of an algorithm that needs a file and found none in `where`."""
    return (
        f"{algo} needs {option}=FILE, calibrated on this model, and {where} has "
        f"none; make it with `veloxpatch calibrate --algo {algo}`"
    )


def none_for_any_model(algo: str) -> bool:
    """Whether the cache holds no `algo` file for any model (then one for this
    model cannot be there: said before a model is loaded)."""
    pattern = f"*/{algo}{SUFFIX}"
    return not any(home().glob(pattern)) and not any(SHIPPED.glob(pattern))


def group_mean(filters: mx.array, kv_heads: int) -> mx.array:
    """[Hq, D] -> [Hkv, D]: the mean over the query heads sharing a KV head
    (a Q-Filters file's KV-head filters)."""
    hq, d = filters.shape
    return filters.reshape(kv_heads, hq // kv_heads, d).mean(axis=1)


def write(
    path, arrays: dict, fingerprint: dict, fmt: str, algo: str, info=None, **extra
) -> None:
    """Write a calibration file of format `fmt` at exactly `path`, with the
    model's `fingerprint`, the run's `info` and `extra` string metadata."""
    meta = {
        "format": fmt,
        "algo": algo,
        "fingerprint": json.dumps(fingerprint, sort_keys=True),
        "info": json.dumps(info or {}, sort_keys=True),
        **extra,
    }
    save_checked(path, arrays, meta, CalibrationError)


def _patched_layers(dims) -> list[int]:
    """The layers a veloxpatch cache serves (sliding-window layers do not)."""
    return [i for i, sliding in enumerate(dims.sliding) if not sliding]


def read_checked(
    path, dims, fmt: str, what: str, instead="run without the file", split_ok=False
):
    """(arrays, metadata, our fingerprint) of a calibration file, after checking
    that it exists, is readable and intact, has format `fmt` and matches the
    model of `dims` (its fingerprint; the whole model's on a split model, where
    `split_ok`: the caller takes its heads and layers out of the file)."""
    if dims.shards.split and not split_ok:
        # the per-head arrays describe the whole model
        raise CalibrationError(
            f"{what} files cannot be used on a sharded model (model.shard or "
            f"pipeline) yet; {instead}"
        )
    ours = dims.fingerprint  # (split: every rank takes part, before any refusal)
    arrays, meta = load_checked(path, CalibrationError, what)
    if meta.get("format") != fmt:
        raise CalibrationError(
            f"{path} is not a veloxpatch {what} file (format "
            f"{meta.get('format')!r}, expected {fmt!r})"
        )
    verify(path, arrays, meta, CalibrationError, what)
    try:
        theirs = json.loads(meta["fingerprint"])
    except (KeyError, ValueError):
        theirs = None
    if not isinstance(theirs, dict):
        raise CalibrationError(f"{path}: damaged fingerprint")
    if theirs != ours:
        diff = sorted(k for k in ours if theirs.get(k) != ours[k])
        raise CalibrationError(
            f"{path} was calibrated for another model (differs in: "
            f"{', '.join(diff) or 'fields'})"
        )
    return arrays, meta, ours


# A unit vector in float32 (an SVD's singular vector) is 1 to ~1e-7.
UNIT_TOLERANCE = 1e-4


def _norms(x: mx.array) -> np.ndarray:
    return np.linalg.norm(np.array(x, np.float64), axis=-1)


def load_filters(path, dims) -> list:
    """Per layer [Hkv, D] filters from `path`, checked against the model of
    `dims` (None for sliding-window layers). Each query head's filter is a unit
    vector and each KV head's is their mean over its group, so of norm in
    (0, 1]."""
    arrays, _, ours = read_checked(path, dims, QFILTERS_FORMAT, "Q-Filters")
    shape = {
        "query_heads": (ours["heads"], ours["head_dim"]),
        "kv_heads": (ours["kv_heads"], ours["head_dim"]),
    }
    filters = [None] * ours["layers"]
    for i in _patched_layers(dims):
        f = {k: arrays.get(f"layer.{i}.{k}") for k in shape}
        if any(f[k] is None or f[k].shape != shape[k] for k in shape):
            raise CalibrationError(f"{path}: damaged, layer {i} filters missing")
        if not all(bool(mx.isfinite(v).all().item()) for v in f.values()):
            raise CalibrationError(f"{path}: damaged, layer {i} filters not finite")
        q, kv = _norms(f["query_heads"]), _norms(f["kv_heads"])
        mean = group_mean(f["query_heads"].astype(mx.float32), ours["kv_heads"])
        if (
            np.abs(q - 1).max() > UNIT_TOLERANCE
            or not (kv > 0).all()
            or kv.max() > 1 + UNIT_TOLERANCE
            or np.abs(np.array(mean) - np.array(f["kv_heads"])).max() > UNIT_TOLERANCE
        ):
            raise CalibrationError(
                f"{path}: damaged, layer {i} filters are not unit vectors (query "
                "heads) and their group means (KV heads)"
            )
        filters[i] = f["kv_heads"].astype(mx.float32)
    return filters


def with_norms(book: dict) -> dict:
    return {**book, "tnorm2": (book["tcentroids"] ** 2).sum(-1)}


def load_codebook(path, far_position: int, dims) -> list:
    """Per layer {transform, tcentroids, centroids, tnorm2} (None for
    sliding-window layers), checked against the model of `dims` and against the
    b the caches will rotate queries to."""
    arrays, meta, ours = read_checked(path, dims, CODEBOOK_FORMAT, "A2ATS codebook")
    far = meta.get("far_position")
    if not (isinstance(far, str) and far.isascii() and far.isdigit()):
        raise CalibrationError(f"{path}: damaged, far_position {far!r} is not a number")
    if int(far) != far_position:
        raise CalibrationError(
            f"{path} was calibrated with far_position {far}, not {far_position}"
        )
    books = [None] * ours["layers"]
    for i in _patched_layers(dims):
        book = {
            k: arrays.get(f"layer.{i}.{k}")
            for k in ("transform", "tcentroids", "centroids")
        }
        if any(v is None for v in book.values()):
            raise CalibrationError(f"{path}: damaged, layer {i} codebook missing")
        why = _book_fault(book, ours["kv_heads"], ours["head_dim"])
        if why:
            raise CalibrationError(f"{path}: damaged, layer {i} codebook {why}")
        books[i] = with_norms(book)
    return books


# centroids @ transform gives tcentroids to float32 rounding times the
# condition number of L (at most sqrt(D / RIDGE), ~250 for D = 64): ~1e-5.
CONSISTENCY = 1e-3


def _book_fault(book: dict, kv_heads: int, head_dim: int) -> str | None:
    """Why `book` is not what `codebook.layer_codebook` writes, or None: L is
    the Cholesky factor of H (lower triangular, positive diagonal, |L|_F^2 =
    trace H = D(1 + RIDGE), or D for H = I), tcentroids = centroids @ L, the
    centroids (k-means over distinct keys) do not all coincide, and the squared
    norms the cache computes in float32 are finite."""
    lower, tc, c = (
        np.array(book[k], np.float64) for k in ("transform", "tcentroids", "centroids")
    )
    if (
        lower.shape != (kv_heads, head_dim, head_dim)
        or c.shape != tc.shape
        or c.ndim != 3
        or c.shape[0] != kv_heads
        or c.shape[1] < 1
        or c.shape[2] != head_dim
    ):
        return f"has shapes {[tuple(v.shape) for v in book.values()]}"
    if not all(np.isfinite(x).all() for x in (lower, tc, c)):
        return "is not finite"
    big = float(np.finfo(np.float32).max)
    if max((tc**2).sum(-1).max(), (c**2).sum(-1).max()) >= big:
        return "overflows float32"
    diagonal = np.diagonal(lower, axis1=1, axis2=2)
    trace = (lower**2).sum((1, 2)) / head_dim
    if (
        np.triu(lower, 1).any()
        or (diagonal <= 0).any()
        or (trace < 1 - CONSISTENCY).any()
        or (trace > 1 + RIDGE + CONSISTENCY).any()
    ):
        return "transform is not a Cholesky factor of a trace-normalised H"
    err = np.linalg.norm(c @ lower - tc, axis=(1, 2))
    if (err > CONSISTENCY * np.linalg.norm(tc, axis=(1, 2))).any():
        return "centroids and transformed centroids disagree"
    if c.shape[1] > 1 and not (np.abs(c - c[:, :1]).max(axis=(1, 2)) > 0).all():
        return "centroids all coincide"
    return None


class Surrogates(list):
    """kvzap's surrogates layer by layer, and the scores they predict
    (`target`: "kvzip+" or "kvzip")."""

    def __init__(self, layers, target: str):
        super().__init__(layers)
        self.target = target


def load_scorer(path, dims, hidden: int | None = None) -> Surrogates:
    """Per layer of the whole model, kvzap surrogates {w1, b1[, w2, b2]}
    (float32; None for sliding-window layers and, on a split model, layers
    of other processes) from `path`, checked against the model of `dims`:
    every layer maps the same input width (`hidden`, where the model says it)
    to one score per KV head, with finite weights. A split model's rank keeps
    the outputs of its KV heads (the hidden state is whole on every rank)."""
    arrays, meta, ours = read_checked(
        path, dims, KVZAP_FORMAT, "kvzap scorer", split_ok=True
    )
    kind, target = meta.get("kind"), meta.get("target", "kvzip+")
    if kind not in SCORER_KINDS:
        raise CalibrationError(f"{path}: damaged, surrogate kind {kind!r}")
    if target not in SCORER_TARGETS:
        raise CalibrationError(f"{path}: damaged, surrogate target {target!r}")
    names = ("w1", "b1", "w2", "b2") if kind == "mlp" else ("w1", "b1")
    heads_out = ("w2", "b2") if kind == "mlp" else ("w1", "b1")
    layers = [None] * ours["layers"]
    widths = set()
    for local in _patched_layers(dims):
        i = dims.shards.layer_offset + local
        w = {k: arrays.get(f"layer.{i}.{k}") for k in names}
        if any(v is None for v in w.values()):
            raise CalibrationError(f"{path}: damaged, layer {i} surrogate missing")
        why = _scorer_fault(w, ours["kv_heads"])
        if why:
            raise CalibrationError(f"{path}: damaged, layer {i} surrogate {why}")
        widths.add(w["w1"].shape[0])
        for k in heads_out:
            w[k] = dims.shards.my_heads(w[k], axis=w[k].ndim - 1)
        layers[i] = {k: v.astype(mx.float32) for k, v in w.items()}
    if len(widths) > 1 or (hidden is not None and widths != {hidden}):
        raise CalibrationError(
            f"{path}: surrogates read hidden states of width {sorted(widths)}, "
            f"the model's is {hidden}"
        )
    return Surrogates(layers, target)


def _scorer_fault(w: dict, kv_heads: int) -> str | None:
    """Why `w` is not a surrogate of `kv_heads` outputs, or None."""
    shapes = {k: tuple(v.shape) for k, v in w.items()}
    d, h1 = shapes["w1"] if len(shapes["w1"]) == 2 else (0, 0)
    out = shapes["w2"][1] if "w2" in w and len(shapes["w2"]) == 2 else h1
    want = {"w1": (d, h1), "b1": (h1,)}
    if "w2" in w:
        want.update(w2=(h1, kv_heads), b2=(kv_heads,))
    if d < 1 or h1 < 1 or out != kv_heads or shapes != want:
        return f"has shapes {shapes}"
    if not all(bool(mx.isfinite(v).all().item()) for v in w.values()):
        return "is not finite"
    return None
