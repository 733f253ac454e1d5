"""kvzip's reconstruction pass: after a context, "Repeat the previous context
exactly." and the context itself are fed, teacher-forced, in chunks (later
chunks start "... starting with" the previous chunk's last `OVERLAP` tokens),
attending to the cached context; the caches score each stored pair by the
attention the repeat gives it (`cache.py`) and drop the repeat's rows.

It runs wherever the context's token ids are known: `Patch.prefill` (through
`KVzipCache.finish_context`) and, inside mlx-lm's generate functions and the
server, before the call that ends a prompt (`model_forward`, the patch's
whole-model wrapper, which records each prompt's ids on its prompt phase).
"""

from __future__ import annotations

import copy

import mlx.core as mx

from ..batch import SequenceBatch

REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the previous chunk a later chunk starts from


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
    for rng, ids in repeat_inputs(context, tokenizer, o.repeat_chunk, start):
        for c in zipped:
            c.repeat = c.rows_of(rng)
        # mlx-lm's caches (sliding-window layers) would lose context to the
        # repeat: they see a copy; the logits are never evaluated (lazy).
        chunk_caches = [c if c in zipped else copy.deepcopy(c) for c in caches]
        model(mx.array(ids)[None], cache=chunk_caches)
        for c in zipped:
            c.trim(len(ids))
    for c in zipped:
        c.repeat = None


def model_forward(cls, patch, wrapped, model, args, kwargs):
    """A patched model's call (kvzip only): it records the token ids of every
    call, prompt and generated, and before the call that ends a prompt it runs
    the reconstruction pass over what was added since the last compression (a
    second turn: the answer and the new prompt), so mlx-lm's generate
    functions and the server score as `prefill` does. In one of mlx-lm's
    batches each sequence records its own ids (not the padding) and is
    reconstructed on its own caches; a batch with mlx-lm's caches (sliding-
    window layers) passes through, its sequences scored by their prompt's
    window (`cache.py`)."""
    ids = args[0] if args else kwargs.get("inputs")
    caches = kwargs["cache"] if "cache" in kwargs else (args[1:2] or [None])[0]
    if not isinstance(ids, mx.array) or ids.ndim != 2 or not caches:
        return wrapped(*args, **kwargs)
    if all(isinstance(c, SequenceBatch) for c in caches):
        sequences = [
            ([c.caches[b] for c in caches], *caches[0].span(b, ids.shape[1]))
            for b in range(ids.shape[0])
        ]
    else:
        sequences = [(caches, 0, ids.shape[1])] if ids.shape[0] == 1 else []
    for b, (own, start, end) in enumerate(sequences):
        zipped = [c for c in own if isinstance(c, cls)]
        if not zipped or zipped[0].phase.suspended or end <= start:
            continue
        first = zipped[0]
        if first.phase.would_end(end - start):
            _score_segment(patch, model, own, zipped)
        # generated tokens too: a later prompt's pass reconstructs the answer
        first.phase.record(first.offset, ids[b, start:end].tolist())
    return wrapped(*args, **kwargs)


def _score_segment(patch, model, caches, zipped) -> None:
    """Reconstruct the prompt's positions not yet compressed, if they are all
    held, their ids known, and compressing would evict anything."""
    first = zipped[0]
    if patch.tokenizer is None or not first.needs_scores():
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
