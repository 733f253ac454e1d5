"""GGUF and safetensors headers, checked in Python before ``mx.load`` sees a file.

``mx.load`` trusts a GGUF header (gguflib walks the mapped file unchecked): an
overwritten count, length or offset reads past the end of the file and kills the
process (SIGSEGV; SIGFPE for alignment 0 or the removed Q4_2/Q4_3 types).
``check_gguf`` walks the header with every count, length, dimension and offset
checked against the bytes there, then refuses what mlx 0.32 cannot read or
crashes on (float64 metadata, which it misreads; nested arrays; tensor types
it has no reader for). ``check_safetensors`` (``safetensors_header``) checks
the 8-byte header length, the JSON header and every tensor's offsets. Both open
files with ``mapped`` (here), read only the header and raise ``error``
(FileFormatError unless the caller passes its own VeloxpatchError subclass)
with one line that names the file.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import NamedTuple

from ..errors import FileFormatError

# ---- GGUF -------------------------------------------------------------------------
# Metadata value types: fixed sizes; 8 = string, 9 = array, 12 = float64.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _FLOAT64, _UINT32 = 8, 9, 12, 4
_NESTING = 8  # deeper arrays are refused as damage, not recursed into
# Tensor types mlx 0.32 reads (others: "gguf_tensor_to_f16 failed", or a crash
# for the removed types 4 and 5): name, values per block, bytes per block.
TENSOR_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    12: ("Q4_K", 256, 144),
    14: ("Q6_K", 256, 210),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    30: ("BF16", 1, 2),
}
MAX_DIMS = 4  # GGML_MAX_DIMS
_INT_MAX = 2**31 - 1  # mlx reads dimensions and array lengths as int


class GGUFInfo(NamedTuple):
    version: int
    tensors: int
    keys: int
    alignment: int
    data_offset: int


class _Walker:
    """A cursor over the mapped header that refuses to step past the file end."""

    def __init__(self, buf, path, error):
        self.buf, self.pos, self.size = buf, 0, len(buf)
        self.path, self.error = path, error

    def fail(self, why):
        return self.error(f"{self.path}: damaged or unreadable GGUF file: {why}")

    def take(self, n, what):
        if n > self.size - self.pos:
            raise self.fail(
                f"{what} runs past the end of the file ({n} bytes at offset "
                f"{self.pos}, {self.size - self.pos} left)"
            )
        start, self.pos = self.pos, self.pos + n
        return start

    def unpack(self, fmt, what):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))

    def count(self, n, min_size, what):
        """`n` items of at least `min_size` bytes each must fit in what is left."""
        if n * min_size > self.size - self.pos:
            raise self.fail(
                f"{what} claims {n} entries, more than the {self.size - self.pos} "
                "bytes left can hold"
            )

    def string(self, what):
        (n,) = self.unpack("<Q", f"{what} length")
        if n > _INT_MAX:
            raise self.fail(f"{what} claims {n} bytes")
        start = self.take(n, what)
        try:
            return bytes(self.buf[start : start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at offset {start} is not UTF-8") from None


def _min_size(vtype):
    return _FIXED.get(vtype) or {_STRING: 8, _ARRAY: 12}.get(vtype)


def _value(w, vtype, what, limits, depth=0):
    """Step over one metadata value; note in `limits` what mlx cannot read."""
    if vtype == _FLOAT64:
        limits.append(f"{what} is float64, which mlx misreads")
    if vtype in _FIXED:
        w.take(_FIXED[vtype], what)
    elif vtype == _STRING:
        w.string(what)
    elif vtype == _ARRAY:
        etype, n = w.unpack("<IQ", f"{what} array header")
        size = _min_size(etype)
        if size is None:
            raise w.fail(f"{what} is an array of unknown type {etype}")
        if n > _INT_MAX:
            raise w.fail(f"{what} claims {n} elements")
        w.count(n, size, f"{what} array")
        if etype == _ARRAY:
            if depth + 1 >= _NESTING:
                raise w.fail(f"{what} nests arrays more than {_NESTING} deep")
            limits.append(f"{what} is an array of arrays, which mlx cannot read")
        if etype in _FIXED:
            if etype == _FLOAT64:
                limits.append(f"{what} is a float64 array, which mlx misreads")
            w.take(n * size, what)
        else:
            for i in range(n):
                _value(w, etype, f"{what}[{i}]", limits, depth + 1)
    else:
        raise w.fail(f"{what} has unknown value type {vtype}")


def _walk_gguf(w: _Walker) -> GGUFInfo:
    magic = bytes(w.buf[: min(4, w.size)])
    if w.size < 24 or magic != b"GGUF":
        raise w.fail(f"no GGUF header (starts with {magic!r}, {w.size} bytes)")
    _, version, n_tensors, n_kv = w.unpack("<4sIQQ", "header")
    if version not in (2, 3):
        raise w.fail(f"version {version} (only GGUF versions 2 and 3 are read)")
    w.count(n_kv, 13, "metadata")  # key length 8 + type 4 + value >= 1
    limits: list[str] = []
    keys: set[str] = set()
    alignment = 32
    for i in range(n_kv):
        key = w.string(f"metadata key {i}")
        if key in keys:
            raise w.fail(f"metadata key {key!r} appears twice")
        keys.add(key)
        (vtype,) = w.unpack("<I", f"type of {key!r}")
        start = w.pos
        _value(w, vtype, f"metadata {key!r}", limits)
        if key == "general.alignment":
            if vtype != _UINT32:
                raise w.fail("general.alignment is not a uint32")
            (alignment,) = struct.unpack_from("<I", w.buf, start)
            if alignment == 0 or alignment & (alignment - 1):
                raise w.fail(f"general.alignment {alignment} is not a power of two")
    w.count(n_tensors, 24, "tensor table")  # name 8 + n_dims 4 + type 4 + offset 8
    tensors, names = [], set()
    for i in range(n_tensors):
        name = w.string(f"tensor {i} name")
        if name in names or not 0 < len(name.encode()) <= 64:
            why = "appears twice" if name in names else "is not 1 to 64 bytes long"
            raise w.fail(f"tensor {i} name {name[:80]!r} {why}")
        names.add(name)
        (n_dims,) = w.unpack("<I", f"tensor {name!r} n_dims")
        if n_dims > MAX_DIMS:
            raise w.fail(f"tensor {name!r} has {n_dims} dimensions (at most 4)")
        dims = w.unpack(f"<{n_dims}Q", f"tensor {name!r} dimensions")
        if any(d > _INT_MAX for d in dims):
            raise w.fail(f"tensor {name!r} has dimensions {list(dims)}")
        ttype, offset = w.unpack("<IQ", f"tensor {name!r} type and offset")
        tensors.append((name, dims, ttype, offset))
    data_offset = w.pos + (-w.pos) % alignment
    for name, dims, ttype, offset in tensors:
        _check_tensor(w, name, dims, ttype, offset, alignment, data_offset, limits)
    if limits:
        raise w.error(f"{w.path}: mlx cannot read this GGUF file: {limits[0]}")
    return GGUFInfo(version, n_tensors, n_kv, alignment, data_offset)


def _check_tensor(w, name, dims, ttype, offset, alignment, data_offset, limits):
    if ttype not in TENSOR_TYPES:
        readable = ", ".join(t[0] for t in TENSOR_TYPES.values())
        limits.append(f"tensor {name!r} has type {ttype} (mlx reads {readable})")
        return
    tname, block, block_bytes = TENSOR_TYPES[ttype]
    if block > 1 and (not dims or dims[0] % block):
        raise w.fail(
            f"tensor {name!r} ({tname}) has rows of {dims[0] if dims else 0} "
            f"values, not a multiple of its block of {block}"
        )
    if offset % alignment:
        raise w.fail(f"tensor {name!r} offset {offset} is not {alignment}-aligned")
    count = 1
    for d in dims:
        count *= d
    end = data_offset + offset + count // block * block_bytes
    if end > w.size:
        raise w.fail(
            f"tensor {name!r} ends at byte {end}, past the end of the file "
            f"({w.size} bytes; truncated?)"
        )


def mapped(path, error, kind):
    """(file object, read-only map or b"" for an empty file) of `path`."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise error(f"{kind} file not found: {path}") from None
    except OSError as e:
        raise error(f"cannot read {kind} file {path}: {e.strerror or e}") from None
    try:
        size = os.fstat(f.fileno()).st_size
        return f, (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b"")
    except (OSError, ValueError) as e:
        f.close()
        raise error(f"cannot read {kind} file {path}: {e}") from None


def check_gguf(path, error=FileFormatError) -> GGUFInfo:
    """Walk the header of the GGUF file `path`; raise `error` unless every
    count, length and offset fits the file and mlx can read what it describes."""
    f, buf = mapped(path, error, "GGUF")
    with f:
        try:
            return _walk_gguf(_Walker(buf, os.fspath(path), error))
        finally:
            if isinstance(buf, mmap.mmap):
                buf.close()
