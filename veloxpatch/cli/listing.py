"""`veloxpatch list`: the algorithms and the architectures they patch."""

from __future__ import annotations

import textwrap

import click

from .. import blas


@click.command("list")
@click.option("--verbose", "-v", is_flag=True, help="also versions and BLAS")
def list_(verbose):
    """Algorithms and supported architectures."""
    from model_adapters import ADAPTERS

    from ..api import ALGORITHMS

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
