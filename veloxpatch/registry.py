"""An algorithm's cache class from its name, and its options validated: the one
place options are checked (apply, `auto`, the CLI, eval and the benchmarks)."""

from __future__ import annotations

from model_adapters import adapter_for

from .caches import ALGORITHMS, VeloxCache
from .errors import OptionError


def algos() -> list[str]:
    """Names of all algorithms."""
    return list(ALGORITHMS)


def algorithm(name):
    """The cache class of an algorithm name (or a VeloxCache subclass, as is)."""
    if isinstance(name, type) and issubclass(name, VeloxCache):
        return name
    try:
        return ALGORITHMS[name]
    except (KeyError, TypeError):
        raise OptionError(
            f"unknown algorithm {name!r}; available: {', '.join(ALGORITHMS)}"
        ) from None


def make_options(algo, options: dict | None = None, model=None):
    """(cache class, validated options) for `algo`; with `model`, also bound to it
    (its dimensions checked, calibration files loaded). The one place options
    are validated: apply, the CLI, eval and the benchmarks all come here."""
    cls = algorithm(algo)
    opts = cls.Options.create(cls.name, dict(options or {}))
    if model is not None:
        opts = opts.bind(model, adapter_for(model).dims(model))
    return cls, opts
