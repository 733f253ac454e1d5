"""Caches for any arm, ours or a peer's, holding a prompt's head.

Our arms run on the patched model (replayed from a captured prefill when one is
given); peer arms (`unpatched`, mlx-lm's `mlx.rotating` and `mlx.quantized`,
`veloxquant.ALGO`) run on the unpatched model with their own caches and always
prefill directly, since their prefill attention is not ours to replay.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

from .. import api
from .metrics import Arm

PEER_PREFIXES = ("mlx.", "veloxquant.")


def is_peer(algo: str) -> bool:
    return algo == "unpatched" or algo.startswith(PEER_PREFIXES)


def takes_budget(algo: str) -> bool:
    """Whether `--budgets` expands this arm."""
    if is_peer(algo):
        return algo == "mlx.rotating" or algo.startswith("veloxquant.")
    return algo != "full"


def peer_caches(model, arm: Arm) -> list:
    from . import peers  # optional peers are imported only when asked for

    if arm.algo == "unpatched":
        return peers.mlx_caches(model, "unpatched", arm.options)
    if arm.algo.startswith("mlx."):
        return peers.mlx_caches(model, arm.algo[4:], arm.options)
    return peers.veloxquant_caches(model, arm.algo[len("veloxquant.") :], arm.options)


def prefill_head(model, caches, head, prefill_step_size: int = 2048) -> None:
    """Feed `head` in chunks, reading the caches' state after each, as mlx-lm's
    generate_step does with every prompt token but the last."""
    for start in range(0, len(head), prefill_step_size):
        model(mx.array(head[start : start + prefill_step_size])[None], cache=caches)
        mx.eval([c.state for c in caches])


@contextlib.contextmanager
def arm_caches(model, arm: Arm, head, captured=None, prefill_step_size=2048):
    """Yield (caches, replayed): `arm`'s caches after `head`, with the model
    patched for `arm` while inside when the arm is ours. `captured` is a
    replay of exactly `head` (see replay.py), used for our arms."""
    if is_peer(arm.algo):
        caches = peer_caches(model, arm)
        prefill_head(model, caches, head, prefill_step_size)
        yield caches, False
        return
    with api.patched(model, algo=arm.algo, **arm.options) as patch:
        if captured is not None:
            yield captured.caches(arm.algo, arm.options), True
        else:
            caches = patch.make_cache()
            prefill_head(model, caches, head, prefill_step_size)
            yield caches, False
