"""Options of quantized storage (`kivi`, `kv_bits=`), and head-adaptive widths:
`kv_bits="adaptive"` gives each KV head 2, 3 or 4 bits around a mean target,
from the entropy of its real attention over the last prompt window."""

from __future__ import annotations

import math

from ..errors import OptionError
from .options import check_choice, check_int

BITS = (2, 3, 4, 8)
# "query": keys scaled, then hadamard; "query_basis": keys mapped, then hadamard
ROTATIONS = (None, "hadamard", "query", "query_basis")
KEY_GROUPS = ("channel", "token")  # keys quantized per channel (KIVI) or per token
GRIDS = ("minmax", "mlx", "gaussian", "mxfp4")  # quantized.py's grids
ROUNDINGS = ("nearest", "query")  # "query": error fed forward (quantized.py)
SCALES = ("model", "float16")  # the dtype of scales and biases, or of dense rows
GROUPS = (32, 64, 128)  # the group sizes mx.quantize takes
ADAPTIVE_WIDTHS = (2, 3, 4)
ENTROPY_WINDOW = 32  # last prompt queries whose attention sets adaptive widths


def check_quant(bits, group, residual, target_bits, prefix: str = "") -> None:
    """Validate quantization options (`prefix`: "kv_" on eviction algorithms,
    where bits may be None: no quantization)."""
    if bits is None and prefix:
        pass
    elif bits != "adaptive" and (isinstance(bits, bool) or bits not in BITS):
        raise OptionError(
            f"{prefix}bits must be one of {BITS} or 'adaptive', got {bits!r}"
        )
    check_choice(f"{prefix}group", group, GROUPS)
    check_int(f"{prefix}residual", residual, 0)
    if bits == "adaptive":
        lo, hi = ADAPTIVE_WIDTHS[0], ADAPTIVE_WIDTHS[-1]
        ok = isinstance(target_bits, (int, float)) and not isinstance(target_bits, bool)
        if not ok or not lo <= target_bits <= hi:
            raise OptionError(
                f"target_bits must be a number in [{lo}, {hi}] with "
                f"{prefix}bits='adaptive', got {target_bits!r}"
            )
    elif target_bits is not None:
        raise OptionError(f"target_bits needs {prefix}bits='adaptive'")


def dense_sinks(sinks, rotate, bits) -> int:
    """`kv_sinks`: the first rows held dense ahead of the quantized groups,
    resolved; by default 1 with a rotation (where the attention sink's error
    costs most: docs/results.md), else 0."""
    if sinks is None:
        return 1 if rotate and bits is not None else 0
    check_int("kv_sinks", sinks, 0)
    if sinks and bits is None:
        raise OptionError("kv_sinks needs kv_bits: it holds quantized rows dense")
    return sinks


def logit_debias(debias, bits, grid, qjl, prefix: str = "") -> bool:
    """`kv_debias`: attention subtracts each quantized key's expected rounding
    variance from its logit, halved (`quantized.py`); off unless asked. It
    reads the affine grid's steps, so it needs quantized rows on one, without
    kv_qjl (whose sketch has a variance of its own)."""
    if debias is None:
        return False
    if not isinstance(debias, bool):
        raise OptionError(f"kv_debias must be true or false, got {debias!r}")
    if debias and (bits is None or grid == "mxfp4" or qjl):
        raise OptionError(
            f"kv_debias needs {prefix}bits on an affine kv_grid (not mxfp4) and "
            "no kv_qjl: it reads the grid's steps"
        )
    return debias


def check_rotate(rotate, keys, bits, prefix: str = "") -> None:
    """`kv_rotate`: None, "hadamard", "query" (the Hadamard rotation after
    scaling key channels by the prompt's queries, `quantized.py`) or
    "query_basis" (after mapping keys by the queries' and keys' joint basis,
    `quantized.py`), which need
    quantized rows; `kv_keys`: "channel" or "token"."""
    check_choice("kv_rotate", rotate, ROTATIONS)
    check_choice("kv_keys", keys, KEY_GROUPS)
    if rotate is not None and bits is None:
        raise OptionError(
            f"kv_rotate={rotate!r} needs {prefix}bits: it rotates quantized rows"
        )
    if keys != "channel" and bits is None:
        raise OptionError(
            f"kv_keys={keys!r} needs {prefix}bits: it groups quantized keys"
        )


def check_grid(
    grid, bits, group, prefix: str = "", scales="model", dense="model"
) -> None:
    """`kv_grid`: one of GRIDS; "mxfp4" is mlx's 4-bit microscaling format, in
    groups of 32; `kv_scales` and `kv_dense`: one of SCALES. Any but the
    defaults need quantized rows."""
    check_choice("kv_grid", grid, GRIDS)
    for name, dtype in (("kv_scales", scales), ("kv_dense", dense)):
        check_choice(name, dtype, SCALES)
        if dtype != "model" and bits is None:
            raise OptionError(f"{name}={dtype!r} needs {prefix}bits")
    if grid == "minmax":
        return
    if bits is None:
        raise OptionError(f"kv_grid={grid!r} needs {prefix}bits: it grids their rows")
    if grid == "mxfp4" and (bits != 4 or group != 32):
        raise OptionError(
            f"kv_grid='mxfp4' is 4 bits in groups of 32: set {prefix}bits=4 and "
            f"{prefix}group=32 (got {bits!r} and {group!r})"
        )
    if grid == "mxfp4" and scales != "model":
        raise OptionError(
            "kv_grid='mxfp4' keeps its own 8-bit scales: kv_scales is for the "
            "affine grids"
        )


def check_round(rounding, bits, keys, grid, debias, prefix: str = "") -> None:
    """`kv_round`: "nearest" or "query" (keys rounded with error feedback
    weighed by the queries to come, `quantized.py`): on keys per channel, on
    a grid set before rounding (minmax or gaussian), without kv_debias (whose
    correction is nearest rounding's error)."""
    check_choice("kv_round", rounding, ROUNDINGS)
    if rounding == "nearest":
        return
    if bits is None or keys != "channel" or grid not in ("minmax", "gaussian"):
        raise OptionError(
            f"kv_round={rounding!r} needs {prefix}bits with kv_keys='channel' and "
            f"kv_grid 'minmax' or 'gaussian' (got {bits!r}, {keys!r}, {grid!r})"
        )
    if debias:
        raise OptionError(
            f"kv_round={rounding!r} and kv_debias: the debiasing subtracts nearest "
            "rounding's error variance, which the feedback reshapes"
        )


def check_qjl(qjl, bits, keys, grid, prefix: str = "") -> None:
    """`kv_qjl`: TurboQuant's 1-bit residual on keys quantized per token, on
    an affine grid, at 2 to 4 bits (the keys' MSE part takes one bit less)."""
    if not isinstance(qjl, bool):
        raise OptionError(f"kv_qjl must be true or false, got {qjl!r}")
    if not qjl:
        return
    if bits not in (2, 3, 4):
        raise OptionError(f"kv_qjl needs {prefix}bits 2, 3 or 4, got {bits!r}")
    if keys != "token" or grid == "mxfp4":
        raise OptionError(
            "kv_qjl sketches each key's residual: it needs kv_keys='token' and an "
            "affine kv_grid (not mxfp4)"
        )


def check_key_bits(key_bits, bits, qjl, grid, prefix: str = "") -> None:
    """`key_bits`: None (keys at `bits`) or one of BITS, with a fixed integer
    `bits` on an affine grid; kv_qjl sets the keys' width itself."""
    name = f"{prefix}key_bits" if prefix else "key_bits"
    if key_bits is None:
        return
    if isinstance(key_bits, bool) or key_bits not in BITS:
        raise OptionError(f"{name} must be one of {BITS}, got {key_bits!r}")
    if bits is None or bits == "adaptive":
        raise OptionError(
            f"{name} needs {prefix}bits set to one of {BITS} (the values' width), "
            f"got {bits!r}"
        )
    if qjl:
        raise OptionError(f"{name} and kv_qjl: kv_qjl sets the keys' width (bits - 1)")
    if grid == "mxfp4" and key_bits != 4:
        raise OptionError(
            f"kv_grid='mxfp4' is 4 bits: {name} must be 4, got {key_bits}"
        )


def check_rotatable(dims, rotate) -> None:
    """mx.hadamard_transform takes widths m x 2^k, m in 1, 12, 20, 28."""
    if rotate is None:
        return
    for d in sorted(set(dims.head_dims)):
        m = d
        while m % 2 == 0:
            m //= 2
        if m not in (1, 3, 5, 7) or (m > 1 and d % (4 * m)):
            raise OptionError(
                f"kv_rotate={rotate!r}: a Hadamard transform of head dim {d} is not "
                "available (widths 2^k, or 12, 20 or 28 times 2^k)"
            )


def check_group_divides(dims, group: int, prefix: str = "") -> None:
    widths = set(dims.head_dims)
    if any(d % group for d in widths):
        raise OptionError(
            f"{prefix}group ({group}) must divide the head dim {sorted(widths)}: "
            "values are quantized per token in groups of channels"
        )


def layer_total(target: float, heads: int, layer: int) -> int:
    """Bits of a layer's heads together: running rounding of target x heads over
    the layers, so the model-wide mean is on target even when a layer's is not."""

    def upto(n):
        return math.floor(target * heads * n + 0.5)

    return upto(layer + 1) - upto(layer)


def allocate_bits(entropy: list[float], total: int) -> tuple[int, ...]:
    """Widths from {2, 3, 4} summing to `total` (at most): each head weighs
    exp(entropy) (how many rows its attention spreads over) and each extra bit
    goes where it removes the most weighted error, w x 4^-bits. Heads with equal
    weight and width are served together or not at all, so the result follows
    the heads when they are permuted; bits such a tie cannot share are left out."""
    lo, hi = ADAPTIVE_WIDTHS[0], ADAPTIVE_WIDTHS[-1]
    weights = [float(f"{math.exp(e):.6g}") for e in entropy]
    bits = [lo] * len(weights)
    left = total - lo * len(weights)
    frozen = set()
    while left > 0:
        gains = {
            h: w * 4.0 ** -bits[h]
            for h, w in enumerate(weights)
            if bits[h] < hi and h not in frozen
        }
        if not gains:
            break
        best = max(gains.values())
        tied = [h for h, g in gains.items() if g == best]
        if len(tied) > left:
            frozen.update(tied)
            continue
        for h in tied:
            bits[h] += 1
        left -= len(tied)
    return tuple(bits)
