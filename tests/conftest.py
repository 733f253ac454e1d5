"""Load OpenBLAS before anything imports mlx (real-model tests are ~15x faster)."""

from veloxpatch import blas

blas.preload()
