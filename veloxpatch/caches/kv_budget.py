"""`max_kv_bytes`: a budget priced in bytes, for every algorithm with a budget.

The budget (rows per layer and KV head) is the largest one whose bound on the
bytes held once the prompt is read, over every layer veloxpatch caches and
every KV head, is at most `max_kv_bytes` (rounded down): the same meaning
whoever chose the algorithm. The bound counts what `nbytes` counts, per layer
and KV head, with r = budget + the rows held beyond it while decoding
(`Holds.decode_rows`: snapkv's window). While the prompt is read a cache holds
more: one chunk past its budget where it cuts as it reads (`compress="chunks"`,
kvzap: `Holds.reading_rows`, the bound with `decode=False`, which the server
reserves), else the whole prompt (the SnapKV family and expected_attention at
the prompt's end, kvzip, qfilters without a file) or the caller's prefill chunk.

- rows in the model's dtype: r x (2 D x dtype size + 4) (keys, values, position);
- with `kv_bits` (the spec `quant`): r rows, plus (once r passes the residual:
  before, nothing is quantized and eviction leaves no hole) up to max(group,
  r / 4) holes (evicted rows not yet compacted, `kv_bits.HOLE_SHARE`), of which
  up to residual + group - 1 slots are the full-precision residual and the
  spec's dense sinks (2 D x dtype size each) and the rest quantized (2 D bits /
  8 of codes, the keys' at `key_bits` when given, and a scale and a bias per
  `group` values in the model's dtype: 4 D x dtype size / group), plus 8
  bytes per row (its position and its slot); the "query" recipe's rounding
  factor, D (D - 1) / 2 + 4 bytes per KV head.

Plus what a layer holds besides its rows (`Holds.side`: the SnapKV family's,
kvzip's and kvzap's buffered queries, expected_attention's query mean and
covariance, qfilters' query moments; where the bound covers reading the prompt,
what only the prompt holds, `Holds.prompt_side`: kvzap's tail queries and
inputs) and per row (`Holds.row_bytes`: scores, accumulated attention, key
norms). Each algorithm declares its `Holds` beside its scores, in its cache
class (`VeloxCache.holds`).

Sliding-window layers keep mlx-lm's own caches and are not counted. Ada-KV
pads every head to the layer's largest head: that padding depends on the
scores and is not in the bound.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

from ..errors import OptionError
from .kv_bits import HOLE_SHARE

UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$")


def parse_size(value, name: str = "max_kv_bytes") -> int:
    """Bytes from an int or a string like "48MB", "1.5GiB", "4096" (KB, MB, GB
    are powers of 1000; KiB, MiB, GiB of 1024). At least one byte; errors name
    the option as `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise OptionError(
            f"{name} must be a size like 48MB, 512KiB or a number of "
            f"bytes, got {value!r}"
        )
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(value.lower())
        if m is None or m.group(2) not in UNITS:
            raise OptionError(
                f"{name} must be a size like 48MB, 512KiB or a number of "
                f"bytes (units B, KB, MB, GB, KiB, MiB, GiB), got {value!r}"
            )
        n = math.floor(float(m.group(1)) * UNITS[m.group(2)])
    if n < 1:
        raise OptionError(f"{name} must be at least 1 byte, got {value!r}")
    return n


def kv_dtype_size(model) -> int:
    """Bytes of one element of the keys the model's attention produces: the
    dtype of the first floating parameter of a patched attention (a quantized
    projection's scales)."""
    from mlx.utils import tree_flatten

    for layer in model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            continue
        for _, p in tree_flatten(attn.parameters()):
            if "float" in str(p.dtype):
                return p.dtype.size
    return 4


class Holds(NamedTuple):
    """What one layer's cache holds besides its budget's rows, per sequence:
    declared by each algorithm's cache class (`VeloxCache.holds`), priced here."""

    decode_rows: int = 0  # rows held past the budget while decoding (a window)
    # rows past the budget while the prompt is read, where the cache bounds them
    # (a chunk: it cuts as it reads); None: the whole prompt is held
    reading_rows: int | None = None
    row_bytes: int = 0  # per held row and KV head (a float32 score: 4)
    side: int = 0  # bytes besides the rows: buffered queries, statistics
    prompt_side: int = 0  # bytes held only while the prompt is read


def holds_of(options, heads: int = 1, head_dim: int = 1, dtype_size: int = 2):
    """`Holds` of a layer of `heads` query heads under `options`, as the cache
    class that declares the options says (the rows alone need no shape)."""
    return options.cache.holds(options, heads, head_dim, dtype_size)


def slot_bytes(quant, head_dim: int, dtype_size: int, quantized: bool) -> int:
    """Bytes of one slot of one KV head: a dense row, or one quantized as
    `quant` (a KVQuant) says: codes, a scale and a bias per group."""
    if not quantized:
        return 2 * head_dim * dtype_size
    codes = head_dim * (quant.bits + (quant.key_bits or quant.bits)) / 8
    return codes + 4 * head_dim * dtype_size / quant.group


def bound_bytes(
    options,
    dims,
    dtype_size: int,
    budget: int,
    tokens: int | None = None,
    decode: bool = False,
) -> float:
    """Upper bound on the bytes held at `budget` (module doc); `tokens`: the
    most a cache will ever see, whose rows and slots it cannot exceed;
    `decode`: once the prompt has ended (where the bound otherwise covers it)."""
    q = options.quant
    total = 0.0
    layers = zip(dims.heads, dims.kv_heads, dims.head_dims, dims.sliding)
    for heads, kv_heads, d, sliding in layers:
        if sliding:
            continue
        held = holds_of(options, heads, d, dtype_size)
        reading = not decode and held.reading_rows is not None
        extra = max(held.reading_rows, held.decode_rows) if reading else None
        r = budget + (held.decode_rows if extra is None else extra)
        r = r if tokens is None else min(r, tokens)
        total += held.side
        if reading:  # the bound covers the prompt: what it alone holds
            total += held.prompt_side
        dense = slot_bytes(q, d, dtype_size, False)
        side = held.row_bytes
        if q is None:
            per_head = r * (dense + 4 + side)
        else:
            g = q.group
            # rows that never pass the residual are never quantized: no holes
            slots = r if r <= q.residual else r + max(g, r // HOLE_SHARE)
            slots = slots if tokens is None else min(slots, tokens)
            full = min(slots, q.residual + g - 1 + q.sinks)  # sinks: dense too
            quant = slot_bytes(q, d, dtype_size, True)
            per_head = full * dense + (slots - full) * quant + (8 + side) * r
            if q.rounds:  # the rounding factor: an 8-bit triangle, a fp32 step
                per_head += d * (d - 1) // 2 + 4
        total += kv_heads * per_head
    return total


def budget_for_bytes(
    options, dims, dtype_size: int, limit: int, decode: bool = True
) -> int:
    """The largest budget whose bound (`decode`: once the prompt is read, as
    `max_kv_bytes` means; else while reading it too) is at most `limit` bytes
    (0: none)."""

    def fits(budget):
        return bound_bytes(options, dims, dtype_size, budget, decode=decode) <= limit

    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
