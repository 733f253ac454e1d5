"""`veloxpatch calibrate`: per-model statistics from real queries (Q-Filters,
the A2ATS codebook, kvzap's surrogates), written to --out or to this model's
file in the calibration cache, with its progress on stderr."""

from __future__ import annotations

import click

from .checks import (
    Count,
    NonEmpty,
    OutputFile,
    TextSource,
    UserError,
    refuse_existing,
    refuse_unread,
    user_errors,
)

SUFFIX = ".safetensors"  # mx.save_safetensors appends it to a name without it
# kvzap's surrogates keep improving with text up to 16,384 tokens and more
# (docs/results.md: held-out R^2 0.47 at 4,096, 0.57 at 16,384), a one-time cost
DEFAULT_TOKENS = {"kvzap": 16384}


@click.command()
@click.option(
    "--model", type=NonEmpty(), default=None, help="default: the embedded SmolLM2"
)
@click.option("--algo", default="qfilters", show_default=True)
@click.option(
    "--out",
    type=OutputFile(SUFFIX),
    default=None,
    help=f"calibration file, its name ending in {SUFFIX} [default: this model's "
    "in $VELOXPATCH_HOME (~/.cache/veloxpatch), where algorithms find it]",
)
@click.option("--force", is_flag=True, help="overwrite --out if it exists")
@click.option(
    "--tokens",
    type=Count(1),
    default=None,
    help="calibration tokens [default: 4096; kvzap 16384]",
)
@click.option(
    "--text",
    type=TextSource(),
    default="calibration",
    show_default=True,
    help="prose: calibration (pydoc), licenses-calibration, mixed-calibration "
    "(both in turn: what the shipped kvzap scorer read), or a UTF-8 file",
)
@click.option("--seed", type=Count(0), default=0, show_default=True)
@click.option(
    "--codebook-size", type=Count(1), default=4096, show_default=True, help="a2ats"
)
@click.option(
    "--far-position", type=int, default=2048, show_default=True, help="a2ats: b"
)
@click.option(
    "--kind",
    type=click.Choice(["linear", "mlp"]),
    default="linear",
    show_default=True,
    help="kvzap: ridge regression or a 2-layer MLP per layer",
)
@click.option(
    "--target",
    type=click.Choice(["kvzip+", "kvzip"]),
    default="kvzip+",
    show_default=True,
    help="kvzap: the scores its surrogates predict, KVzip+ (KVzap's) or KVzip's",
)
@user_errors
def calibrate(
    model,
    algo,
    out,
    force,
    tokens,
    text,
    seed,
    codebook_size,
    far_position,
    kind,
    target,
):
    """Calibrate ALGO (qfilters, a2ats, kvzap) on the model's own queries or
    KVzip+ scores; save to OUT, or where ALGO finds it for this model."""
    import mlx.core as mx

    from ..calibration.run import Progress, check_algo
    from ..calibration.run import calibrate as run_calibration
    from ..loading import models
    from ..prose import check_length, prose_length

    check_algo(algo)  # before the slow load
    if tokens is None:
        tokens = DEFAULT_TOKENS.get(algo, 4096)
    if algo == "a2ats":
        from ..api import make_options
        from ..calibration.a2ats import MAX_KEYS

        # far_position: the check of the option a codebook is later used with
        make_options(algo, {"far_position": far_position})
        most = min(tokens, MAX_KEYS)
        if codebook_size > most:
            raise UserError(
                f"--codebook-size must be at most {most:,} (the keys captured: "
                f"--tokens, up to {MAX_KEYS:,}), got {codebook_size:,}"
            )
    else:
        ctx = click.get_current_context()
        refuse_unread(ctx, ("codebook_size", "far_position"), f"for a2ats, not {algo}")
    if algo != "kvzap":
        ctx = click.get_current_context()
        refuse_unread(ctx, ("kind", "target"), f"for kvzap, not {algo}")
    elif tokens < 256:
        raise UserError(
            f"--tokens must be at least 256 for kvzap (two segments of text, one "
            f"held out), got {tokens:,}"
        )
    if out is not None:
        refuse_existing(force, out=out)
    else:
        ctx = click.get_current_context()
        refuse_unread(ctx, ("force",), "for --out (the cache's file is replaced)")
    loaded, tokenizer = models.load(model)
    check_length(prose_length(tokenizer, text), tokens, text)  # before any work
    if out is None:  # a re-run for this model replaces its file
        from model_adapters.base import fingerprint

        from ..caches.calibration_files import home_for_writing

        out = home_for_writing(algo, fingerprint(loaded))
    progress = Progress(algo, tokens, len(loaded.layers))
    per_head, queries = run_calibration(
        loaded,
        tokenizer,
        algo,
        tokens=tokens,
        text=text,
        out=out,
        seed=seed,
        tick=progress.read,
        fit_tick=progress.fitted,
        codebook_size=codebook_size,
        far_position=far_position,
        kind=kind,
        target=target,
    )
    if algo == "kvzap":
        r = queries
        click.echo(
            f"wrote {out}: {kind} surrogates of {target} scores, from "
            f"{r['segments']} segments of {r['segment_tokens']} tokens "
            f"({r['held_out_segments']} held out: mean R^2 {r['mean_r2']:.3f}, "
            f"rank correlation {r['mean_spearman']:.3f}); scoring "
            f"{r['scoring_seconds']} s, fit {r['fit_seconds']} s"
        )
        return
    # sliding-window layers keep mlx-lm's cache: nothing calibrated there
    pairs = [(q, f) for q, f in zip(queries, per_head) if f is not None]
    if algo == "a2ats":
        click.echo(
            f"wrote {out}: {len(pairs)} layers, {codebook_size} centroids per KV "
            f"head from {pairs[0][0][0].shape[1]} keys, queries rotated to "
            f"b={far_position}"
        )
        return
    # per layer and query head: the share of its queries projecting positively
    positive = mx.concatenate(
        [((q * f[:, None, :]).sum(-1) > 0).mean(-1) for q, f in pairs]
    )
    click.echo(
        f"wrote {out}: {len(pairs)} layers, {pairs[0][0].shape[1]} queries per "
        f"head; share of a head's queries projecting positively on its filter: "
        f"min {positive.min().item():.3f}, mean {positive.mean().item():.3f}"
    )
