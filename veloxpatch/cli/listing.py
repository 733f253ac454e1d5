"""`veloxpatch list`: the algorithms and the architectures they patch."""

from __future__ import annotations

import textwrap

import click

from .. import blas
from .checks import UserError, user_errors


@click.command("list")
@click.option("--verbose", "-v", is_flag=True, help="also versions and BLAS")
@click.option(
    "--auto",
    "share",
    default=None,
    metavar="SHARE",
    help="instead: what algo=auto picks for a share of full KV, e.g. 20%, at "
    "each measured fraction and path (no model is loaded)",
)
@user_errors
def list_(verbose, share):
    """Algorithms and supported architectures."""
    if share is not None:
        return auto_choices(share)
    from model_adapters import ADAPTERS

    from ..caches import ALGORITHMS

    click.echo("algorithms:")
    for name, cls in ALGORITHMS.items():
        # a name wider than the column puts its summary on the next line
        gap = " " if len(name) <= 14 else f"\n  {'':<14} "
        click.echo(f"  {name:<14}{gap}{cls.summary}")
        if verbose:
            defaults = ", ".join(f"{k}={v}" for k, v in cls.Options().as_dict().items())
            for line in textwrap.wrap(f"options: {defaults or '(none)'}", 62):
                click.echo(f"  {'':<14} {line}")
        if cls.note and (verbose or "note" in vars(cls)):
            for line in textwrap.wrap(cls.note, 62):
                click.echo(f"  {'':<14} {line}")
    click.echo("architectures (mlx-lm model types):")
    for adapter in ADAPTERS:
        click.echo(f"  {adapter.name:<14} {', '.join(adapter.model_types)}")
    if verbose:
        import mlx.core as mx
        import mlx_lm

        click.echo(
            f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, "
            f"device {mx.default_device()}"
        )
        click.echo(f"BLAS: {blas.active()}")


def auto_choices(share) -> None:
    """The rule applied to the packaged table at each fraction and path, with
    a kvzap scorer for the model and without one."""
    from ..auto import (
        PATHS,
        load_table,
        read_ratio,
        rule,
        score,
        stored,
        table_fraction,
    )
    from ..pricing import parse_target

    target = parse_target(share, "--auto")
    if target.ratio is None:
        raise UserError(
            f"--auto takes a share of full KV like 20%, got {share!r} (what bytes "
            "buy depends on the model and the prompt)"
        )
    table = load_table()
    reads = table_fraction(table, target.ratio)
    click.echo(
        f"auto: table measured by `{table.get('command')}` at commit "
        f"{table.get('commit')} ({table.get('model')}, "
        f"{table['context_tokens']}-token prompts)"
    )
    under = " (under the smallest fraction measured)" if target.ratio < reads else ""
    click.echo(f"{target} of full KV reads the {reads:.0%} rows{under}, marked *")
    click.echo(
        "  answers of the path's protocols (worst case) / cases, read time over an "
        "unpatched prefill"
    )
    click.echo(f"  {'fraction':<9} {'path':<9} {'with a kvzap scorer':<34} without")

    def said(row, path):
        if row is None:
            return "(none measured)"
        ratio = read_ratio(row, table)
        reads = "?" if ratio is None else f"{ratio:.1f}x"
        return (
            f"{row['algo']} {stored(row, short=True)} {score(row, path)}/{row['n']} "
            f"{reads}"
        )

    for f in sorted(table["fractions"]):
        mark = "*" if abs(f - reads) < 1e-9 else " "
        for path in PATHS:
            with_scorer, _ = rule(table, f, path, kvzap=True)
            without, _ = rule(table, f, path, kvzap=False)
            click.echo(
                f"{mark} {f:<9.0%} {path:<9} {said(with_scorer, path):<34} "
                f"{said(without, path)}"
            )
