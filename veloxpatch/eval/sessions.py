"""Caches for any arm, ours or a peer's, holding a prompt's head.

Our arms run on the patched model, replayed from one captured prefill when the
head fits in one prefill chunk. Peer arms (`unpatched`, mlx-lm's `mlx.rotating`
and `mlx.quantized`, `veloxquant.ALGO`) run on the unpatched model with their
own caches; their prefill attention is not ours to replay, but within one chunk
some of them attend identically and share one forward pass (see `Prefills`).
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

from .. import api
from . import peers  # optional peers are imported only when asked for
from .arms import AUTO, Arm, is_peer
from .replay import capture_prefill


def mlx_kind(arm: Arm) -> str | None:
    if arm.algo == "unpatched":
        return "unpatched"
    return arm.algo[4:] if arm.algo.startswith("mlx.") else None


def peer_caches(model, arm: Arm) -> list:

    if (kind := mlx_kind(arm)) is not None:
        return peers.mlx_caches(model, kind, arm.options)
    return peers.veloxquant_caches(model, arm.algo[len("veloxquant.") :], arm.options)


def peer_quantizer(arm: Arm):

    kind = mlx_kind(arm)
    return peers.quantizer(kind, arm.options) if kind else None


def prefill_head(model, caches, head, prefill_step_size=2048, after_chunk=None):
    """Feed `head` in chunks, reading the caches' state after each, as mlx-lm's
    generate_step does with every prompt token but the last (`after_chunk` is
    its kv_bits conversion, for mlx.quantized)."""
    for start in range(0, len(head), prefill_step_size):
        model(mx.array(head[start : start + prefill_step_size])[None], cache=caches)
        if after_chunk is not None:
            after_chunk(caches)
        mx.eval([c.state for c in caches])


class FanOut:
    """One layer's caches of several arms fed by a single forward pass: each
    gets the same update, the model attends with what the first returns, and
    `same` records whether every other returned exactly that."""

    def __init__(self, caches):
        self.caches, self.same = caches, [[] for _ in caches]

    def __getattr__(self, name):  # offset, make_mask, ... are the leader's
        return getattr(self.__dict__["caches"][0], name)

    def update_and_fetch(self, keys, values):
        outs = [c.update_and_fetch(keys, values) for c in self.caches]
        k0, v0 = outs[0]
        for same, (k, v) in zip(self.same, outs):
            alike = k.shape == k0.shape and v.shape == v0.shape
            alike = alike and k.dtype == k0.dtype and v.dtype == v0.dtype
            equal = mx.array_equal(k, k0) & mx.array_equal(v, v0) if alike else False
            same.append(equal)
        return k0, v0


class Prefills:
    """Everything one prompt head needs, computed on first use and shared:

    - our arms: one captured prefill, replayed into each arm (replay.py);
    - `unpatched` and `mlx.quantized`: one prefill with the model's own caches,
      copied per arm and quantized afterwards, as mlx-lm's kv_bits does after
      the chunk has attended unquantized;
    - veloxquant arms: one forward pass feeding every arm's caches (FanOut);
      an arm whose caches returned anything other than the leader's (so a
      direct run would have attended differently) is prefilled alone.

    Sharing needs the head to fit in one chunk; otherwise each arm prefills."""

    def __init__(self, model, head, arms, prefill_step_size=2048):
        self.model, self.head, self.step = model, list(head), prefill_step_size
        self.arms = list(arms)
        self.single = len(self.head) <= prefill_step_size
        self._captured, self._dense, self._fanned = None, None, None

    def captured(self):
        if self._captured is None and self.single:
            self._captured = capture_prefill(self.model, self.head)
        return self._captured

    def peer(self, arm: Arm) -> tuple[list, bool]:
        """(caches after the head, whether a shared prefill produced them)."""
        if self.single and mlx_kind(arm) in ("unpatched", "quantized"):
            if self._dense is None:
                self._dense = peer_caches(self.model, Arm("unpatched"))
                prefill_head(self.model, self._dense, self.head, self.step)
            caches = [_copy(c) for c in self._dense]
            if (quantize := peer_quantizer(arm)) is not None:
                quantize(caches)
            return caches, True
        if self.single and arm.algo.startswith("veloxquant."):
            if self._fanned is None:
                self._fanned = self._fan_out()
            if (caches := self._fanned.pop(arm.label, None)) is not None:
                return caches, True
        caches = peer_caches(self.model, arm)
        prefill_head(self.model, caches, self.head, self.step, peer_quantizer(arm))
        return caches, False

    def _fan_out(self) -> dict:
        arms = [a for a in self.arms if a.algo.startswith("veloxquant.")]
        per_arm = [peer_caches(self.model, a) for a in arms]
        layers = [FanOut(list(group)) for group in zip(*per_arm)]
        self.model(mx.array(self.head)[None], cache=layers)
        mx.eval([c.state for caches in per_arm for c in caches])
        fanned = {}
        for i, (arm, caches) in enumerate(zip(arms, per_arm)):
            checks = [layer.same[i] for layer in layers]
            if all(c is not False for c in checks) and all(mx.array(checks).tolist()):
                fanned[arm.label] = caches
        return fanned


def _copy(cache):
    """A KVCache with the same rows in new arrays (mlx-lm writes into its
    buffer in place, so arms must not share one)."""
    from mlx_lm.models.cache import KVCache

    if type(cache) is not KVCache:
        raise TypeError(f"cannot share a prefill of {type(cache).__name__}")
    copy = KVCache()
    if cache.keys is not None:
        n = cache.offset
        copy.keys, copy.values = cache.keys[..., :n, :], cache.values[..., :n, :]
        copy.offset = n
    return copy


@contextlib.contextmanager
def arm_caches(model, arm: Arm, head, prefills=None, prefill_step_size=2048):
    """Yield (caches, shared): `arm`'s caches after `head`, with the model
    patched for `arm` while inside when the arm is ours. `prefills` (a
    Prefills of exactly `head`) shares the prefill between arms."""
    if arm.algo == AUTO:  # its rows follow the prompt's length, not the head's
        raise ValueError("an auto arm is resolved per prompt first (arms.chosen)")
    if is_peer(arm.algo):
        if prefills is not None:
            yield prefills.peer(arm)
            return
        caches = peer_caches(model, arm)
        prefill_head(model, caches, head, prefill_step_size, peer_quantizer(arm))
        yield caches, False
        return
    # a cache that cuts back inside the one captured call changes what later
    # layers see of its later tokens: the replay would not be exact
    bound = api.make_options(arm.algo, arm.options, model)[1]
    chunk = getattr(bound, "prompt_chunk", lambda: None)()
    replayable = prefills is not None and (chunk is None or chunk >= len(head))
    captured = prefills.captured() if replayable else None  # (before patching)
    with api.patched(model, algo=arm.algo, **arm.options) as patch:
        if captured is not None:
            yield captured.caches(arm.algo, arm.options, bound=patch.options), True
        else:
            caches = patch.make_cache()
            prefill_head(model, caches, head, prefill_step_size)
            yield caches, False
