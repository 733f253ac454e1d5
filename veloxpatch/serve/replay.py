"""The same prompt again, from its entry: logits replay.

A cache compressed as its prompt ended (kvzip, kvzap) cannot be trimmed to read
the prompt's last token again, so a retry or a regenerated answer could not
reuse its entry. The prompt's last call keeps its logits (`ReplayingModel`),
an entry keeps them with its snapshot, and a fetch of exactly that prompt
(`replay_last_token`) has the next call return them without touching the
cache.
"""

from __future__ import annotations


class ReplayingModel:
    """The served model as the one-at-a-time path calls it. A cache compressed
    as its prompt ended (kvzip, kvzap) cannot be trimmed to read the prompt's
    last token again, so the same prompt again could not reuse its entry: its
    prompt's last call keeps its logits (`prompt_logits`, copied into the
    snapshot), and a fetch of exactly that prompt (`replay_last_token`) has
    the next call, the last token's, return them without touching the cache.
    The generation then goes on from the state the first request decoded from."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, inputs, cache=None, **kwargs):
        phase = phase_of(cache)
        if phase is not None and phase.replay is not None:
            logits, phase.replay = phase.replay, None
            if inputs.shape[-1] == 1:
                return logits
        out = self.model(inputs, cache=cache, **kwargs)
        # the last prompt call is a lone token (generate_step's `_step`)
        if phase is not None and phase.keep_snapshot and inputs.shape[-1] == 1:
            if phase.in_prompt:
                ours = [c for c in cache if hasattr(c, "phase")]
                phase.prompt_logits = (ours[0].offset, out[:, -1:, :])
        return out


def phase_of(cache):
    """The prompt phase a list of caches shares (None: no veloxpatch cache)."""
    if not cache:
        return None
    for c in cache:
        if hasattr(c, "phase"):
            return c.phase
    return None


def replay_last_token(cache, n: int) -> bool:
    """Arm `cache` (an entry of exactly n prompt tokens, past its prompt's
    end) to give its kept logits for the last token: whether it could."""
    phase = phase_of(cache)
    kept = getattr(phase, "prompt_logits", None)
    if kept is None or kept[0] != n or phase.in_prompt:
        return False
    if any(c.offset != n for c in cache if hasattr(c, "phase")):
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


def kept_logits_bytes(cache) -> int:
    kept = getattr(phase_of(cache), "prompt_logits", None)
    return 0 if kept is None else kept[1].nbytes
