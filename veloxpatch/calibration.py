"""Calibration from the model's real queries, captured through the patch seam.

Q-Filters (Godey et al., 2025): per layer and query head, the first right
singular vector of post-RoPE queries (the frame the cache scores keys in),
oriented so that most queries project positively, averaged over each GQA group.

The queries come through the probe seam (`probe.py`); the files are written and
read by `calibration_files.py`.
"""

from __future__ import annotations

import mlx.core as mx

from .calibration_files import save_filters
from .errors import CalibrationError
from .probe import rows_at, run_probe, sample_positions

MAX_VECTORS = 3000  # queries kept per layer and query head


# ---- query capture ---------------------------------------------------------------
def capture_queries(model, ids, chunk=1024, max_vectors=MAX_VECTORS, seed=0, tick=None):
    """Per layer [Hq, n, D] post-RoPE queries at up to `max_vectors` positions of
    `ids` (a seeded sample), the model run over `ids` in chunks of `chunk`;
    None for sliding-window layers."""
    wanted = sample_positions(len(ids), max_vectors, seed)
    kept: dict[int, list] = {}

    def keep(seen):
        idx = rows_at(wanted, seen)
        if idx is not None:
            piece = seen.q[0][:, idx].astype(mx.float32)
            mx.eval(piece)
            kept.setdefault(seen.layer, []).append(piece)

    run_probe(model, ids, keep, chunk=chunk, tick=tick)
    return [
        mx.concatenate(kept[i], axis=1) if i in kept else None
        for i in range(len(model.layers))
    ]


def query_filters(queries: mx.array) -> mx.array:
    """[Hq, D] unit filters: per head, v1 of the SVD of its queries [Hq, n, D],
    signed so that most queries project positively. SVD runs on the CPU."""
    with mx.stream(mx.cpu):
        _, _, vt = mx.linalg.svd(queries.astype(mx.float32))
        v1 = vt[:, 0, :]  # [Hq, D]
        proj = (queries * v1[:, None, :]).sum(-1)  # [Hq, n]
        positive = (proj > 0).mean(-1) >= 0.5
        v1 = mx.where(positive[:, None], v1, -v1)
        mx.eval(v1)
    return v1


ALGOS = ("qfilters", "a2ats", "kvzap")


def check_algo(algo: str) -> None:
    if algo not in ALGOS:
        raise CalibrationError(
            f"calibration exists for {', '.join(ALGOS)} only, not {algo!r}"
        )


# ---- the whole job -----------------------------------------------------------------
def calibrate(
    model,
    tokenizer,
    algo="qfilters",
    *,
    tokens=4096,
    text="calibration",
    out=None,
    seed=0,
    tick=None,
    codebook_size=4096,
    far_position=2048,
    kind="linear",
    target="kvzip+",
):
    """Calibrate `algo` on `tokens` tokens of calibration prose (the half never
    used for evaluation, or a file), written to `out` with the model's
    fingerprint when given. qfilters: per layer [Hq, D] query-head filters and
    the queries; a2ats: per layer codebooks and the captured (keys, queries);
    kvzap: per layer surrogates of `kind` predicting `target` scores, and
    their held-out report."""
    from .eval.text import prose_tokens

    check_algo(algo)
    ids = prose_tokens(tokenizer, tokens, text)
    info = {"tokens": tokens, "text": str(text), "seed": seed}
    if algo == "kvzap":
        from .calibration_files import save_scorer
        from .kvzap_scorer import calibrate_scorer

        layers, report = calibrate_scorer(
            model, tokenizer, ids, kind, seed=seed, tick=tick, target=target
        )
        if out is not None:
            save_scorer(out, layers, model, kind, info | report, target=target)
        return layers, report
    if algo == "a2ats":
        from .calibration_files import save_codebook
        from .codebook import calibrate_codebook

        books, captured = calibrate_codebook(
            model,
            ids,
            size=codebook_size,
            far_position=far_position,
            seed=seed,
            tick=tick,
        )
        if out is not None:
            n = next(c for c in captured if c is not None)[0].shape[1]
            info.update(size=codebook_size, vectors=int(n))
            save_codebook(out, books, model, far_position, info)
        return books, captured
    queries = capture_queries(model, ids, seed=seed, tick=tick)
    per_head = [None if q is None else query_filters(q) for q in queries]
    if out is not None:
        info["vectors"] = int(next(q for q in queries if q is not None).shape[1])
        save_filters(out, per_head, model, info)
    return per_head, queries
