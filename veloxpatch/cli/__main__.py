"""`python -m veloxpatch.cli ...`: the same as `veloxpatch ...`."""

from veloxpatch.cli import main

main(prog_name="veloxpatch")
