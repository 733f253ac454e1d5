"""`algo="auto"`: a memory target in, the best measured configuration out.

A target is bytes ("24MB") or a ratio of the full cache ("20%": of each
prompt's full KV, what mlx-lm's own cache holds for it in the model's dtype).
It bounds what is held once the prompt is read: a configuration's rows are the
most whose decode-time bytes (`kv_budget.bound_bytes`) fit it.

The choice (`rule`, docs/auto.md) reads the measured table `auto_table.json`
(package data, rebuilt by `python scripts/bench_auto.py`): at the largest
table fraction at or below the target's, of the candidates whose answers over
the path's protocols are not measurably worse than the best's, the fastest
read; kvzap only where a scorer for this model is found (the calibration
cache's, or the one the package ships for the embedded model).

When rows are fixed: where the prompt is known first (the CLI), auto chooses
for it. `apply` chooses before any prompt (the algorithm depends only on the
fraction; a size is read against the table's context length); a size then
fixes the rows, while a share sets each prompt's rows where its caches are made
(`Patch.options_for_tokens`: `patch.prefill`, `make_cache(n_tokens=)`, and
mlx-lm's generate_step, whose prompt is read from its frame). The server
chooses once at load, for a size per sequence.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from model_adapters import adapter_for

from .caches.calibration_files import find, load_scorer
from .errors import OptionError
from .pricing import Target, full_bytes, held_rows, parse_size, parse_target

# ---- the measured table -----------------------------------------------------------
TABLE = Path(__file__).with_name("auto_table.json")
# the table is package data: an install has it; a clone rebuilds it
BUILD = "reinstall veloxpatch, or in its repository run `python scripts/bench_auto.py`"
CANDIDATES = ("kvzap", "kvzip", "snapkv", "expected_attention", "streaming_llm")
# the protocols whose worst case counts on each path (docs/auto.md)
PATHS = {
    "generate": ("prompt",),
    "compress": ("after",),
    "prefill": ("after",),
    "serve": ("prompt", "chat"),
    "apply": ("prompt", "after", "chat"),
}
PROTOCOL_WORDS = {
    "prompt": "question in the prompt",
    "after": "question after compression",
    "chat": "chat second turn",
}
_ROW_KEYS = ("algo", "kv_bits", "fraction", "anchor", "n", "correct", "error")


def load_table(path=None) -> dict:
    """The measured table (`auto_table.json`, package data), checked; one
    OptionError line naming the command that builds it when it is missing."""
    path = Path(path) if path is not None else TABLE
    if not path.is_file():
        raise OptionError(
            f"algo='auto' has no measured table yet ({path.name} is missing); {BUILD}"
        )
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
        fractions = [float(f) for f in table["fractions"]]
        rows = table["rows"]
        ok = fractions and all(0 < f <= 1 for f in fractions)
        ok = ok and int(table["context_tokens"]) > 0 and isinstance(rows, list)
        for r in rows:
            ok = ok and all(k in r for k in _ROW_KEYS)
            if ok and not r["anchor"] and r["error"] is None:
                ok = all(isinstance(r["correct"].get(p), int) for p in PROTOCOL_WORDS)
                ok = ok and isinstance(r["prefill_s_median"], (int, float))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise OptionError(f"{path} is damaged ({e}); {BUILD}") from None
    if not ok:
        raise OptionError(f"{path} is damaged; {BUILD}")
    return table


def table_fraction(table: dict, fraction: float) -> float:
    """The largest measured fraction at or below `fraction` (else the smallest)."""
    below = [f for f in table["fractions"] if f <= fraction + 1e-9]
    return max(below) if below else min(table["fractions"])


def score(row: dict, path: str) -> int:
    return min(row["correct"][p] for p in PATHS[path])


def total(row: dict, path: str) -> int:
    return sum(row["correct"][p] for p in PATHS[path])


def read_ratio(row: dict, table: dict) -> float | None:
    """A row's read time (its prompts read and compressed) over the unpatched
    model's prefill of the same prompts (the table's `full` anchor)."""
    full = next((r for r in table["rows"] if r["anchor"] and r["algo"] == "full"), {})
    base, seconds = full.get("prefill_s_median"), row.get("prefill_s_median")
    return seconds / base if base and seconds else None


def spread(row: dict, path: str) -> float:
    """One standard deviation of the count of right answers over the path's
    protocols at the row's rate p: sqrt(N p (1 - p)), N = cases x protocols.
    A row whose count is within it of the best's is not measurably worse."""
    n = row["n"] * len(PATHS[path])
    p = total(row, path) / n
    return math.sqrt(n * p * (1 - p))


def candidates(table: dict, fraction: float, kvzap: bool, fits=None):
    """(the candidate rows at the table's fraction for `fraction`, kvzap only
    with a scorer, those whose peak `fits` (row -> bool, None: all); the table
    fraction)."""
    at = table_fraction(table, fraction)
    rows = [
        r
        for r in table["rows"]
        if not r["anchor"]
        and r["error"] is None
        and r["algo"] in CANDIDATES
        and abs(r["fraction"] - at) < 1e-9
        and (kvzap or r["algo"] != "kvzap")
        and (fits is None or fits(r))
    ]
    return rows, at


def best_answering(rows: list, path: str):
    """The row answering best on `path`: the best worst case over its
    protocols, ties to the most answers over them, then the faster read."""
    return max(
        rows,
        key=lambda r: (score(r, path), total(r, path), -r["prefill_s_median"]),
        default=None,
    )


def rule(table: dict, fraction: float, path: str, kvzap: bool, fits=None):
    """The contract's rule (docs/auto.md): among the candidates, those whose
    answers over the path's protocols are within one `spread` of the best's,
    and of them the fastest read, to a tenth of an unpatched prefill (ties to
    more answers). Returns (row or None, the table fraction)."""
    rows, at = candidates(table, fraction, kvzap, fits)
    best = best_answering(rows, path)
    return (None if best is None else fastest_close(rows, best, path, table)), at


def fastest_close(rows: list, best: dict, path: str, table: dict) -> dict:
    """Of `rows`, those within one `spread` of `best`'s answers, the fastest
    read to a tenth of an unpatched prefill (ties to more answers)."""
    close = [
        r for r in rows if total(best, path) - total(r, path) <= spread(best, path)
    ]

    def speed(r):  # read times the line shows alike are alike
        ratio = read_ratio(r, table)
        return r["prefill_s_median"] if ratio is None else round(ratio, 1)

    pick = min(
        close,
        key=lambda r: (
            speed(r),
            -score(r, path),
            -total(r, path),
            r["prefill_s_median"],
        ),
    )
    return pick


# ---- the choice -------------------------------------------------------------------
@dataclasses.dataclass
class Choice:
    """What auto chose for one target, path and prompt length."""

    algo: str
    kv_bits: int
    options: dict  # the algorithm's options: kv_bits, budget, scorer
    target: Target
    path: str
    n_tokens: int  # the prompt's tokens (or the table's, where none is known)
    measured_length: bool  # n_tokens is the table's context, not a prompt's
    fraction: float  # the target as a share of the prompt's full KV
    table_fraction: float  # the fraction whose rows the rule read
    row: dict  # the table row picked
    held_bytes: int  # what the target allows once the prompt is read
    peak_bytes: int  # about what reading the prompt reaches (the table's, scaled)
    missing_scorer: bool  # kvzap was left out: no scorer for this model
    read: float | None = None  # the row's read time / an unpatched prefill's
    best: dict | None = None  # the row answering best, where not the one picked
    best_read: float | None = None
    last_prompt: int | None = None  # a share's rows follow each prompt: the last's
    fewest: bool = False  # a share too small for the prompt: the fewest rows

    @property
    def budget(self) -> int:
        return self.options["budget"]

    def for_prompt(self, n_tokens: int, options: dict, fewest: bool) -> Choice:
        """This choice having read a prompt of `n_tokens` with the rows its
        share bought for it (`options`, the fewest that work where `fewest`):
        its line then says that prompt's rows. Made before any prompt, its
        n_tokens are the table's context."""
        peak = peak_of(self.row, self.n_tokens, n_tokens)
        return dataclasses.replace(
            self, options=options, last_prompt=n_tokens, peak_bytes=peak, fewest=fewest
        )

    def answers(self, row: dict) -> str:
        return "/".join(str(row["correct"][p]) for p in PATHS[self.path])

    def line(self) -> str:
        n = self.row["n"]
        said = ", ".join(PROTOCOL_WORDS[p] for p in PATHS[self.path])
        under = " (the target is under the smallest fraction measured)"
        under = under if self.fraction < self.table_fraction - 1e-9 else ""
        if self.last_prompt is not None:
            length = (
                f"the last prompt read, {self.last_prompt} tokens (rows set per prompt)"
            )
        elif self.measured_length:
            length = f"a {self.n_tokens}-token prompt (the table's; no prompt given)"
        else:
            length = f"this {self.n_tokens}-token prompt"
        text = (
            f"auto: {self.algo}, {self.budget} rows, {stored(self.row)} — "
            f"{self.answers(self.row)} of {n} ({said}) at {self.table_fraction:.0%} "
            f"of full KV for {self.path}{_reads(self.read)}"
        )
        if self.best is not None:
            text += (
                f"; the most answers, {self.best['algo']} "
                f"{stored(self.best, short=True)} {self.answers(self.best)} of "
                f"{self.best['n']}{_reads(self.best_read)}, are not measurably more "
                "(within the table's spread)"
            )
        held = f"= {self.fraction:.1%} of the full KV of {length}"
        if self.fewest:  # what the share bought was fewer rows than it works with
            held = (
                f"buys fewer rows than {self.algo} works with on {length}, so it "
                "keeps its fewest"
            )
        text += (
            f"{under}; target {self.target} {held}, peak while reading it about "
            f"{self.peak_bytes / 1e6:,.1f} MB"
        )
        if self.missing_scorer:
            text += (
                "; no kvzap scorer for this model: `veloxpatch calibrate --algo "
                "kvzap` makes the faster kvzap a candidate"
            )
        return text

    def __str__(self) -> str:
        return self.line()

    def record(self) -> dict:
        """What a patch or a saved cache records of the choice."""
        return {
            "algo": "auto",
            "max_kv_bytes": self.target.text,
            "path": self.path,
            "chose": self.algo,
            "kv_bits": self.kv_bits,
            "kv_residual": self.row.get("kv_residual"),
            "table_fraction": self.table_fraction,
            "fraction": round(self.fraction, 6),
            "n_tokens": self.n_tokens,
        }


def _reads(ratio: float | None) -> str:
    return "" if ratio is None else f", reads at {ratio:.1f}x an unpatched prefill"


def scorer_for(model) -> str | None:
    """kvzap's scorer for this model in the calibration cache, or None (one
    made for another model lives under another fingerprint and is not seen)."""
    dims = adapter_for(model).dims(model)
    found = find("kvzap", dims, lambda p: load_scorer(p, dims))
    return found[0] if found is not None else None


def _options_of(row: dict, scorer: str | None) -> dict:
    opts = {} if row["kv_bits"] == 16 else {"kv_bits": int(row["kv_bits"])}
    if row.get("kv_residual") is not None:  # else the spec's default
        opts["kv_residual"] = int(row["kv_residual"])
    return opts | ({"scorer": scorer} if row["algo"] == "kvzap" else {})


def stored(row: dict, short: bool = False) -> str:
    """How a row stores keys and values: "4-bit keys and values (the newest 32
    rows unquantized)" where its residual is not the spec's default; `short`:
    "4-bit r32"."""
    bits, residual = row["kv_bits"], row.get("kv_residual")
    if short:
        return f"{bits}-bit" + ("" if residual is None else f" r{residual}")
    more = "" if residual is None else f" (the newest {residual} rows unquantized)"
    if residual == 0:  # a group still filling stays dense
        more = " (each group of rows quantized once it fills)"
    return f"{bits}-bit keys and values{more}"


PREFILL_STEP = 2048  # mlx-lm's prefill_step_size: tokens a forward reads at once


def peak_of(row: dict, context_tokens: int, n_tokens: int) -> int:
    """A table row's median peak while reading its `context_tokens`, scaled
    to `n_tokens`: half of it as activations, which grow with the tokens one
    forward reads (up to PREFILL_STEP), half as rows held, which grow with the
    prompt (measured within 3% at 2,000 tokens and 8% at 8,000 for kvzap,
    docs/results.md)."""
    peak = row.get("prefill_peak_bytes_median") or 0

    def size(n):
        return min(n, PREFILL_STEP) + n

    return math.ceil(peak * size(n_tokens) / size(context_tokens))


def check_options(options: dict) -> None:
    """The options `algo="auto"` takes, checked without a model: `max_kv_bytes`
    (the target) and `max_peak_bytes`, nothing else."""
    other = sorted(set(options) - {"max_kv_bytes", "max_peak_bytes"})
    if other:
        raise OptionError(
            "algo='auto' chooses the algorithm and its options; give only "
            f"max_kv_bytes (and max_peak_bytes), or name an algorithm (got "
            f"{', '.join(other)})"
        )
    if options.get("max_kv_bytes") is None:
        raise OptionError(
            "algo='auto' needs max_kv_bytes: a share of the full KV like '20%' or "
            "a size like '24MB'"
        )
    parse_target(options["max_kv_bytes"])
    if options.get("max_peak_bytes") is not None:
        parse_size(options["max_peak_bytes"], "max_peak_bytes")


def resolve(model, options: dict, path: str, n_tokens=None) -> Choice:
    """Auto's choice from the options `apply(algo="auto", ...)` was given
    (`check_options`)."""
    check_options(options)
    return choose(
        model, options["max_kv_bytes"], path, n_tokens, options.get("max_peak_bytes")
    )


def choose(
    model, target, path: str = "apply", n_tokens=None, max_peak_bytes=None, table=None
) -> Choice:
    """Auto's choice for `target` on `path` for a prompt of `n_tokens` (None:
    the table's context length): the rule's row, its rows at the real target."""
    target = parse_target(target)
    peak_limit = None
    if max_peak_bytes is not None:
        peak_limit = parse_size(max_peak_bytes, "max_peak_bytes")
    if path not in PATHS:
        raise OptionError(f"unknown path {path!r}; one of {', '.join(PATHS)}")
    table = load_table() if table is None else table
    measured = n_tokens is None
    context = int(table["context_tokens"])
    n = context if measured else int(n_tokens)
    full = full_bytes(model, n)
    size = target.bytes_for(model, n)
    fraction = size / full
    scorer = scorer_for(model)
    fits = None
    if peak_limit is not None:

        def fits(r):
            return peak_of(r, context, n) <= peak_limit

    rows, at = candidates(table, fraction, scorer is not None, fits)
    best = best_answering(rows, path)
    row = None if best is None else fastest_close(rows, best, path, table)
    if row is None and fits is not None:
        # every candidate's peak at that fraction: the least of them would fit
        every, _ = candidates(table, fraction, scorer is not None)
        least = min((peak_of(r, context, n) for r in every), default=0)
        raise OptionError(
            f"no configuration measured at {at:.0%} of full KV reads a {n}-token "
            f"prompt under max_peak_bytes={peak_limit:,}; the smallest that would "
            f"is max_peak_bytes={least:,}"
        )
    if row is None:
        raise OptionError(
            f"{TABLE.name} has no usable configuration at {at:.0%}; {BUILD}"
        )
    opts, fewest = held_rows(model, row["algo"], target, n, _options_of(row, scorer))
    kvzap_rows = any(
        r["algo"] == "kvzap" and r["fraction"] == at and not r["anchor"]
        for r in table["rows"]
    )
    return Choice(
        algo=row["algo"],
        kv_bits=int(row["kv_bits"]),
        options=opts,
        target=target,
        path=path,
        n_tokens=n,
        measured_length=measured,
        fraction=fraction,
        table_fraction=at,
        row=row,
        held_bytes=size,
        peak_bytes=peak_of(row, context, n),
        missing_scorer=scorer is None and kvzap_rows,
        read=read_ratio(row, table),
        best=None if best is row else best,
        best_read=None if best is row else read_ratio(best, table),
        fewest=fewest,
    )
