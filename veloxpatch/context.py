"""Compress a context once, ask it many questions.

`prefill(patch, tokens)` runs a context through the patched model with no
question, compresses it (after the algorithm's own pass over the context,
`VeloxCache.finish_context`: kvzip's reconstruction) and returns
the prompt cache: pass it as `prompt_cache=` to mlx-lm's generate functions, and
the tokens sent next continue the same text. `copy_cache(caches)` gives an
independent copy, so one question never changes the context the next one sees.
"""

from __future__ import annotations

import weakref

import mlx.core as mx

from .caches.base import VeloxCache
from .errors import OptionError


def prefill(patch, tokens, *, tokenizer=None, chunk: int = 2048, context_start=0):
    """The compressed prompt cache of `tokens` (ids, a list or mx.array).
    `tokenizer` (mlx-lm's or any with `encode`): needed by kvzip to phrase its
    repeat instruction; `context_start`: tokens before it (a chat template's
    head) are attended but not reconstructed."""
    ids = _ids(tokens)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise OptionError(f"chunk must be a positive integer, got {chunk!r}")
    if patch.cache_cls.wants_token_ids and tokenizer is None:
        raise OptionError(f"{patch.algo}'s scoring pass needs the tokenizer")
    caches = patch.make_cache(n_tokens=len(ids))
    for start in range(0, len(ids), chunk):
        patch.model(mx.array(ids[start : start + chunk])[None], cache=caches)
        mx.eval([c.state for c in caches])
    patch.cache_cls.finish_context(patch.model, caches, ids[context_start:], tokenizer)
    patch.end_prompt(caches)
    return caches


def _ids(tokens) -> list[int]:
    ids = tokens.tolist() if isinstance(tokens, mx.array) else list(tokens)
    if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise OptionError("tokens must be a non-empty list of token ids")
    return ids


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
