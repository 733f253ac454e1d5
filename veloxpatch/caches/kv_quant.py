"""`KVQuant`: the one spec of stored-row quantization, shared by `kivi` and
every evicting algorithm (`kv_bits=` on them builds it).

Rows are KIVI-quantized (Liu et al., 2024): keys per channel over `group`
tokens, values per token over `group` channels, min/max grid, the newest
`residual` tokens in full precision (`kv_bits.py`, `quantized.py`). `recipe`
(research; None: the measured best for `bits`) chooses how keys are rounded:
- "kivi": the paper's, nearest rounding on the plain rows;
- "query": key channels scaled by the prompt's queries, every row rotated by a
  random Hadamard transform per head, keys rounded with error feedback weighed
  by the queries to come, the first row held dense (`quantized.py`).
The defaults per width are what the committed KL runs measured best
(docs/algorithms.md): "query" at 2 and 3 bits, "kivi" at 4 and 8.
"""

from __future__ import annotations

import dataclasses

from ..errors import OptionError
from .options import check_choice, check_int

BITS = (2, 3, 4, 8)
GROUPS = (32, 64, 128)  # the group sizes mlx's quantized kernels take
RECIPES = ("kivi", "query")
# 2, 3 bits: KL 0.0105/0.0164 and 0.0014/0.0021 (two texts) against Hadamard
# alone 0.035/0.066 and 0.0105/0.0135; 4 bits: only plain rows measured
DEFAULT_RECIPE = {2: "query", 3: "query", 4: "kivi", 8: "kivi"}
FIELDS = ("bits", "key_bits", "group", "residual", "recipe")
# the options of quantized rows before KVQuant, as saved cache files hold them
RETIRED = {
    "target_bits": None,
    "kv_rotate": None,
    "kv_keys": "channel",
    "kv_grid": "minmax",
    "kv_scales": "model",
    "kv_dense": "model",
    "kv_qjl": False,
    "kv_sinks": 0,
    "kv_debias": False,
    "kv_round": "nearest",
}


@dataclasses.dataclass
class KVQuant:
    """Stored-row quantization. `bits`: the code width (2, 3, 4, 8);
    `key_bits`: the keys' width when not `bits`; `group`: tokens per key group
    and channels per value group (32, 64, 128); `residual`: newest tokens kept
    in full precision; `recipe`: "kivi" or "query" (module doc), None for the
    measured default of `bits`, resolved here."""

    bits: int = 2
    key_bits: int | None = None
    group: int = 32
    residual: int = 128
    recipe: str | None = None

    def __post_init__(self):
        for name in ("bits", "key_bits"):
            value = getattr(self, name)
            if name == "key_bits" and value is None:
                continue
            if isinstance(value, bool) or value not in BITS:
                raise OptionError(f"{name} must be one of {BITS}, got {value!r}")
        check_choice("group", self.group, GROUPS)
        check_int("residual", self.residual, 0)
        if self.recipe is None:
            self.recipe = DEFAULT_RECIPE[self.bits]
        check_choice("recipe", self.recipe, RECIPES)

    @property
    def rotated(self) -> bool:
        """Rows stored rotated (and key channels scaled by the queries)."""
        return self.recipe == "query"

    @property
    def rounds(self) -> bool:
        """Keys rounded with error feedback weighed by the queries to come."""
        return self.recipe == "query"

    @property
    def sinks(self) -> int:
        """The first rows held dense ahead of the quantized ones."""
        return 1 if self.recipe == "query" else 0

    def flat(self, prefix: str) -> dict:
        """The keywords that build this spec again (`prefix`: "kv_" or "")."""
        return {prefix + k: getattr(self, k) for k in FIELDS}


def take_quant(options: dict, prefix: str, required: bool) -> KVQuant | None:
    """Pop the flat keywords (`prefix` + a KVQuant field: kv_bits=4, or kivi's
    bits=2) or `quant` (a KVQuant) from `options` and build the spec. Without
    any: KVQuant() if `required` (kivi), else None (no quantization)."""
    flat = {k: options.pop(prefix + k) for k in FIELDS if prefix + k in options}
    spec = options.pop("quant", None)
    if spec is not None:
        if not isinstance(spec, KVQuant):
            raise OptionError(f"quant must be a veloxpatch.KVQuant, got {spec!r}")
        if flat:
            raise OptionError(
                f"give quant= or {', '.join(prefix + k for k in flat)}, not both"
            )
        return spec
    if not required and flat.get("bits") is None:
        given = [prefix + k for k, v in flat.items() if v is not None]
        if given:
            raise OptionError(
                f"{given[0]} needs {prefix}bits: it shapes quantized rows"
            )
        return None
    try:
        return KVQuant(**flat)
    except OptionError as e:
        raise OptionError(f"{prefix}{e}") from None


def upgrade_saved(options: dict, prefix: str) -> dict:
    """Options saved before KVQuant (a cache file's meta) with the retired
    names folded into `recipe` where they are one of today's recipes; any
    other retired setting is refused, never read as something else."""
    old = {k: options.pop(k) for k in list(options) if k in RETIRED}
    if not old:
        return options
    changed = {k: v for k, v in old.items() if v != RETIRED[k]}
    if options.get(prefix + "bits") is None:
        if changed:
            raise OptionError(f"saved options {changed} without {prefix}bits")
        return options
    query = {"kv_rotate": "query", "kv_round": "query", "kv_sinks": 1}
    if changed and changed != query:
        raise OptionError(
            f"saved with quantization options this version no longer has: {changed}"
        )
    return {**options, prefix + "recipe": "query" if changed else "kivi"}


def check_group_divides(dims, group: int, prefix: str = "") -> None:
    widths = set(dims.head_dims)
    if any(d % group for d in widths):
        raise OptionError(
            f"{prefix}group ({group}) must divide the head dim {sorted(widths)}: "
            "values are quantized per token in groups of channels"
        )


def check_rotatable(dims, quant: KVQuant, prefix: str = "") -> None:
    """mx.hadamard_transform takes widths m x 2^k, m in 1, 12, 20, 28."""
    if not quant.rotated:
        return
    for d in sorted(set(dims.head_dims)):
        m = d
        while m % 2 == 0:
            m //= 2
        if m not in (1, 3, 5, 7) or (m > 1 and d % (4 * m)):
            raise OptionError(
                f"{prefix}recipe={quant.recipe!r} rotates rows: a Hadamard transform "
                f"of head dim {d} is not available (widths 2^k, or 12, 20 or 28 "
                f"times 2^k); {prefix}recipe='kivi' quantizes without"
            )


def check_bindable(dims, quant: KVQuant, prefix: str = "") -> None:
    """What the spec needs of the model, checked in `bind`."""
    check_group_divides(dims, quant.group, prefix)
    check_rotatable(dims, quant, prefix)
