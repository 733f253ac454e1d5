"""The same prompt again, from its entry: a cache compressed as its prompt
ended (kvzip, kvzap) cannot be trimmed to read the last token again, so its
entry keeps that token's logits and the retry's call returns them."""

from __future__ import annotations

import mlx.core as mx

from ..caches.batch import SequenceBatch


class ReplayingModel:
    """The served model as mlx-lm calls it, alone or batched: each sequence's
    last prompt call keeps its logits (`prompt_logits`, copied into its
    snapshot); one armed by `replay_last_token` gets them back for its last
    token, which its caches never see, while the call's other rows run."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, inputs, cache=None, **kwargs):
        sequences = sequence_caches(cache)
        if not sequences:
            return self.model(inputs, cache=cache, **kwargs)
        kept = {}
        for b, c in enumerate(sequences):
            if c.phase.replay is not None:
                kept[b], c.phase.replay = c.phase.replay, None
        lone = inputs.shape[-1] == 1
        if kept and lone:
            out = self._replaying(inputs, cache, kept, kwargs)
        else:
            out = self.model(inputs, cache=cache, **kwargs)
        # a sequence's last prompt call is a lone token (mlx-lm's first step)
        for b, c in enumerate(sequences if lone else ()):
            if b not in kept and c.phase.keep_snapshot and c.phase.in_prompt:
                c.phase.prompt_logits = (c.offset, out[b : b + 1, -1:, :])
        return out

    def _replaying(self, inputs, cache, kept, kwargs):
        """The call's logits: the kept ones for the `kept` rows, the model's,
        run on the other rows' caches only, for the rest."""
        rest = [b for b in range(inputs.shape[0]) if b not in kept]
        if rest:  # every layer ours (replay_last_token): each a SequenceBatch
            out = self.model(
                inputs[mx.array(rest)], cache=[c.subset(rest) for c in cache], **kwargs
            )
        rows = [
            kept[b] if b in kept else out[rest.index(b)][None]
            for b in range(inputs.shape[0])
        ]
        return rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=0)


def sequence_caches(cache) -> list:
    """The first veloxpatch layer's cache of each sequence in a model call (a
    cache alone, or a batch's per-sequence caches); [] if none is ours."""
    for c in cache or ():
        if hasattr(c, "phase"):
            return [c]
        if isinstance(c, SequenceBatch):
            return list(c.caches)
    return []


def kept_logits(cache):
    """(n, logits) of its prompt's last token that a cache's phase kept
    (`prompt_logits`), or None."""
    first = sequence_caches(cache)
    return getattr(first[0].phase, "prompt_logits", None) if first else None


def replay_last_token(cache, n: int) -> bool:
    """Arm `cache` (an entry of exactly n prompt tokens, past its prompt's
    end, every layer ours: in a batch it sits out a call) to give its kept
    logits for the last token: whether it could."""
    if any(getattr(c, "phase", None) is None or c.offset != n for c in cache):
        return False
    phase = cache[0].phase  # one phase of every layer
    kept = phase.prompt_logits
    if kept is None or kept[0] != n or phase.in_prompt:
        return False
    phase.replay = kept[1]
    return True


def revive(caches, kept) -> None:
    """Caches loaded from a file (disk.py), made what the entry kept in
    memory was: one phase of every layer, snapshots at their prompt ends as
    the server asks, the kept logits of its prompt's last token."""
    ours = [c for c in caches if hasattr(c, "phase")]
    if not ours:
        return
    phase = ours[0].phase
    phase.size = len(ours)
    phase.keep_snapshot = type(ours[0]).policy_for(ours[0].options) == "prompt"
    phase.prompt_logits = kept
