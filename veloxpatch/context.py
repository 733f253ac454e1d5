"""Compress a context once, ask it many questions.

`prefill(patch, tokens)` runs a context through the patched model with no
question, compresses it (for `kvzip`, after its reconstruction pass) and returns
the prompt cache: pass it as `prompt_cache=` to mlx-lm's generate functions, and
the tokens sent next continue the same text. `copy_cache(caches)` gives an
independent copy, so one question never changes the context the next one sees.
"""

from __future__ import annotations

import weakref

import mlx.core as mx

from .caches.base import VeloxCache
from .caches.kvzip import OVERLAP, REPEAT_FIRST, REPEAT_NEXT, KVzipCache
from .errors import OptionError


def prefill(patch, tokens, *, tokenizer=None, chunk: int = 2048, context_start=0):
    """The compressed prompt cache of `tokens` (ids, a list or mx.array).
    `tokenizer` (mlx-lm's or any with `encode`): needed by kvzip to phrase its
    repeat instruction; `context_start`: tokens before it (a chat template's
    head) are attended but not reconstructed."""
    ids = _ids(tokens)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise OptionError(f"chunk must be a positive integer, got {chunk!r}")
    caches = patch.make_cache()
    zipped = [c for c in caches if isinstance(c, KVzipCache)]
    if zipped and tokenizer is None:
        raise OptionError("kvzip's reconstruction pass needs the tokenizer")
    for c in zipped:
        c.score_prompt = False  # the reconstruction scores instead
    for start in range(0, len(ids), chunk):
        patch.model(mx.array(ids[start : start + chunk])[None], cache=caches)
        mx.eval([c.state for c in caches])
    if zipped:
        with zipped[0].phase.suspend():
            reconstruct(patch.model, caches, zipped, ids[context_start:], tokenizer)
    patch.end_prompt(caches)
    return caches


def _ids(tokens) -> list[int]:
    ids = tokens.tolist() if isinstance(tokens, mx.array) else list(tokens)
    if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise OptionError("tokens must be a non-empty list of token ids")
    return ids


def repeat_inputs(context: list[int], tokenizer, chunk: int, start: int):
    """(context range, repeat tokens) per reconstruction chunk: the instruction,
    the chat template's turn change, then the chunk itself."""
    turn = _assistant_turn(tokenizer)
    out = []
    for a in range(0, len(context), chunk):
        piece = context[a : a + chunk]
        if a == 0:
            ask = _encode(tokenizer, REPEAT_FIRST)
        else:
            ask = _encode(tokenizer, REPEAT_NEXT) + context[a - OVERLAP : a]
        out.append(((start + a, start + a + len(piece)), ask + turn + piece))
    return out


def reconstruct(model, caches, zipped, context, tokenizer) -> None:
    """KVzip's scoring pass over `context`, the ids of the newest positions:
    each chunk's repeat attends to the cached context, its rows are trimmed
    off after scoring."""
    o = zipped[0].options
    start = zipped[0].offset - len(context)
    for c in zipped:
        c.begin_reconstruction(start)
    for rng, ids in repeat_inputs(context, tokenizer, o.chunk, start):
        for c in zipped:
            c.repeat = c.rows_of(rng)
        # mlx-lm's caches (sliding-window layers) would lose context to the
        # repeat: they see a copy; the logits are never evaluated (lazy).
        chunk_caches = [
            c if isinstance(c, VeloxCache) else copy_cache([c])[0] for c in caches
        ]
        model(mx.array(ids)[None], cache=chunk_caches)
        for c in caches:
            if isinstance(c, VeloxCache):
                c.trim(len(ids))
    for c in zipped:
        c.repeat = None


def model_forward(patch, wrapped, model, args, kwargs):
    """A patched model's call (kvzip only): it records the prompt's token ids,
    and before the call that ends a prompt it runs the reconstruction pass over
    what the prompt added, so mlx-lm's generate functions and the server score
    as `prefill` does. Batched calls (one cache list per batch) pass through:
    their sequences are scored by their own queries (`KVzipCache`)."""
    ids = args[0] if args else kwargs.get("inputs")
    caches = kwargs["cache"] if "cache" in kwargs else (args[1:2] or [None])[0]
    zipped = [c for c in caches or () if isinstance(c, KVzipCache)]
    if (
        not zipped
        or not isinstance(ids, mx.array)
        or ids.ndim != 2
        or ids.shape[0] != 1
        or zipped[0].phase.suspended
    ):
        return wrapped(*args, **kwargs)
    first = zipped[0]
    n = ids.shape[1]
    if first.phase.would_end(n):
        _score_segment(patch, model, caches, zipped)
    elif first.phase.takes_prompt(n):
        first.phase.record(first.offset, ids[0].tolist())
    return wrapped(*args, **kwargs)


def _score_segment(patch, model, caches, zipped) -> None:
    """Reconstruct the prompt's positions not yet compressed, if they are all
    held, their ids known, and compressing would evict anything."""
    first = zipped[0]
    if patch.tokenizer is None or not first.options.reconstruct:
        return
    if not first.needs_scores():
        return
    start = max(first.segment_start(), first.offset - min(c.run() for c in zipped))
    ids = first.phase.token_ids(start, first.offset)
    if ids:
        with first.phase.suspend():
            reconstruct(model, caches, zipped, ids, patch.tokenizer)


def _encode(tokenizer, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def _assistant_turn(tokenizer) -> list[int]:
    """The tokens that end a user turn and start the assistant's, from the chat
    template (a newline when there is none)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return _encode(tokenizer, "\n")
    marker = "\x00veloxpatch\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return _encode(tokenizer, text.split(marker, 1)[1])


def copy_cache(caches: list) -> list:
    """An independent copy of a prompt cache: new arrays (the caches update
    their buffers in place), one new prompt phase shared as in the original."""
    from mlx_lm.models import cache as mlx_cache

    phases: dict[int, object] = {}
    out = []
    for c in caches:
        if isinstance(c, VeloxCache):
            new = c.clone()
            new.phase = phases.setdefault(id(c.phase), c.phase.copy())
            new.phase.members.append(weakref.ref(new))
        elif c is None:
            new = None
        else:  # mlx-lm's own cache (a sliding-window layer)
            new = type(c).from_state(_copied(c.state))
            meta = getattr(c, "meta_state", None)
            if meta is not None and not isinstance(c, mlx_cache.KVCache):
                new.meta_state = meta
            elif isinstance(c, mlx_cache.KVCache):
                new.offset = c.offset
        out.append(new)
    return out


def _copied(state):
    if isinstance(state, mx.array):
        return mx.array(state)
    if isinstance(state, (list, tuple)):
        return type(state)(_copied(s) for s in state)
    return state
