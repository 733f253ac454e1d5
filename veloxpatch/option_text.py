"""Algorithm options written as text, `KEY=VALUE`: the CLI's `--algo-arg` and
the options of an eval arm (`snapkv:budget=256`) are read the same way.
Importing this loads no mlx."""

from __future__ import annotations

from .errors import OptionError


def parse_value(text: str):
    """Option values from text: int, float, bool, none or string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_pairs(pairs) -> dict:
    """`["budget=256", "window=16"]` -> {"budget": 256, "window": 16}; a pair
    without `=` or a key given twice is an OptionError."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise OptionError(f"expected KEY=VALUE, got {pair!r}")
        if key.strip() in out:
            raise OptionError(f"option {key.strip()!r} given twice")
        out[key.strip()] = parse_value(value.strip())
    return out
