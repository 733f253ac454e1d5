"""Arms: an algorithm with its options, ours or a peer's, written
`NAME[:key=value,...]`, e.g. `snapkv:budget=256,window=16`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..api import make_options
from ..auto import resolve
from ..caches import ALGORITHMS  # here: importing arms loads no mlx
from ..errors import OptionError
from ..option_text import parse_pairs
from ..pricing import is_share, share_in_bytes


@dataclass
class Arm:
    """An algorithm with its options, e.g. Arm("knorm", {"budget": 256})."""

    algo: str = "full"
    options: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.algo}:{opts}" if opts else self.algo

    @property
    def family(self) -> str:
        """The label without the budget: arms that differ only in budget (or in
        max_kv_bytes)."""
        drop = ("budget", "max_kv_bytes")
        rest = {k: v for k, v in self.options.items() if k not in drop}
        return Arm(self.algo, rest).label


PEER_PREFIXES = ("mlx.", "veloxquant.")
AUTO = "auto"  # resolved per prompt by veloxpatch.auto: `auto:max_kv_bytes=20%`


def is_peer(algo: str) -> bool:
    return algo == "unpatched" or algo.startswith(PEER_PREFIXES)


def takes_budget(algo: str) -> bool:
    """Whether `--budgets` expands this arm."""
    if is_peer(algo):
        return algo == "mlx.rotating" or algo.startswith("veloxquant.")

    cls = ALGORITHMS.get(algo)
    return cls is not None and "budget" in cls.Options.__dataclass_fields__


def bind_to(model, arms) -> None:
    """Bind every arm's options to the model before any arm runs: what only
    the model decides (a byte budget's rows, a calibration file's model, a
    group that must divide the head dimension) fails now, not after the arms
    before it have run."""
    for arm in arms:
        if arm.algo == AUTO:  # at the table's prompt length
            resolve(model, arm.options, "generate")
        elif not is_peer(arm.algo):
            make_options(arm.algo, arm.options, model)


def chosen(model, arm: Arm, n_tokens: int, path: str = "generate") -> Arm:
    """`arm` itself, or for an `auto` arm the configuration auto picks for a
    prompt of `n_tokens` on `path` (as `veloxpatch generate` would); a share
    given to one of ours is the bytes it is of this prompt's full KV."""
    if arm.algo != AUTO:
        if is_peer(arm.algo):
            return arm
        return Arm(arm.algo, share_in_bytes(model, arm.algo, arm.options, n_tokens))

    choice = resolve(model, arm.options, path, n_tokens)
    return Arm(choice.algo, choice.options)


def ran(rows) -> str | None:
    """What an auto arm ran over `rows` (those with a `chose`), without the
    rows that follow each prompt's length: "kvzip:kv_bits=4,kv_residual=32"."""
    picks = {parse_arm(r["chose"]).family for r in rows if r.get("chose")}
    return ", ".join(sorted(picks)) or None


def split_arms(text: str) -> list[str]:
    """`snapkv:budget=256,window=16,full` -> ["snapkv:budget=256,window=16", "full"]:
    a piece with `=` and no `:` is one more option of the arm before it."""
    arms: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if "=" in piece and ":" not in piece:
            if not arms:
                raise OptionError(f"option {piece!r} comes before any arm")
            sep = "," if ":" in arms[-1] else ":"
            arms[-1] += sep + piece
        else:
            arms.append(piece)
    return arms


def parse_arm(text: str) -> Arm:
    name, _, rest = text.strip().partition(":")
    pairs = [p for p in rest.split(",") if p.strip()] if rest else []
    return Arm(name.strip(), parse_pairs(pairs))


def expand(arm_texts, budgets=(), max_kv_bytes=()) -> list[Arm]:
    """Parse arms; arms that take a budget and name none get each of `budgets`,
    or each of the sizes in `max_kv_bytes` as theirs (ours and auto, which
    also take shares like "20%" of each prompt's full KV, and mlx.rotating;
    the others, mlx.quantized included, run once, at their own size)."""
    if budgets and max_kv_bytes:
        raise OptionError("give budgets or max_kv_bytes sizes, not both")
    shares = [m for m in max_kv_bytes if is_share(m)]  # rows follow the prompt
    arms = []
    for text in arm_texts:
        arm = parse_arm(text)
        priced = "budget" in arm.options or "max_kv_bytes" in arm.options
        if budgets and takes_budget(arm.algo) and not priced:
            arms += [Arm(arm.algo, {**arm.options, "budget": b}) for b in budgets]
        elif max_kv_bytes and takes_bytes(arm.algo) and not priced:
            if shares and is_peer(arm.algo):
                raise OptionError(
                    f"a share of the full KV ({shares[0]}) is ours and auto's; give "
                    f"{arm.algo} a size like 24MB ({arm.algo}:max_kv_bytes=24MB)"
                )
            arms += [
                Arm(arm.algo, {**arm.options, "max_kv_bytes": m}) for m in max_kv_bytes
            ]
        else:
            arms.append(arm)
    return arms


def takes_bytes(algo: str) -> bool:
    """Whether `--max-kv-bytes` expands this arm: ours with a budget, mlx.rotating,
    auto."""
    return algo in ("mlx.rotating", AUTO) or (not is_peer(algo) and takes_budget(algo))
