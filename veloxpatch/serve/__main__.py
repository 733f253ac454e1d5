"""`python -m veloxpatch.serve ...`: the same as `veloxpatch serve ...`."""

import sys

from veloxpatch.cli import main

main(["serve", *sys.argv[1:]], prog_name="veloxpatch")
