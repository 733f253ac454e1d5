"""`calibrate`: one calibration run of any kind (`veloxpatch.calibrate`,
`veloxpatch calibrate`) on the calibration half of the built-in prose or a
file, each kind's work and file in its own module."""

from __future__ import annotations

from ..errors import CalibrationError

ALGOS = ("qfilters", "a2ats", "kvzap")


def check_algo(algo: str) -> None:
    if algo not in ALGOS:
        raise CalibrationError(
            f"calibration exists for {', '.join(ALGOS)} only, not {algo!r}"
        )


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
    from ..prose import prose_tokens

    check_algo(algo)
    ids = prose_tokens(tokenizer, tokens, text)
    info = {"tokens": tokens, "text": str(text), "seed": seed}
    if algo == "kvzap":
        from .kvzap import calibrate_scorer, save_scorer

        layers, report = calibrate_scorer(
            model, tokenizer, ids, kind, seed=seed, tick=tick, target=target
        )
        if out is not None:
            save_scorer(out, layers, model, kind, info | report, target=target)
        return layers, report
    if algo == "a2ats":
        from .a2ats import calibrate_codebook, save_codebook

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
    from .qfilters import calibrate_filters, save_filters

    per_head, queries = calibrate_filters(model, ids, seed=seed, tick=tick)
    if out is not None:
        info["vectors"] = int(next(q for q in queries if q is not None).shape[1])
        save_filters(out, per_head, model, info)
    return per_head, queries
