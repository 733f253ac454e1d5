"""Run a model and hand a function what every patched attention call sees.

Calibration (Q-Filters queries, the A2ATS codebook), eval replay and the
analysis scripts all watch the model through this one seam: the patch's caches
with a probe (`Patch.make_cache(probe=fn)`). Sliding-window layers keep
mlx-lm's own cache, so they are never seen.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

from . import api


def run_probe(model, ids, fn, *, chunk: int = 1024, tick=None) -> list:
    """Run token ids through `model` in calls of `chunk` tokens, calling
    `fn(seen)` (a `caches.base.Seen`) in every patched layer. A model that is
    not patched is patched with `full` for the run. Returns the prompt cache."""
    with contextlib.ExitStack() as stack:
        patch = api.patch_of(model)
        if patch is None:
            patch = stack.enter_context(api.patched(model, "full"))
        caches = patch.make_cache(probe=fn)
        for start in range(0, len(ids), chunk):
            piece = mx.array(ids[start : start + chunk])[None]
            mx.eval(model(piece, cache=caches))
            if tick is not None:
                tick(piece.shape[1])
    return caches


def sample_positions(n_tokens: int, max_vectors: int, seed: int):
    """Sorted positions of a seeded sample of up to `max_vectors` tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = min(max_vectors, n_tokens)
    return np.sort(rng.choice(n_tokens, size=n, replace=False))


def rows_at(wanted, seen) -> mx.array | None:
    """Indices into the call's rows of the wanted positions it holds (or None)."""
    import numpy as np

    L = seen.q.shape[2]
    lo, hi = np.searchsorted(wanted, [seen.offset, seen.offset + L])
    return mx.array(wanted[lo:hi] - seen.offset) if hi > lo else None
