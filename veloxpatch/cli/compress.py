"""`veloxpatch compress`: a context compressed once, with no question, into a
file that `veloxpatch generate --cache FILE` asks questions of (as mlx-lm's
cache_prompt, for compressed caches)."""

from __future__ import annotations

import json
import time

import click

from .checks import (
    NonEmpty,
    OutputFile,
    UserError,
    algo_options,
    check_before_load,
    choose_auto,
    refuse_existing,
    user_errors,
)

MARK = "\x00veloxpatch-question\x00"


def split_turn(tokenizer, text: str, chat: bool | None):
    """(the context's text with the chat template's head, the tail that follows
    a question: the turn change to the assistant). No template: ("text", "")."""
    from ..loading.models import chat_prompt

    wrapped = chat_prompt(tokenizer, text + MARK, chat)
    head, tail = wrapped.split(MARK)
    return head, tail


@click.command()
@click.option(
    "--model", type=NonEmpty(), default=None, help="default: the embedded SmolLM2"
)
@click.option(
    "--context",
    "context_path",
    type=click.Path(exists=True, dir_okay=False, readable=True),
    required=True,
    help="the context, a UTF-8 text file",
)
@click.option(
    "--algo",
    default=None,
    help="default: auto with --max-kv-bytes (the best measured choice), else kvzip",
)
@click.option("--budget", type=int, default=None, help="KV rows kept per head")
@click.option(
    "--max-kv-bytes",
    default=None,
    metavar="SIZE",
    help="KV bytes held once compressed, e.g. 15MB, or a share of the context's "
    "full KV, e.g. 20%",
)
@click.option(
    "--max-peak-bytes",
    default=None,
    metavar="SIZE",
    help="auto only: pick only configurations whose peak reading the context fits",
)
@click.option("--algo-arg", "algo_args", multiple=True, metavar="KEY=VALUE")
@click.option("--out", type=OutputFile(".safetensors"), required=True)
@click.option("--force", is_flag=True, help="overwrite --out if it exists")
@click.option("--chat/--no-chat", default=None, help="default: when the model has one")
@user_errors
def compress(
    model,
    context_path,
    algo,
    budget,
    max_kv_bytes,
    max_peak_bytes,
    algo_args,
    out,
    force,
    chat,
):
    """Prefill and compress a context with no question; save its cache to OUT."""
    from model_adapters.base import fingerprint

    from ..api import apply
    from ..caches.io import save_cache
    from ..caches.options import absolute_paths, files_of
    from ..loading.models import load
    from ..memory import full_kv_bytes, kv_bytes
    from ..pricing import share_in_bytes

    algo = algo or ("auto" if max_kv_bytes is not None else "kvzip")
    options = algo_options(budget, algo_args, max_kv_bytes)
    check_before_load(algo, options, max_peak_bytes)
    refuse_existing(force, out=out)
    text = read_utf8(context_path)
    m, tokenizer = load(model)
    head, tail = split_turn(tokenizer, text, chat)
    plain = tail == ""
    ids = tokenizer.encode(head, add_special_tokens=plain)
    choice = None
    if algo == "auto":  # chosen for this context: its length is known
        choice = choose_auto(m, options, max_peak_bytes, "compress", len(ids))
        algo, options = choice.algo, choice.options
    options = share_in_bytes(m, algo, options, len(ids))  # a named algorithm's
    start = time.perf_counter()
    with apply(m, algo=algo, **options) as patch:
        patch.auto = choice
        caches = patch.prefill(ids, tokenizer=tokenizer)
        seconds = time.perf_counter() - start
        meta = {
            "algo": algo,
            # with the files found in the calibration cache: the same ones load
            "options": json.dumps(absolute_paths(options | files_of(patch.options))),
            "tail": tail,
            "fingerprint": json.dumps(fingerprint(m), sort_keys=True),
            "context_tokens": str(len(ids)),
        }
        if choice is not None:  # what auto chose, and why
            meta["auto"] = json.dumps(choice.record() | {"line": choice.line()})
        save_cache(out, caches, meta)
        files = "".join(f" | {k} {v}" for k, v in files_of(patch.options).items())
    click.echo(
        f"wrote {out}: {len(ids)} context tokens compressed by {algo} in "
        f"{seconds:.1f} s | KV held {kv_bytes(caches):,} B | full KV "
        f"{full_kv_bytes(caches):,} B{files}"
    )


def read_utf8(path) -> str:
    from .text import decode_utf8

    with open(path, "rb") as f:
        text = decode_utf8(f.read(), f"--context {path}")
    if not text.strip():
        raise UserError(f"--context {path} is empty")
    return text


def question_ids(tokenizer, question: str, tail: str) -> list[int]:
    """A question asked of a compressed context: it continues the user turn."""
    return tokenizer.encode(
        f"\n\n{question.strip()}{tail or chr(10)}", add_special_tokens=False
    )


def load_context(path, model):
    """(caches, algo, options, the turn tail) of a `compress` file, checked
    against `model`."""
    from model_adapters.base import fingerprint

    from ..caches.io import load_cache

    caches, meta = load_cache(path, return_metadata=True)
    needed = ("algo", "options", "tail", "fingerprint")
    if not all(isinstance(meta.get(k), str) for k in needed):
        raise UserError(f"{path} was not written by veloxpatch compress")
    if json.loads(meta["fingerprint"]) != fingerprint(model):
        raise UserError(f"{path} was compressed for another model")
    return caches, meta["algo"], json.loads(meta["options"]), meta["tail"]
