"""The safetensors header, checked in Python before ``mx.load`` sees a file:
the 8-byte header length, the JSON header and every tensor's offsets, reading
only the header (see ``fileformat`` for GGUF)."""

from __future__ import annotations

import json
import mmap
import os
import struct

from ..errors import FileFormatError
from .fileformat import mapped

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}  # fmt: skip


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_safetensors(path, error=FileFormatError) -> dict:
    """The JSON header of the safetensors file `path` (tensors and
    ``__metadata__``), after checking that it fits the file and that every
    tensor's data lie inside the data section with the size dtype x shape
    gives. Reads only the header."""
    path = os.fspath(path)

    def fail(why):
        return error(f"{path}: damaged or unreadable safetensors file: {why}")

    f, buf = mapped(path, error, "safetensors")
    with f:
        try:
            size = len(buf)
            if size < 8:
                raise fail(f"{size} bytes, too short for a header")
            (n,) = struct.unpack_from("<Q", buf, 0)
            if n < 2 or n > size - 8:
                raise fail(f"header length {n} does not fit the {size}-byte file")
            raw = bytes(buf[8 : 8 + n])
        finally:
            if isinstance(buf, mmap.mmap):
                buf.close()
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise fail("the header is not valid JSON") from None
    if not isinstance(header, dict):
        raise fail("the header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise fail("__metadata__ is not a map of strings")
    data_size = size - 8 - n
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(t, dict) or t.get("dtype") not in DTYPE_SIZES:
            dtype = t.get("dtype") if isinstance(t, dict) else None
            raise fail(f"tensor {name!r} has no known dtype ({dtype!r})")
        shape, offsets = t.get("shape"), t.get("data_offsets")
        if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
            raise fail(f"tensor {name!r} has shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)
            or not offsets[0] <= offsets[1] <= data_size
        ):
            raise fail(
                f"tensor {name!r} has data_offsets {offsets!r}, not within the "
                f"{data_size}-byte data section (truncated?)"
            )
        count = 1
        for d in shape:
            count *= d
        if offsets[1] - offsets[0] != count * DTYPE_SIZES[t["dtype"]]:
            raise fail(
                f"tensor {name!r} spans {offsets[1] - offsets[0]} bytes, not the "
                f"{count * DTYPE_SIZES[t['dtype']]} its {t['dtype']} shape "
                f"{shape} needs"
            )
    return header
