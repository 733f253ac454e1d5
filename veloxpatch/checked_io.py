"""Safetensors files that veloxpatch writes (saved caches, calibration files):
written whole, at exactly the path given, with a checksum; read back checked.

- ``save_checked(path, arrays, metadata, error)`` writes ``path`` itself (mlx
  would append ``.safetensors`` to a path without that suffix; here the name
  given is the name written), through a temporary file in the same directory
  and a rename, so a failed write leaves any older file intact. The metadata
  gains ``CHECKSUM_KEY``: the SHA-256 of every other metadata entry and of every
  array's name, dtype, shape and bytes, in sorted order.
- ``load_checked(path, error, what)`` checks the header in Python
  (`loading.safetensors_header.check_safetensors`), then reads the file with ``mx.load``
  whatever its suffix; ``verify(...)`` recomputes the checksum. Callers check
  their format string between the two, so a file of another kind is named as
  such rather than as "damaged".

Every failure raises ``error`` (a VeloxpatchError subclass) with one line that
names the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid

import mlx.core as mx
import numpy as np

from .loading.safetensors_header import check_safetensors

CHECKSUM_KEY = "veloxpatch.sha256"


def checksum(arrays: dict, metadata: dict) -> str:
    """SHA-256 over the metadata (less the checksum itself) and the arrays,
    each array as its name, dtype, shape and row-major bytes."""
    digest = hashlib.sha256()
    for key in sorted(metadata):
        if key != CHECKSUM_KEY:
            digest.update(json.dumps([key, metadata[key]]).encode() + b"\n")
    for name in sorted(arrays):
        a = arrays[name]
        digest.update(json.dumps([name, str(a.dtype), list(a.shape)]).encode())
        digest.update(np.asarray(mx.view(a.reshape(-1), mx.uint8)).tobytes())
    return digest.hexdigest()


def save_checked(path, arrays: dict, metadata: dict, error) -> None:
    """Write `arrays` and `metadata` (plus their checksum) to exactly `path`."""
    path = os.fspath(path)
    meta = {**metadata, CHECKSUM_KEY: checksum(arrays, metadata)}
    # mx.save_safetensors keeps a name that ends in .safetensors as it is.
    tmp = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp.safetensors"
    try:
        mx.save_safetensors(tmp, arrays, metadata=meta)
        os.replace(tmp, path)
    except (OSError, RuntimeError, ValueError) as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise error(f"cannot write {path}: {reason}") from None


def load_checked(path, error, what: str) -> tuple[dict, dict]:
    """(arrays, metadata) of the safetensors file `path`, any suffix, after
    checking its header; the checksum is left to `verify`."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise error(f"{what} file not found: {path}")
    if not os.path.isfile(path):
        raise error(f"{what} file {path} is not a regular file")
    check_safetensors(path, error)
    try:
        return mx.load(path, format="safetensors", return_metadata=True)
    except Exception as e:  # mlx raises RuntimeError/ValueError on bad files
        raise error(f"cannot read {what} file {path}: {e}") from None


def verify(path, arrays: dict, metadata: dict, error, what: str) -> None:
    """Raise `error` unless the file's checksum matches what was read."""
    want = metadata.get(CHECKSUM_KEY)
    if want is None:
        raise error(
            f"{path}: {what} file has no checksum (written before veloxpatch "
            "checked its files, or not by veloxpatch); write it again"
        )
    try:
        got = checksum(arrays, metadata)
    except Exception as e:  # arrays load lazily: a read error surfaces here
        raise error(f"cannot read {what} file {path}: {e}") from None
    if got != want:
        raise error(f"{path}: damaged {what} file (checksum mismatch)")
