"""What scripts/quality_*.py share: `veloxpatch eval` run with a script's own
defaults, so there is one harness (sampling, tables, results schema)."""

from __future__ import annotations

import sys


def run_eval(doc: str, defaults: dict, argv=None, standalone_mode=True):
    """`veloxpatch eval ARGV` with `defaults` as the option defaults: a default
    map, not typed options, so `eval` still refuses only what the user typed
    and `--help` shows the script's defaults."""
    from veloxpatch.cli import main

    argv = sys.argv[1:] if argv is None else list(argv)
    if {"-h", "--help"} & set(argv):
        print(doc)  # what the script is for, before eval's options
    # usage and error hints name `veloxpatch eval`, which this is
    return main(
        ["eval", *argv],
        prog_name="veloxpatch",
        standalone_mode=standalone_mode,
        default_map={"eval": defaults},
        show_default=True,
    )
