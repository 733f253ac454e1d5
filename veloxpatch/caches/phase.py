"""Where one sequence is: prefill -> prompt end -> decode.

One `PromptPhase` is shared by every layer's cache of one prompt cache (what one
`make_cache()` call returns), so all layers agree on when the prompt ended. The
patched forward reports each call (`begin_call`, from every layer; the first
layer of a model call moves the phase, the others find it moved), and
`Patch.end_prompt()` can end the prompt explicitly (`end`).

The rule, from what the forward sees: a multi-token call is prompt; a lone
token after prompt calls may end the prompt; the prompt has ended when the next
call arrives, before it attends, so the last prompt token's query is part of
the prompt. mlx-lm may send one more lone token that is still prompt: when
len(prompt) - 1 = 1 mod prefill_step_size its last prefill chunk has one token,
and only then is it followed by a lone last token. The forward cannot tell that
chunk from the last token; mlx-lm tells them apart for us, since `generate_step`
evaluates every cache's `state` after each prefill chunk and never while
decoding (pinned in mlx_lm_internals): caches report that read with
`chunk_evaluated()`.

`ends` counts prompt ends; a cache that has seen fewer runs its `end_prompt`
hook before attending (or at once, on `Patch.end_prompt()`).

mlx-lm's speculative decoding sends its target only calls of several tokens,
the first led by the prompt's last token: the patch attends that token alone,
then the rest inside `decoding()`, calls of generated tokens (api.py).
"""

from __future__ import annotations

import contextlib
import uuid
import weakref

import mlx.core as mx

PREFILL, ENDING, DECODE = "prefill", "ending", "decode"


class PromptPhase:
    def __init__(self):
        self.state = DECODE  # a lone token before any prompt is not a prompt end
        self.ends = 0  # prompt ends so far
        self.call = None  # (offset, length) of the model call being processed
        self.layers = set()  # the layers that have begun it
        self.after_multi = False  # the previous call had several tokens
        self.maybe_chunk = False  # ENDING: the lone call may be mlx-lm's last chunk
        self.evaluated = False  # mlx-lm evaluated the state since the last call
        self.members = []  # weakrefs to the caches sharing it (model-wide choices)
        self.id = uuid.uuid4().hex  # lets the layers of a saved list share one again
        # token ids of positions tokens_start.. as the patch saw them (kvzip's
        # reconstruction reads them); kvzip's caches save them
        self.tokens: list[int] = []
        self.tokens_start = 0
        self._token_array = None  # `tokens` as one array, once asked for
        self.suspended = False  # a scoring pass runs inside the prompt
        self.decode_call = False  # the call's tokens are generated ones (`decoding`)
        # the server's prompt cache: a copy of the caches at the last prompt end,
        # before any question-aware compression (`VeloxCache.take_snapshot`)
        self.keep_snapshot = False
        self.snapshot: list | None = None
        # the server's prompt cache: (prompt tokens, logits of the last one) of
        # the last prompt call, kept with a snapshot taken after the prompt's end
        # so the same prompt again starts from them (serve/replay.py `ReplayingModel`)
        self.prompt_logits = None
        self.replay = None  # those logits, for the next model call to return
        self.size = 0  # caches in the list (a snapshot needs every layer)

    @property
    def in_prompt(self) -> bool:
        return self.state != DECODE

    def begin_call(self, layer: int, offset: int, length: int) -> None:
        """`layer` starts attending `length` tokens at `offset`."""
        if self.call == (offset, length) and layer not in self.layers:
            self.layers.add(layer)
            return  # another layer of the same model call
        self.call, self.layers = (offset, length), {layer}
        if self.state == ENDING:
            if self.maybe_chunk and self.evaluated:
                self.state = PREFILL  # it was mlx-lm's lone last prefill chunk
            else:
                self.ends += 1
                self.state = DECODE
        self.evaluated = False
        if length > 1 and not self.decode_call:
            self.state = PREFILL
        elif self.state == PREFILL:
            self.state = ENDING
            self.maybe_chunk = self.after_multi
        self.after_multi = length > 1 and not self.decode_call

    def would_end(self, length: int) -> bool:
        """Whether a call of `length` tokens arriving now ends the prompt (the
        rule of `begin_call`, without moving the phase)."""
        if self.state != ENDING:
            return False
        return not (self.maybe_chunk and self.evaluated)

    def takes_prompt(self, length: int) -> bool:
        """Whether a call of `length` tokens arriving now is prompt."""
        several = length > 1 and not self.decode_call
        return several or (self.state != DECODE and not self.would_end(length))

    @contextlib.contextmanager
    def decoding(self):
        """Calls inside are generated tokens, however many (speculative
        decoding's verify calls): they end a prompt that has its last token,
        and never start one."""
        self.decode_call = True
        try:
            yield
        finally:
            self.decode_call = False

    def record(self, offset: int, ids: list[int]) -> None:
        """The ids of positions offset.. (a trim earlier drops what follows;
        a gap restarts the run)."""
        end = self.tokens_start + len(self.tokens)
        if self.tokens_start <= offset <= end:
            del self.tokens[offset - self.tokens_start :]
            self.tokens.extend(ids)
        else:
            self.tokens, self.tokens_start = list(ids), offset
        self._token_array = None

    def restore_tokens(self, ids: list[int], start: int) -> None:
        """The ids a saved cache recorded (positions start..)."""
        self.tokens, self.tokens_start, self._token_array = list(ids), start, None

    def token_array(self):
        """`tokens` as one int32 array (None: none recorded), built once for
        every layer that saves it: mlx-lm reads each layer's state after every
        prefill chunk."""
        if self._token_array is None and self.tokens:
            self._token_array = mx.array(self.tokens, dtype=mx.int32)
        return self._token_array

    def token_ids(self, start: int, end: int) -> list[int] | None:
        """The ids of positions [start, end), or None if not all were seen."""
        if start < self.tokens_start or end > self.tokens_start + len(self.tokens):
            return None
        return self.tokens[start - self.tokens_start : end - self.tokens_start]

    @contextlib.contextmanager
    def suspend(self):
        """A pass inside the prompt (kvzip's reconstruction) leaves the phase as
        it found it: its calls are prompt calls that end nothing."""
        fields = ("state", "ends", "call", "layers", "after_multi")
        saved = {k: getattr(self, k) for k in (*fields, "maybe_chunk", "evaluated")}
        self.state, self.suspended = PREFILL, True
        try:
            yield
        finally:
            self.__dict__.update(saved)
            self.suspended = False

    def chunk_evaluated(self) -> None:
        """mlx-lm read the caches' state (it does after every prefill chunk)."""
        self.evaluated = True

    def end(self) -> None:
        """The caller says the prompt is over."""
        if self.state != DECODE:
            self.ends += 1
            self.state = DECODE

    def copy(self) -> PromptPhase:
        new = PromptPhase()
        new.__dict__.update(
            self.__dict__,
            layers=set(self.layers),
            members=[],
            tokens=list(self.tokens),
        )
        new.id = uuid.uuid4().hex
        return new

    def __deepcopy__(self, memo):
        # A deep-copied cache list shares one copy (memo); its caches re-register.
        new = self.copy()
        memo[id(self)] = new
        return new

    # ---- saved with each cache (every layer holds the same) -------------------
    def as_meta(self) -> dict:
        return {
            "phase_id": self.id,
            "phase": self.state,
            "phase_ends": self.ends,
            "phase_after_multi": self.after_multi,
            "phase_maybe_chunk": self.maybe_chunk,
            "phase_evaluated": self.evaluated,
        }

    @classmethod
    def from_meta(cls, m: dict) -> PromptPhase:
        """The phase of a loaded cache: the layers of one saved list, loaded in
        order (as mlx-lm's load_prompt_cache and load_cache do), share one."""
        key, layer = m.get("phase_id"), int(m.get("layer", 0))
        found = _LOADING.get(key)
        phase = found[0]() if found else None
        if phase is not None and layer > found[1]:
            _LOADING[key] = (found[0], layer)
            return phase
        phase = cls._from_meta(m)
        if key is not None:
            phase.id = key
            _LOADING[key] = (weakref.ref(phase), layer)
        return phase

    @classmethod
    def _from_meta(cls, m: dict) -> PromptPhase:
        phase = cls()
        phase.state = str(m["phase"])
        if phase.state not in (PREFILL, ENDING, DECODE):
            raise ValueError(f"unknown prompt phase {phase.state!r}")
        phase.ends = int(m["phase_ends"])
        phase.after_multi = bool(m["phase_after_multi"])
        phase.maybe_chunk = bool(m["phase_maybe_chunk"])
        phase.evaluated = bool(m["phase_evaluated"])
        return phase


def share_phase(caches) -> None:
    """Give caches built one by one the one phase `make_cache` would give them."""
    ours = [c for c in caches if hasattr(c, "phase")]
    if not ours:
        return
    phase = ours[0].phase
    phase.members = [weakref.ref(c) for c in ours]
    for c in ours:
        c.phase = phase


_LOADING: dict = {}  # phase id -> (weakref to the loaded phase, last layer)
