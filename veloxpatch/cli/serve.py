"""`veloxpatch serve`: mlx-lm's server on a patched model (veloxpatch.serve).

Our options are click's; every other option is one of mlx-lm's server flags and
goes to mlx-lm's own argument parser (taken from `mlx_lm.server.main` by
mlx_lm_internals, so the flags and defaults are exactly mlx-lm's). Everything is
checked before the model loads.
"""

from __future__ import annotations

import argparse
import os

import click

from .checks import (
    NonEmpty,
    UserError,
    algo_options,
    refuse_missing_calibration,
    user_errors,
)

DEFAULT_DISK_BYTES = "10GB"  # --prompt-cache-disk-bytes
# mlx-lm server flags that would bypass or break the patch: refused up front
REFUSED = {
    "--kv-bits": "mlx-lm's --kv-bits swaps in its own quantized cache; use "
    "--algo kivi or --algo-arg kv_bits=4",
    "--draft-model": "speculative decoding is not supported by veloxpatch serve",
    "--adapter-path": "adapters are not supported by veloxpatch serve",
    "--pipeline": "distributed serving is not supported by veloxpatch serve",
}
# ours, refused, or meaningless without a refused one
HIDDEN = {
    "help",
    "model",
    "adapter_path",
    "draft_model",
    "num_draft_tokens",
    "kv_bits",
    "kv_group_size",
    "quantized_kv_start",
    "pipeline",
}


SERVE_PREFILL_STEP = 512  # scripts/results/bench_serve_burst.md


def mlx_server_parser() -> argparse.ArgumentParser:
    """mlx-lm's server parser (a test checks the flags we rely on), answering
    as `veloxpatch serve`."""
    from ..mlx_lm_internals import server_parser

    parser = server_parser()
    parser.prog = "veloxpatch serve"
    # prompts read 512 tokens a step (mlx-lm: 2048): a burst of four 1,000-token
    # documents grows RSS 0.36x mlx-lm's, not 0.74x (1,024) or 0.80x (2,048); its
    # first token is 1.06x mlx-lm's, 0.96x at 2,048 (bench_serve_burst*.md)
    parser.set_defaults(prefill_step_size=SERVE_PREFILL_STEP)
    for action in parser._actions:
        if action.dest == "prefill_step_size":
            action.help = f"prompt tokens read a step (default: {SERVE_PREFILL_STEP})"

    def error(message):
        raise UserError(f"{message} (see 'veloxpatch serve --help')")

    parser.error = error  # one line, exit 2, like every other option
    parser.allow_abbrev = False  # "--kv-bit 4" would slip past REFUSED
    return parser


def mlx_flags_help(parser) -> str:
    fmt = parser._get_formatter()
    fmt.start_section("mlx-lm server options (passed to mlx_lm.server)")
    fmt.add_arguments([a for a in parser._actions if a.dest not in HIDDEN])
    fmt.end_section()
    refused = ", ".join(REFUSED)
    return (
        fmt.format_help() + f"\nNot supported here: {refused} (kv bits: use "
        "--algo kivi or --algo-arg kv_bits=4).\n"
    )


def parse_mlx_flags(extra: list[str]) -> argparse.Namespace:
    for arg in extra:
        name = arg.split("=", 1)[0]
        if name in REFUSED:
            raise UserError(f"{name}: {REFUSED[name]}")
        if name in ("--model", "-h"):
            raise UserError(f"{name} is given once, before the mlx-lm flags")
    return mlx_server_parser().parse_args(extra)


def default_kv_cap() -> tuple[int | None, int | None]:
    """(the default --kv-cap, the machine's memory): a quarter of it, the rest
    left to the weights, mlx's buffers and everything else; (None, None) where
    the memory cannot be read."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None, None
    return (memory // 4, memory) if memory > 0 else (None, None)


class ServeCommand(click.Command):
    def format_help(self, ctx, formatter):
        super().format_help(ctx, formatter)
        formatter.write("\n" + mlx_flags_help(mlx_server_parser()))


@click.command(
    cls=ServeCommand,
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.option(
    "--model", type=NonEmpty(), default=None, help="default: the embedded SmolLM2"
)
@click.option(
    "--algo",
    default=None,
    help="default: auto with --max-kv-bytes (the best measured choice), else full",
)
@click.option("--budget", type=int, default=None, help="KV rows kept per head")
@click.option(
    "--max-kv-bytes",
    default=None,
    metavar="SIZE",
    help="instead of --budget: KV bytes each sequence holds once its prompt is "
    "read, e.g. 48MB, or a share of each request's full KV, e.g. 20% (the "
    "budget follows, request by request)",
)
@click.option(
    "--algo-arg",
    "algo_args",
    multiple=True,
    metavar="KEY=VALUE",
    help="algorithm option, repeatable",
)
@click.option(
    "--kv-cap",
    default=None,
    metavar="SIZE",
    help="cap on the KV bytes of all requests in flight plus the prompt cache, "
    "e.g. 2GB (over it: prompt-cache entries are evicted, then requests get 503); "
    "default: a quarter of this machine's memory; 'none': no cap",
)
@click.option(
    "--max-requests",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="requests in flight (queued or generating) at once; more get 503 "
    "with Retry-After",
)
@click.option(
    "--read-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    metavar="SECONDS",
    help="a request whose headers or body do not arrive in time gets 408",
)
@click.option(
    "--prompt-cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="also write every prompt-cache entry to DIR (checksummed) and load "
    "them after a restart, for requests that start with their tokens",
)
@click.option(
    "--prompt-cache-disk-bytes",
    default=None,
    metavar="SIZE",
    help=f"bound on DIR's entries, least recently used deleted first "
    f"(default {DEFAULT_DISK_BYTES})",
)
@click.option(
    "--quantized/--dequantized",
    default=None,
    help="keep quantized weights (default: dequantize on the CPU)",
)
@click.option(
    "--compress-system-prompt",
    is_flag=True,
    help="kvzip: compress each system prompt on its own, question-agnostic, "
    "once; its users' questions are read on the compressed entry (no pass)",
)
@click.pass_context
@user_errors
def serve(
    ctx,
    model,
    algo,
    budget,
    max_kv_bytes,
    algo_args,
    kv_cap,
    max_requests,
    read_timeout,
    quantized,
    compress_system_prompt,
    prompt_cache_dir,
    prompt_cache_disk_bytes,
):
    """Serve a patched model with mlx-lm's OpenAI-compatible server.

    Every request is served by the one model given (patched with ALGO); a
    request naming another model gets HTTP 404. Caches that cannot batch are
    served one request at a time (the log says why).
    """
    import logging

    from ..api import make_options
    from ..errors import OptionError
    from ..pricing import parse_size, split_share

    algo = algo or ("auto" if max_kv_bytes is not None else "full")
    options = algo_options(budget, algo_args, max_kv_bytes)
    if algo == "auto":
        check_serve_auto(options, compress_system_prompt)
    try:
        # fail before the slow load (auto's algorithm is chosen once it loads;
        # a share sets each request's rows)
        named = None if algo == "auto" else split_share(algo, options)[0]
        cache_cls = None if algo == "auto" else make_options(algo, named)[0]
    except OptionError as e:
        if max_kv_bytes is None:
            raise
        # the flag named the server's cap here before it got its own name
        raise UserError(
            f"{e} (--max-kv-bytes is the per-sequence budget, as in generate; "
            "the server's cap is --kv-cap)"
        ) from None
    if algo != "auto":
        refuse_missing_calibration(algo, options)
    if compress_system_prompt and cache_cls and not cache_cls.wants_token_ids:
        raise UserError(
            f"--compress-system-prompt: {algo} has no question-agnostic pass to "
            "compress a system prompt alone; use --algo kvzip"
        )
    if kv_cap is None:
        cap, memory = default_kv_cap()
        cap_note = (
            "no cap (this machine's memory is unknown)"
            if cap is None
            else f"{cap:,} bytes, a quarter of this machine's {memory:,} bytes "
            "of memory (--kv-cap to change, --kv-cap none for no cap)"
        )
    elif kv_cap.strip().lower() == "none":
        cap, cap_note = None, "none (--kv-cap none)"
    else:
        cap = parse_size(kv_cap, "--kv-cap")
        cap_note = f"{cap:,} bytes (--kv-cap)"
    if prompt_cache_disk_bytes is not None and prompt_cache_dir is None:
        raise UserError("--prompt-cache-disk-bytes needs --prompt-cache-dir")
    disk_bytes = parse_size(
        prompt_cache_disk_bytes or DEFAULT_DISK_BYTES, "--prompt-cache-disk-bytes"
    )
    cli_args = parse_mlx_flags(list(ctx.args))
    cli_args.model = model

    logging.basicConfig(
        level=getattr(logging, cli_args.log_level.upper()),
        format="%(asctime)s - %(levelname)s - %(message)s",
    )
    from ..serve.server import run

    run(
        cli_args,
        model,
        algo,
        options,
        kv_cap=cap,
        kv_cap_note=cap_note,
        quantized=quantized,
        compress_system=compress_system_prompt,
        read_timeout=read_timeout,
        max_requests=max_requests,
        prompt_cache_dir=prompt_cache_dir,
        prompt_cache_disk_bytes=disk_bytes,
    )


def check_serve_auto(options: dict, compress_system_prompt: bool) -> None:
    """auto on the server: chosen once at load for a size per sequence (a
    request's own max_kv_bytes re-prices the rows of that choice)."""
    from .checks import check_auto

    check_auto(options, None)
    if compress_system_prompt:
        raise UserError("--compress-system-prompt needs --algo kvzip, not auto")
