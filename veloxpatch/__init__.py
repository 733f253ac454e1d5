"""veloxpatch: query-aware KV-cache compression for mlx-lm models.

Importing this package patches nothing and does not import mlx; the names below
load on first use, so entry points can set up BLAS before mlx is imported.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "apply": "api",
    "patched": "api",
    "unpatch": "api",
    "algos": "api",
    "Patch": "api",
    "KVQuant": "caches.kv_quant",
    "load": "loading.models",
    "save_cache": "caches.io",
    "load_cache": "caches.io",
    "copy_cache": "context",
    "calibrate": "calibration.run",
    "VeloxpatchError": "errors",
}


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'veloxpatch' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"veloxpatch.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = list(_EXPORTS)
