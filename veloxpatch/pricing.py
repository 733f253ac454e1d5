"""`max_kv_bytes`, priced on a model: what a memory target buys.

The one place everything above the caches asks (apply, auto, the CLI, the
server and eval):

- `full_bytes(model, n)`: what mlx-lm's own cache holds for `n` tokens (keys
  and values in the model's dtype, every layer veloxpatch patches);
- `parse_target`: a target, "20%" of each prompt's full KV or bytes ("24MB");
- `held_options(model, algo, size)`: the rows `size` bytes buy, held once the
  prompt is read; `target_bytes(model, algo, target, n)`: the bytes a target
  gives an `n`-token prompt (a share too small for it: the fewest that work),
  and `held_rows` the rows they buy.

What a configuration holds at a budget, per layer and KV head, is
`caches/kv_budget.py`: the caches bind `max_kv_bytes` with it, below this layer.
"""

from __future__ import annotations

import dataclasses
import math
import re

from model_adapters import adapter_for

from .caches.kv_budget import bound_bytes, holds_of, kv_dtype_size, parse_size
from .errors import OptionError
from .registry import algorithm, make_options

__all__ = [
    "Target",
    "bound_bytes",
    "full_bytes",
    "held_options",
    "held_rows",
    "holds_of",
    "is_share",
    "kv_dtype_size",
    "parse_size",
    "parse_target",
    "smallest_target",
    "split_share",
    "share_in_bytes",
    "target_bytes",
]


def full_bytes(model, n_tokens: int) -> int:
    """Bytes mlx-lm's own cache holds for `n_tokens` tokens on `model` (keys
    and values in the model's dtype, every layer veloxpatch would patch,
    without the allocation step's padding)."""
    dims = adapter_for(model).dims(model)
    size = kv_dtype_size(model)
    layers = zip(dims.kv_heads, dims.head_dims, dims.sliding)
    return sum(h * n_tokens * 2 * d * size for h, d, s in layers if not s)


@dataclasses.dataclass(frozen=True)
class Target:
    """A memory target: `ratio` of each prompt's full KV, or `size` bytes."""

    text: str
    ratio: float | None = None
    size: int | None = None

    def bytes_for(self, model, n_tokens: int) -> int:
        if self.size is not None:
            return self.size
        return math.floor(self.ratio * full_bytes(model, n_tokens))

    def __str__(self) -> str:
        return self.text


def is_share(value) -> bool:
    """Whether a `max_kv_bytes` value is a share of the full KV ("20%")."""
    return isinstance(value, str) and "%" in value


_PERCENT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*$")


def parse_target(value, name: str = "max_kv_bytes") -> Target:
    """A target from "20%" (of each prompt's full KV), "24MB" or an int of
    bytes; anything else is one OptionError line."""
    if isinstance(value, Target):
        return value
    if is_share(value):
        m = _PERCENT.match(value)
        share = float(m.group(1)) if m else None
        if share is None or not 0 < share <= 100:
            raise OptionError(
                f"{name} as a share of the full KV cache must be above 0% and at "
                f"most 100%, got {value!r}"
            )
        return Target(f"{share:g}%", ratio=share / 100)
    if isinstance(value, str) and value.strip().startswith("-"):
        raise OptionError(f"{name} must be positive, got {value!r}")
    if type(value) is int:  # a number of bytes: its own message
        return Target(f"{parse_size(value, name):,} bytes", size=value)
    try:
        size = parse_size(value, name)
    except OptionError:
        raise OptionError(
            f"{name} must be a share of the full KV cache like 20% or a size like "
            f"24MB or a number of bytes, got {value!r}"
        ) from None
    return Target(f"{size:,} bytes", size=size)


def held_options(model, algo: str, target_bytes: int, options: dict | None = None):
    """`options` (kv_bits...) with the budget `target_bytes` buy on `model`, as
    `max_kv_bytes` prices it for any algorithm (what is held once the prompt is
    read). Raises OptionError where the target buys too few rows."""
    drop = ("budget", "max_kv_bytes")
    given = {k: v for k, v in (options or {}).items() if k not in drop}
    if "budget" not in algorithm(algo).Options.option_names():
        raise OptionError(f"{algo!r} keeps every token: it has no budget")
    bound = make_options(algo, {**given, "max_kv_bytes": int(target_bytes)}, model)[1]
    return {**given, "budget": bound.budget}


def smallest_target(model, algo: str, options: dict, start: int) -> int | None:
    """The fewest bytes (above `start`) that buy more rows than `algo`
    protects with `options`; None where no size does (another fault)."""
    lo, hi = start, max(2 * start, 1024)
    while not _buys(model, algo, options, hi):
        if hi > 2**50:
            return None
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _buys(model, algo, options, mid) else (mid, hi)
    return hi


def _buys(model, algo, options, size) -> bool:
    try:
        held_options(model, algo, size, options)
    except OptionError:
        return False
    return True


def target_bytes(model, algo: str, target: Target, n_tokens: int, options: dict):
    """(bytes, fewest) that `target` gives an `n_tokens`-token prompt with
    `options`. A share that buys fewer rows than the algorithm always keeps (a
    short prompt: a chat's first line at 20%) gives the fewest bytes that buy
    them, fewest True, as a server gives every prompt; a size that does is one
    OptionError line naming the smallest that works."""
    size = target.bytes_for(model, n_tokens)
    if _buys(model, algo, options, size):
        return size, False
    need = smallest_target(model, algo, options, size)
    if need is None:  # another fault: its own error
        held_options(model, algo, size, options)
    if target.ratio is not None:
        return need, True
    raise OptionError(
        f"max_kv_bytes={target} buys too few rows for {algo} on this model (fewer "
        f"than it always keeps); the smallest target that works is {need:,} bytes"
    )


def held_rows(model, algo: str, target: Target, n_tokens: int, options: dict):
    """(`options` with the rows `target` buys for an `n_tokens`-token prompt,
    whether they are the fewest the algorithm works with: `target_bytes`)."""
    size, fewest = target_bytes(model, algo, target, n_tokens, options)
    return held_options(model, algo, size, options), fewest


def split_share(algo: str, options: dict) -> tuple[dict, Target | None]:
    """A named algorithm's options without a `max_kv_bytes` share ("20%"), and
    the share: its rows are set where each prompt's length is known (bytes
    stay in the options). OptionError where the algorithm has no budget."""
    value = options.get("max_kv_bytes")
    if not is_share(value):
        return options, None
    target = parse_target(value)
    if "max_kv_bytes" not in algorithm(algo).Options.option_names():
        raise OptionError(f"{algo!r} keeps every token: it takes no max_kv_bytes")
    return {k: v for k, v in options.items() if k != "max_kv_bytes"}, target


def share_in_bytes(model, algo: str, options: dict, n_tokens: int) -> dict:
    """`options` with a `max_kv_bytes` share as the bytes it gives a prompt of
    `n_tokens` (`target_bytes`; where the prompt is known first: the CLI's
    generate, compress)."""
    rest, share = split_share(algo, options)
    if share is None:
        return options
    size, _ = target_bytes(model, algo, share, n_tokens, rest)
    return rest | {"max_kv_bytes": size}
