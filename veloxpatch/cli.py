"""`veloxpatch` command line. User errors print one line and exit 2; every
option is checked (cli_checks) before a model loads or any work starts."""

from __future__ import annotations

import sys
import textwrap

import click

from . import blas, cli_calibrate, cli_compress, cli_eval, cli_serve
from .cli_checks import (
    Count,
    Finite,
    Group,
    NonEmpty,
    UserError,
    algo_options,
    user_errors,
)


@click.group(cls=Group)
@click.version_option(package_name="veloxpatch")
def main():
    """Query-aware KV-cache compression for mlx-lm models."""
    blas.preload()  # before anything below imports mlx


# each subcommand module defines its command; the group only gathers them
main.add_command(cli_calibrate.calibrate)
main.add_command(cli_compress.compress)
main.add_command(cli_eval.eval_)
main.add_command(cli_eval.bench)
main.add_command(cli_serve.serve)


@main.command()
@click.option(
    "--model",
    type=NonEmpty(),
    default=None,
    help="GGUF file, mlx-lm model dir or hub id "
    "(default: the embedded SmolLM2-135M-Instruct)",
)
@click.option("--algo", default="full", show_default=True)
@click.option("--budget", type=int, default=None, help="KV rows kept per head")
@click.option(
    "--max-kv-bytes",
    default=None,
    metavar="SIZE",
    help="instead of --budget: KV bytes held, e.g. 48MB (the budget follows)",
)
@click.option(
    "--algo-arg",
    "algo_args",
    multiple=True,
    metavar="KEY=VALUE",
    help="algorithm option, repeatable",
)
@click.option("--prompt", default=None, help="prompt text, UTF-8 (default: read stdin)")
@click.option("--max-tokens", type=Count(1), default=128, show_default=True)
@click.option(
    "--temp", type=Finite(0), default=0.0, show_default=True, help="0: greedy"
)
@click.option(
    "--chat/--no-chat",
    default=None,
    help="apply the chat template (default: when the model has one)",
)
@click.option(
    "--quantized/--dequantized",
    default=None,
    help="keep quantized weights (default: dequantize on the CPU)",
)
@click.option(
    "--cache",
    "cache_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="a context compressed by `veloxpatch compress`: the prompt is a question "
    "about it (the file gives the algorithm)",
)
@click.option(
    "--prefill-step",
    type=Count(1),
    default=2048,
    show_default=True,
    help="tokens per prefill call (mlx-lm's prefill_step_size)",
)
@user_errors
def generate(
    model,
    algo,
    budget,
    max_kv_bytes,
    algo_args,
    prompt,
    max_tokens,
    temp,
    chat,
    quantized,
    cache_path,
    prefill_step,
):
    """Patch the model with ALGO and stream a generation, then print stats
    (the peak is mlx's peak memory above what was in use before the prompt:
    the KV cache and the activations, not the weights)."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from .api import apply, make_options
    from .cli_text import read_prompt
    from .memory import full_kv_bytes, kv_bytes
    from .models import chat_prompt, load

    if cache_path is not None:
        given = {
            "--algo": algo != "full",
            "--budget": budget is not None,
            "--max-kv-bytes": max_kv_bytes is not None,
            "--algo-arg": bool(algo_args),
        }
        if any(given.values()):
            drop = ", ".join(flag for flag, on in given.items() if on)
            raise UserError(f"--cache gives the algorithm and its options; drop {drop}")
    options = algo_options(budget, algo_args)
    if max_kv_bytes is not None:
        if "max_kv_bytes" in options:
            raise UserError("max_kv_bytes given twice: --max-kv-bytes and --algo-arg")
        options["max_kv_bytes"] = max_kv_bytes
    make_options(algo, options)  # fail before the slow load
    prompt = read_prompt(prompt)
    m, tokenizer = load(model, quantized=quantized)
    if chat and getattr(tokenizer, "chat_template", None) is None:
        raise UserError("--chat: the model has no chat template (use --no-chat)")
    caches = None
    if cache_path is not None:  # a question about a compressed context
        from .cli_compress import load_context, question_ids

        caches, algo, options, tail = load_context(cache_path, m)
        prompt = question_ids(tokenizer, prompt, tail)
    else:
        prompt = chat_prompt(tokenizer, prompt, chat)
    with apply(m, algo=algo, tokenizer=tokenizer, **options) as patch:
        if isinstance(prompt, str):  # as stream_generate would encode it
            bos = getattr(tokenizer, "bos_token", None)
            special = bos is None or not prompt.startswith(bos)
            prompt = tokenizer.encode(prompt, add_special_tokens=special)
        patch.check_context(len(prompt))
        caches = caches if caches is not None else patch.make_cache()
        last = None
        mx.synchronize()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        for last in stream_generate(
            m,
            tokenizer,
            prompt,
            max_tokens=max_tokens,
            sampler=make_sampler(temp=temp),
            prompt_cache=caches,
            prefill_step_size=prefill_step,
        ):
            click.echo(last.text, nl=False)
        click.echo()
    if last is not None:
        bought = getattr(patch.options, "budget", None) if max_kv_bytes else None
        label = algo if bought is None else f"{algo}, budget {bought} rows"
        # kvzap's threshold: how much the text let it keep
        kept = [c.kept_fraction() for c in caches if hasattr(c, "kept_fraction")]
        ratio = f" | kept {sum(kept) / len(kept):.1%} of pairs" if kept else ""
        click.echo(
            f"[{label}] prompt {last.prompt_tokens} tok | generated "
            f"{last.generation_tokens} tok | prefill {last.prompt_tps:.1f} tok/s | "
            f"decode {last.generation_tps:.1f} tok/s | KV held {kv_bytes(caches):,} B"
            f" | full KV {full_kv_bytes(caches):,} B | peak "
            f"{max(0, mx.get_peak_memory() - before):,} B (chunk {prefill_step})"
            f"{ratio}",
            err=True,
        )


@main.command("list")
@click.option("--verbose", "-v", is_flag=True, help="also versions and BLAS")
def list_(verbose):
    """Algorithms and supported architectures."""
    from model_adapters import ADAPTERS

    from .api import ALGORITHMS

    click.echo("algorithms:")
    for name, cls in ALGORITHMS.items():
        # a name wider than the column puts its summary on the next line
        gap = " " if len(name) <= 14 else f"\n  {'':<14} "
        click.echo(f"  {name:<14}{gap}{cls.summary}")
        if verbose:
            defaults = ", ".join(f"{k}={v}" for k, v in cls.Options().as_dict().items())
            for line in textwrap.wrap(f"options: {defaults or '(none)'}", 62):
                click.echo(f"  {'':<14} {line}")
        if cls.note and (verbose or "note" in vars(cls)):
            for line in textwrap.wrap(cls.note, 62):
                click.echo(f"  {'':<14} {line}")
    click.echo("architectures (mlx-lm model types):")
    for adapter in ADAPTERS:
        click.echo(f"  {adapter.name:<14} {', '.join(adapter.model_types)}")
    if verbose:
        import mlx.core as mx
        import mlx_lm

        click.echo(
            f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, "
            f"device {mx.default_device()}"
        )
        click.echo(f"BLAS: {blas.active()}")


@main.command("adapter-check")
@click.argument("cls", metavar="MODULE.CLASS")
@user_errors
def adapter_check(cls):
    """Signature and source hash of an attention class's __call__, as an
    adapter pins them (same as `python -m model_adapters.check`)."""
    from model_adapters import check

    try:
        check.resolve(cls)  # bad input: the one-line error every command gives
    except LookupError as e:
        raise UserError(str(e)) from None
    sys.exit(check.main([cls]))


if __name__ == "__main__":
    main()
