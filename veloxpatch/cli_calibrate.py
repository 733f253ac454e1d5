"""`veloxpatch calibrate`: per-model statistics from real queries (Q-Filters,
the A2ATS codebook)."""

from __future__ import annotations

import sys

import click

from .cli import _user_errors, main


@main.command()
@click.option("--model", default=None, help="default: the embedded SmolLM2")
@click.option("--algo", default="qfilters", show_default=True)
@click.option("--out", required=True, help="calibration file (safetensors)")
@click.option("--tokens", type=int, default=4096, show_default=True)
@click.option(
    "--text",
    default="calibration",
    show_default=True,
    help="prose: the built-in calibration half, or a file",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--codebook-size", type=int, default=4096, show_default=True, help="a2ats"
)
@click.option(
    "--far-position", type=int, default=2048, show_default=True, help="a2ats: b"
)
@_user_errors
def calibrate(model, algo, out, tokens, text, seed, codebook_size, far_position):
    """Calibrate ALGO (qfilters, a2ats) on the model's own queries; save to OUT."""
    import mlx.core as mx

    from . import calibration, models

    calibration.check_algo(algo)  # before the slow load
    if tokens < 1:
        raise click.UsageError("--tokens must be positive")
    if algo == "a2ats" and not 1 <= codebook_size <= min(tokens, 65536):
        raise click.UsageError(
            f"--codebook-size must be between 1 and the token count ({tokens})"
        )
    loaded, tokenizer = models.load(model)
    with click.progressbar(
        length=tokens, label="calibration tokens", file=sys.stderr
    ) as bar:
        per_head, queries = calibration.calibrate(
            loaded,
            tokenizer,
            algo,
            tokens=tokens,
            text=text,
            out=out,
            seed=seed,
            tick=bar.update,
            codebook_size=codebook_size,
            far_position=far_position,
        )
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
