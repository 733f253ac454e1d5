"""Use the system OpenBLAS on Linux.

The mlx CPU wheel links the reference BLAS (a 1024x1024 fp32 matmul takes ~0.4 s);
loading Debian's OpenBLAS globally *before* mlx is first imported makes mlx's
BLAS calls resolve to it (~50x faster). Entry points (CLI, tests) call
`preload()`; importing veloxpatch does not. `VELOXPATCH_BLAS=off` disables it.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)

_loaded: str | None = None
_note = "not attempted"


def find_openblas() -> str | None:
    for path in CANDIDATES:
        if os.path.exists(path):
            return path
    found = sorted(glob.glob("/usr/lib/*/openblas*/libopenblas.so.0"))
    return found[0] if found else None


def preload() -> str | None:
    """Load OpenBLAS with RTLD_GLOBAL if possible; returns its path or None."""
    global _loaded, _note
    if _loaded is not None:
        return _loaded
    if not sys.platform.startswith("linux"):
        _note = "not Linux (mlx uses the platform BLAS)"
        return None
    if os.environ.get("VELOXPATCH_BLAS", "").lower() in ("off", "0", "false", "no"):
        _note = "disabled by VELOXPATCH_BLAS=off"
        return None
    if "mlx.core" in sys.modules:
        _note = "mlx was imported before veloxpatch could load OpenBLAS"
        return None
    path = find_openblas()
    if path is None:
        _note = "OpenBLAS not found (apt-get install libopenblas0-pthread)"
        return None
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        _note = f"could not load {path}: {e}"
        return None
    _loaded, _note = path, "preloaded"
    return path


def active() -> str:
    """Which BLAS mlx's CPU backend is using, in words."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    maps = ""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        pass
    if "libopenblas" in maps:
        lib = next(
            (ln.split()[-1] for ln in maps.splitlines() if "libopenblas" in ln), "?"
        )
        return f"OpenBLAS ({lib})"
    return f"reference BLAS bundled with the mlx wheel (slow; {_note})"
