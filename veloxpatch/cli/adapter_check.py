"""`veloxpatch adapter-check`: what an adapter pins of an attention class."""

from __future__ import annotations

import sys

import click

from .checks import UserError, user_errors


@click.command("adapter-check")
@click.argument("cls", metavar="MODULE.CLASS")
@user_errors
def adapter_check(cls):
    """Signature and source hash of an attention class's __call__, as an
    adapter pins them (same as `python -m model_adapters.check`)."""
    from model_adapters import check

    try:
        check.resolve(cls)  # bad input: the one-line error every command gives
    except LookupError as e:
        raise UserError(str(e)) from None
    sys.exit(check.main([cls]))
