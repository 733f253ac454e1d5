"""`veloxpatch generate`: patch a model with an algorithm and stream a
generation, then print what the KV cache held."""

from __future__ import annotations

import click

from .checks import (
    Count,
    Finite,
    NonEmpty,
    UserError,
    algo_options,
    check_before_load,
    choose_auto,
    user_errors,
)


@click.command()
@click.option(
    "--model",
    type=NonEmpty(),
    default=None,
    help="GGUF file, mlx-lm model dir or hub id "
    "(default: the embedded SmolLM2-135M-Instruct)",
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
    help="instead of --budget: KV bytes held once the prompt is read, e.g. 48MB, "
    "or a share of the prompt's full KV, e.g. 20% (the budget follows)",
)
@click.option(
    "--max-peak-bytes",
    default=None,
    metavar="SIZE",
    help="auto only: pick only configurations whose peak reading the prompt fits",
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
    max_peak_bytes,
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

    from ..api import apply
    from ..caches.options import files_of
    from ..loading.models import chat_prompt, load
    from ..memory import full_kv_bytes, kv_bytes
    from ..pricing import share_in_bytes
    from .text import read_prompt

    if cache_path is not None:
        given = {
            "--algo": algo is not None,
            "--budget": budget is not None,
            "--max-kv-bytes": max_kv_bytes is not None,
            "--algo-arg": bool(algo_args),
        }
        if any(given.values()):
            drop = ", ".join(flag for flag, on in given.items() if on)
            raise UserError(f"--cache gives the algorithm and its options; drop {drop}")
    algo = algo or ("auto" if max_kv_bytes is not None and not cache_path else "full")
    options = algo_options(budget, algo_args, max_kv_bytes)
    check_before_load(algo, options, max_peak_bytes)
    prompt = read_prompt(prompt)
    m, tokenizer = load(model, quantized=quantized)
    if chat and getattr(tokenizer, "chat_template", None) is None:
        raise UserError("--chat: the model has no chat template (use --no-chat)")
    caches = None
    if cache_path is not None:  # a question about a compressed context
        from .compress import load_context, question_ids

        caches, algo, options, tail = load_context(cache_path, m)
        prompt = question_ids(tokenizer, prompt, tail)
    else:
        prompt = chat_prompt(tokenizer, prompt, chat)
    if isinstance(prompt, str):  # as stream_generate would encode it
        bos = getattr(tokenizer, "bos_token", None)
        special = bos is None or not prompt.startswith(bos)
        prompt = tokenizer.encode(prompt, add_special_tokens=special)
    choice = None
    if algo == "auto":  # chosen for this prompt: its length is known
        choice = choose_auto(m, options, max_peak_bytes, "generate", len(prompt))
        algo, options = choice.algo, choice.options
    options = share_in_bytes(m, algo, options, len(prompt))  # a named algorithm's
    with apply(m, algo=algo, tokenizer=tokenizer, **options) as patch:
        patch.auto = choice
        caches = caches or patch.make_cache(n_tokens=len(prompt))
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
        algo = algo if choice is None else f"auto: {algo}"
        label = algo if bought is None else f"{algo}, budget {bought} rows"
        # kvzap's threshold: how much the text let it keep
        kept = [c.kept_fraction() for c in caches if hasattr(c, "kept_fraction")]
        ratio = f" | kept {sum(kept) / len(kept):.1%} of pairs" if kept else ""
        # the calibration files read, those found in the calibration cache too
        files = "".join(f" | {k} {v}" for k, v in files_of(patch.options).items())
        click.echo(
            f"[{label}] prompt {last.prompt_tokens} tok | generated "
            f"{last.generation_tokens} tok | prefill {last.prompt_tps:.1f} tok/s | "
            f"decode {last.generation_tps:.1f} tok/s | KV held {kv_bytes(caches):,} B"
            f" | full KV {full_kv_bytes(caches):,} B | peak "
            f"{max(0, mx.get_peak_memory() - before):,} B (chunk {prefill_step})"
            f"{ratio}{files}",
            err=True,
        )
