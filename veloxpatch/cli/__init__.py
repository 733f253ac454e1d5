"""`veloxpatch` command line: the click group, one module a command. User errors
print one line and exit 2; every option is checked (`checks`) before a model
loads or any work starts."""

from __future__ import annotations

import click

from .. import blas
from .adapter_check import adapter_check
from .calibrate import calibrate
from .checks import Group
from .compress import compress
from .eval import bench, eval_
from .generate import generate
from .listing import list_
from .serve import serve


@click.group(cls=Group)
@click.version_option(package_name="veloxpatch")
def main():
    """Query-aware KV-cache compression for mlx-lm models."""
    blas.preload()  # before anything below imports mlx


# each command's module defines it; the group only gathers them
for command in (
    generate,
    calibrate,
    compress,
    eval_,
    bench,
    serve,
    list_,
    adapter_check,
):
    main.add_command(command)
