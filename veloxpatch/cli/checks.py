"""The command line's one validation layer: every option of every subcommand is
checked here, before a model loads or any work starts, and every user error is
one line on stderr (`veloxpatch: error: ...`) and exit status 2.

- `Group` turns click's own usage errors (a missing option, an int that is not
  one) and any `VeloxpatchError` a command raises into that one line.
- Parameter types check values as click parses them: counts, finite numbers,
  integer lists, text sources (a built-in prose half or a UTF-8 file), output
  files (not a directory, in an existing writable folder, with the suffix the
  writer needs).
- Helpers check what spans several options: an output that exists needs
  `--force`; an option typed on the command line that nothing reads (a task or
  algorithm not asked for) is refused rather than silently ignored.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import tempfile
from pathlib import Path

import click
from click.core import ParameterSource
from click.exceptions import NoArgsIsHelpError


class UserError(click.UsageError):
    """A user error: one line on stderr, exit status 2."""

    def show(self, file=None) -> None:
        click.echo(f"veloxpatch: error: {one_line(self.format_message())}", err=True)


def one_line(text) -> str:
    return " ".join(str(text).split())


@contextlib.contextmanager
def one_line_errors():
    """Re-raise click's usage errors and veloxpatch's user errors as UserError."""
    from ..errors import VeloxpatchError

    try:
        yield
    except (UserError, NoArgsIsHelpError):  # the latter prints the help, as asked
        raise
    except click.UsageError as e:
        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx else ""
        raise UserError(e.format_message() + hint, e.ctx) from None
    except (VeloxpatchError, FileNotFoundError) as e:
        raise UserError(str(e)) from None


def user_errors(fn):
    """A command whose user errors are one line (also when run outside `Group`)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with one_line_errors():
            return fn(*args, **kwargs)

    return run


class Group(click.Group):
    """The `veloxpatch` group: parse errors of the group and of every subcommand,
    and user errors inside commands, come out as one line."""

    def make_context(self, info_name, args, parent=None, **extra):
        with one_line_errors():
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx):
        with one_line_errors():
            return super().invoke(ctx)


def flag(param) -> str:
    """How the user wrote the option: its longest name (`--max-tokens`)."""
    if param is None:
        return "value"
    return max(param.opts, key=len) if param.opts else param.human_readable_name


# ---- parameter types ----------------------------------------------------------------
class _Type(click.ParamType):
    def fail_line(self, message: str, param, ctx):
        raise UserError(f"{flag(param)} {message}", ctx)


class Count(_Type):
    """An integer of at least `minimum` (a count, a length, a size)."""

    name = "integer"

    def __init__(self, minimum: int = 1):
        self.minimum = minimum

    def convert(self, value, param, ctx):
        try:
            n = int(value)
        except (TypeError, ValueError):
            self.fail_line(f"must be an integer, got {value!r}", param, ctx)
        if n < self.minimum:
            self.fail_line(f"must be at least {self.minimum}, got {n}", param, ctx)
        return n


class Finite(_Type):
    """A finite real number of at least `minimum` (NaN and infinities refused)."""

    name = "number"

    def __init__(self, minimum: float = -math.inf):
        self.minimum = minimum

    def convert(self, value, param, ctx):
        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail_line(f"must be a number, got {value!r}", param, ctx)
        if not math.isfinite(x) or x < self.minimum:
            low = "" if self.minimum == -math.inf else f" >= {self.minimum:g}"
            self.fail_line(f"must be a finite number{low}, got {value}", param, ctx)
        return x


class Counts(_Type):
    """Comma-separated distinct integers, each at least `minimum`; `empty_ok`
    allows none at all."""

    name = "integers"

    def __init__(self, minimum: int = 1, empty_ok: bool = False):
        self.minimum, self.empty_ok = minimum, empty_ok

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        what = f"comma-separated integers, each at least {self.minimum}"
        pieces = [p for p in str(value).split(",") if p.strip()]
        try:
            numbers = [int(p) for p in pieces]
        except ValueError:
            numbers = None
        if (
            numbers is None
            or not (numbers or self.empty_ok)
            or min(numbers, default=self.minimum) < self.minimum
        ):
            self.fail_line(f"must be {what}; got {value!r}", param, ctx)
        twice = sorted({n for n in numbers if numbers.count(n) > 1})
        if twice:
            self.fail_line(f"lists {', '.join(map(str, twice))} twice", param, ctx)
        return numbers


class NonEmpty(_Type):
    """A string that is not empty or blank."""

    name = "text"

    def convert(self, value, param, ctx):
        if not str(value).strip():
            self.fail_line("must not be empty", param, ctx)
        return value


class TextSource(_Type):
    """A built-in prose (`calibration`, `evaluation`, `licenses-*`) or a UTF-8
    text file (prose.check_source, which every reader of prose uses)."""

    name = "text"

    def convert(self, value, param, ctx):
        from ..errors import OptionError
        from ..prose import check_source

        try:
            check_source(value)
        except OptionError as e:  # its message names --text
            raise UserError(str(e), ctx) from None
        return value


class OutputFile(_Type):
    """A file to write: not a directory, in an existing folder we can write in,
    ending in `suffix` when the writer appends one otherwise. Whether it may be
    overwritten is `refuse_existing`'s (it needs --force)."""

    name = "file"

    def __init__(self, suffix: str | None = None):
        self.suffix = suffix

    def convert(self, value, param, ctx):
        text = str(value)
        path = Path(os.path.expanduser(text))
        if not text.strip():
            self.fail_line("must name a file, got ''", param, ctx)
        if path.is_dir() or text.endswith(("/", os.sep)):
            self.fail_line(f"names a directory: {text}", param, ctx)
        if self.suffix and not path.name.endswith(self.suffix):
            self.fail_line(
                f"must end in {self.suffix} (the file written has that name), "
                f"got {text!r}",
                param,
                ctx,
            )
        folder = path.parent
        if not folder.is_dir():
            self.fail_line(f"is in a folder that does not exist: {folder}", param, ctx)
        why = _unwritable(path)
        if why:
            self.fail_line(f"cannot be written ({why}): {text}", param, ctx)
        return text


def _unwritable(path: Path) -> str | None:
    """Why `path` cannot be written, or None. Tried for real (a root user passes
    every permission check): an existing file is opened for writing without
    truncating it; otherwise a temporary file is made, and removed, beside it."""
    try:
        if path.exists():
            if path.is_file():
                with open(path, "r+b"):
                    pass
            elif not os.access(path, os.W_OK):
                return "permission denied"
            return None
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".veloxpatch-"):
            pass
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


# ---- checks over several options ----------------------------------------------------
def refuse_existing(force: bool, **paths) -> None:
    """Each output that already is a file needs --force; two outputs naming the
    same file are refused. `paths`: option name (out, plot) -> path or None."""
    given = {k: v for k, v in paths.items() if v}
    seen: dict[str, str] = {}
    for name, value in given.items():
        key = os.path.realpath(os.path.expanduser(value))
        if key in seen:
            raise UserError(f"--{seen[key]} and --{name} name the same file: {value}")
        seen[key] = name
        if not force and Path(key).is_file():
            raise UserError(f"{value} exists (--{name}); pass --force to overwrite it")


def typed(ctx: click.Context, name: str) -> bool:
    """Whether option `name` was given on the command line (not a default)."""
    return ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE


def refuse_unread(ctx: click.Context, names, why: str) -> None:
    """Options typed on the command line that nothing will read are errors
    (a value that does nothing is a mistake), named with `why`."""
    unread = [n for n in names if typed(ctx, n)]
    if unread:
        flags = ", ".join("--" + n.replace("_", "-") for n in unread)
        raise UserError(f"{flags} {'is' if len(unread) == 1 else 'are'} {why}")


def algo_options(budget, algo_args, max_kv_bytes=None) -> dict:
    """`--algo-arg k=v` pairs with `--budget` and `--max-kv-bytes` (the
    per-sequence budget in bytes) merged in, each given once only."""
    from ..option_text import parse_pairs

    options = parse_pairs(algo_args)
    for key, value in (("budget", budget), ("max_kv_bytes", max_kv_bytes)):
        if value is not None:
            if key in options:
                flag = "--" + key.replace("_", "-")
                raise UserError(f"{key} given twice: {flag} and --algo-arg {key}=")
            options[key] = value
    return options


# the algorithms that cannot run without a calibration file, and its option
NEEDS_FILE = {"kvzap": "scorer"}


def refuse_missing_calibration(algo: str, options: dict) -> None:
    """Before the model loads: an algorithm that needs a calibration file and
    names none, when the calibration cache holds none for any model (one for
    this model is looked up once it loads)."""
    option = NEEDS_FILE.get(algo)
    if option is None or options.get(option) is not None:
        return
    from ..caches.calibration_files import home, missing, none_for_any_model

    if none_for_any_model(algo):
        raise UserError(missing(algo, option, home()))


def check_auto(options: dict, max_peak_bytes) -> None:
    """Before the model loads: auto's options (a target, nothing the choice
    sets) and a measured table to choose from."""
    from ..auto import load_table
    from ..pricing import parse_size, parse_target

    if options.get("max_kv_bytes") is None:
        raise UserError("--algo auto needs --max-kv-bytes, e.g. 20% or 24MB")
    other = sorted(set(options) - {"max_kv_bytes"})
    if other:
        raise UserError(
            f"auto chooses the algorithm's options; drop {', '.join(other)} "
            "(--budget, --algo-arg) or name an --algo"
        )
    parse_target(options["max_kv_bytes"], "--max-kv-bytes")
    if max_peak_bytes is not None:
        parse_size(max_peak_bytes, "--max-peak-bytes")
    load_table()


def check_before_load(algo: str, options: dict, max_peak_bytes) -> None:
    """`generate`'s and `compress`'s options, checked before the slow load:
    auto's, or the named algorithm's (its calibration files found)."""
    from ..api import make_options

    if algo == "auto":
        check_auto(options, max_peak_bytes)
    elif max_peak_bytes is not None:
        raise UserError("--max-peak-bytes is auto's (no --algo, or --algo auto)")
    else:
        from ..pricing import split_share

        make_options(algo, split_share(algo, options)[0])  # a share: per prompt
        refuse_missing_calibration(algo, options)


def choose_auto(model, options: dict, max_peak_bytes, path: str, n_tokens: int):
    """Auto's choice for this prompt, said in one line on stderr."""
    from ..auto import resolve

    given = options | ({"max_peak_bytes": max_peak_bytes} if max_peak_bytes else {})
    choice = resolve(model, given, path, n_tokens)
    click.echo(choice.line(), err=True)
    return choice
