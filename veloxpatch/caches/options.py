"""Options of an algorithm: a dataclass validated in `__post_init__`, and the
public validators every algorithm (and the CLI) uses.

`bind(model, dims)` runs in `veloxpatch.apply` before anything is patched: it
checks what depends on the model and loads calibration files. `dims` is what an
adapter reports (`model_adapters.base.ModelDims`), so an algorithm never needs
to know an architecture.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, ClassVar

from ..errors import OptionError

INT_LIMIT = 2**62  # within int64, with room for sums of two
FLOAT_INT_LIMIT = 2**53  # integers a float64 (and mlx's arithmetic) holds exactly


def check_int(name: str, value, minimum: int, maximum: int | None = None) -> None:
    """An integer (not a bool) in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionError(f"{name} must be an integer, got {value!r}")
    if maximum is None:
        maximum = INT_LIMIT  # mlx computes in int64: larger ones crash it
    if value < minimum or value > maximum:
        hi = f" and <= {maximum}" if maximum != INT_LIMIT or value > maximum else ""
        raise OptionError(f"{name} must be >= {minimum}{hi}, got {value}")


def check_number(
    name: str, value, lo: float, hi: float = math.inf, lo_open: bool = False
) -> None:
    """A finite real number (not a bool) in [lo, hi], or (lo, hi] with lo_open.
    NaN fails every comparison, so it is refused explicitly."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionError(f"{name} must be a number, got {value!r}")
    if (
        (isinstance(value, int) and abs(value) > FLOAT_INT_LIMIT)  # not a float
        or not math.isfinite(value)
        or value < lo
        or value > hi
        or (lo_open and value == lo)
    ):
        bracket = "(" if lo_open else "["
        raise OptionError(
            f"{name} must be a finite number in {bracket}{lo}, {hi}], got {value}"
        )


def check_choice(name: str, value, choices) -> None:
    if isinstance(value, bool) or value not in choices:
        raise OptionError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise OptionError(f"{name} must be true or false, got {value!r}")


def option(default, check, *args, **kwargs):
    """A dataclass field declared with its check, `check(name, value, *args,
    **kwargs)`, which `CacheOptions.__post_init__` runs for every field (a
    field whose default is None also takes None). A shared option (`window`,
    `chunk`, `floor`...) is checked where it is declared, once."""
    return dataclasses.field(default=default, metadata={"check": (check, args, kwargs)})


PATH_OPTIONS = ("codebook", "filters", "scorer")  # the options that name a file


def absolute_paths(options: dict) -> dict:
    """`options` with the files they name made absolute (options saved in a file
    and applied again from another directory)."""
    return {
        k: os.path.abspath(v) if k in PATH_OPTIONS and isinstance(v, str) else v
        for k, v in options.items()
    }


def files_of(options) -> dict:
    """The files bound options read ({option: path}), those found in the
    calibration cache included."""
    return {
        k: getattr(options, k)
        for k in PATH_OPTIONS
        if isinstance(getattr(options, k, None), str)
    }


def check_path(name: str, value) -> None:
    """A file path option (None is allowed by the caller before this)."""
    assert name in PATH_OPTIONS, name  # absolute_paths must know it
    # control characters would break the one-line errors that name the file
    if not isinstance(value, str) or not value or not value.isprintable():
        raise OptionError(f"{name} must be a file path, got {value!r}")


@dataclasses.dataclass
class CacheOptions:
    """Options shared by every algorithm. Subclasses add fields, declared with
    their checks (`option`); checks that relate several fields go in
    `__post_init__`, after calling super (which runs the declared ones)."""

    # the cache class that declares these options (`VeloxCache.Options`): what
    # it holds at a budget is declared there (`VeloxCache.holds`)
    cache: ClassVar[type]

    def __post_init__(self):
        self.dims = None  # the model's ModelDims, once bound
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if "check" not in f.metadata or (value is None and f.default is None):
                continue
            check, args, kwargs = f.metadata["check"]
            check(f.name, value, *args, **kwargs)

    @classmethod
    def option_names(cls) -> list[str]:
        """The keywords `create` takes."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def fold(cls, options: dict[str, Any]) -> dict[str, Any]:
        """`options` with shorthand keywords built into fields (kv_bits=4 into
        `quant`); called on a copy before the fields are filled."""
        return options

    @classmethod
    def from_saved(cls, algo: str, options: dict[str, Any]) -> CacheOptions:
        """Options as a cache file's meta holds them (`as_dict`)."""
        return cls.create(algo, options)

    @classmethod
    def create(cls, algo: str, options: dict[str, Any]) -> CacheOptions:
        names = cls.option_names()
        unknown = sorted(set(options) - set(names))
        if unknown:
            valid = ", ".join(names) if names else "(none)"
            raise OptionError(
                f"unknown option(s) {', '.join(unknown)} for {algo!r}; valid: {valid}"
            )
        try:
            return cls(**cls.fold(dict(options)))
        except (TypeError, ValueError) as e:
            if isinstance(e, OptionError):
                raise
            raise OptionError(f"{algo}: {e}") from None

    def bind(self, model, dims) -> CacheOptions:
        """Checks and loads what depends on the model (dimensions, calibration
        files), before anything is patched. Subclasses call super."""
        self.dims = dims
        return self

    def holds_prompt(self) -> bool:
        """Whether the whole prompt is held as read until it ends (then
        compressed): nothing in it is quantized before (`kv_bits`)."""
        return False

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
