"""The door to mlx-lm's internals: everything veloxpatch relies on beyond
mlx-lm's public API, in one list, pinned to the mlx-lm it was checked against.

Other modules reach past mlx-lm's public API only through here: the private
names they use are imported from this module, and the stack-frame reads, the
prompt-cache globals and the server's parser are done here. `INTERNALS` lists
each piece of mlx-lm whose *behaviour* veloxpatch relies on (its private names,
the classes and methods we subclass or override, the functions whose locals we
read or whose calls we count on), each pinned by the sha256 of its source and,
for a function, its signature. `check()` compares every pin with the installed
mlx-lm once per process (`veloxpatch.apply` calls it before touching the
model) and raises one `MlxLmChangedError` naming every entry that changed. The
attention classes the adapters wrap are pinned in `model_adapters/` the same
way and checked by `patcher.check_target`.

    python -m veloxpatch.mlx_lm_internals    # the installed pins; exit 1 if any differ

Public routes. Where mlx-lm 0.32.2 has one, veloxpatch takes it:
- Cache classes do not inherit mlx-lm's private `_BaseCache`: mlx-lm only
  duck-types caches (it never checks the base class, and our caches define
  every method it calls), and `caches/io.py` tells mlx-lm's cache classes by
  their module instead of by that base.
Where it has none, the entry below says why:
- `_run_http_server`: the public `mlx_lm.server.run` builds its own prompt
  cache and ResponseGenerator and drops `handler_class`.
- `ResponseGenerator._tokenize`: the only code that tokenizes a request as the
  generation thread will (to count its prompt before it is queued).
- `ResponseGenerator._await_response`, `_stop`, `_generation_thread`: the one
  place a request thread waits, and the public `stop_and_join` waits for the
  generation thread without a bound (serve/cuts.py cuts requests).
- `APIHandler._set_completion_headers`: our error answers need mlx-lm's
  headers (CORS included; `_set_cors_headers` is private too).
- `ModelProvider._load`: not called; our provider sets the attributes it sets.
- `_merge_caches`, `_extend_cache`: not called; `BatchGenerator` calls our
  batch caches' `merge` and `extend` through them.
- `_get_llama_4_attn_scale`: Ministral 3's query scale is computed nowhere
  else; re-deriving it would fork mlx-lm's formula.
- `mlx_lm.server.main`'s parser: mlx-lm builds it inside `main`, which parses
  at once (the server has no `setup_arg_parser`, unlike `mlx_lm.generate`).
- `load_prompt_cache` looks class names up in `mlx_lm.models.cache`'s globals:
  there is no registry, so `make_loadable` adds our classes there.
- The frame reads: `make_prompt_cache` does not pass `max_kv_size` on to
  `model.make_cache()`, and `generate_step` tells no cache about `kv_bits`
  before converting caches mid-answer (mlx_flags.py).
- The `state` read: nothing else marks the end of a prefill chunk (phase.py).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import inspect
import sys
from dataclasses import dataclass
from unittest import mock

import mlx_lm
from mlx_lm import server as _server
from mlx_lm.models import cache as _cache

from .errors import MlxLmChangedError

# the module (`from mlx_lm import generate` is the function the package exports)
_generate = importlib.import_module("mlx_lm.generate")

CHECKED_WITH = "0.32.2"  # the mlx-lm every pin below was read from
REQUIREMENT = "mlx-lm>=0.32.2,<0.33"  # pyproject.toml's


# ---- private names, for the modules that use them -------------------------------
# Looked up when called, so that importing veloxpatch survives an mlx-lm that
# lacks one: `apply` then names it (check) before anything calls it.
def run_http_server(*args, **kwargs):
    return _server._run_http_server(*args, **kwargs)


def llama_4_attn_scale(size, offset, beta, max_position_embeddings):
    from mlx_lm.models import ministral3

    return ministral3._get_llama_4_attn_scale(
        size, offset, beta, max_position_embeddings
    )


@dataclass(frozen=True)
class Internal:
    """One piece of mlx-lm whose behaviour veloxpatch relies on."""

    where: str  # "module:qualname"
    relied_on: str  # what veloxpatch relies on, and where
    source_sha256: str  # of inspect.getsource(it), in mlx-lm CHECKED_WITH
    # a function's parameters (`parameters_of`): the source hash covers the
    # rest, and a default's repr may differ by machine (generate_step's stream)
    signature: str | None = None
    local_names: tuple[str, ...] = ()  # locals veloxpatch reads from its frames

    @property
    def name(self) -> str:
        return self.where.replace(":", ".")

    def resolve(self):
        module, _, qualname = self.where.partition(":")
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
        return found

    def difference(self) -> str | None:
        """What differs in the installed mlx-lm, or None."""
        try:
            found = self.resolve()
        except (ImportError, AttributeError):
            return "not found"
        found = inspect.unwrap(found)
        changed = []
        if self.signature is not None:
            try:
                signature = parameters_of(found)
            except (TypeError, ValueError):  # no longer a function
                signature = repr(found)
            if signature != self.signature:
                changed.append(f"signature is now {signature}, was {self.signature}")
        code = getattr(found, "__code__", None)
        for local in self.local_names:
            if code is None or local not in code.co_varnames:
                changed.append(f"has no local {local!r}")
        try:
            sha = source_sha256(found)
        except (OSError, TypeError):
            sha = None
        if sha != self.source_sha256:
            changed.append("source changed")
        return ", ".join(changed) or None


def parameters_of(fn) -> str:
    """`fn`'s signature without annotations and defaults: "(a, b, *, c)"."""
    empty = inspect.Parameter.empty
    sig = inspect.signature(fn)
    params = [
        p.replace(annotation=empty, default=empty) for p in sig.parameters.values()
    ]
    return str(sig.replace(parameters=params, return_annotation=empty))


def source_sha256(obj) -> str:
    """sha256 of the source of a function or class, as the pins hold it."""
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()


_SERVE = "veloxpatch serve"
INTERNALS = (
    # ---- mlx_lm.models.cache ----
    Internal(
        "mlx_lm.models.cache:make_prompt_cache",
        "returns model.make_cache() when the model has one, its max_kv_size "
        "a local (read from its frame: mlx_flags.py)",
        source_sha256=(
            "ae8ee8ce5ac69f2afa8e85c9cf32d75bdc10da6d07b3e3ad5b3bcc43bc4c64dd"
        ),
        signature="(model, max_kv_size)",
        local_names=("max_kv_size",),
    ),
    Internal(
        "mlx_lm.models.cache:load_prompt_cache",
        "looks class names up in its module's globals (make_loadable) and calls "
        "from_state(state) without the meta state (caches/base.py, caches/io.py)",
        source_sha256=(
            "1a64604fd5bd03f47f9ff17635dd4d493401c2001b86adbe7a5fb108fc9351b5"
        ),
        signature="(file_name, return_metadata)",
    ),
    Internal(
        "mlx_lm.models.cache:BatchKVCache",
        "`full` batches in it as is: merge, make_mask, update_and_fetch, "
        "offset, filter, extend, extract (caches/batch_full.py)",
        source_sha256=(
            "474e6fe46261a118b32425c0c295e98067197f867ede1759f6831fce4862f191"
        ),
    ),
    Internal(
        "mlx_lm.models.cache:LRUPromptCache.fetch_nearest_cache",
        f"{_SERVE} overrides it: a (cache, remaining tokens) pair, the cache a "
        "copy (serve/prompt_cache.py)",
        source_sha256=(
            "7ac872d0c10917962651c237aef175a80bf47d2c9b7549abd2cd79c7ca0c9e84"
        ),
        signature="(self, model, tokens)",
    ),
    Internal(
        "mlx_lm.models.cache:LRUPromptCache.insert_cache",
        f"{_SERVE} overrides it: every finished request's caches, with a "
        "cache_type; then adds an entry's kept logits to its `nbytes` and to "
        "`_n_bytes`/`_n_bytes_by_type`, found with `_trie.get` (serve/prompt_cache.py)",
        source_sha256=(
            "49c194f3fcf8831ef8f1f6e861e29307713dab6aa66295dce4f92d3643e744e9"
        ),
        signature="(self, model, tokens, prompt_cache, *, cache_type)",
    ),
    Internal(
        "mlx_lm.models.cache:LRUPromptCache.trim_to",
        f"{_SERVE} calls and overrides it: evicts by count or bytes "
        "(serve/prompt_cache.py)",
        source_sha256=(
            "cc498b9d8bc7e328cd20e325e835e4403e771fdb016482a73d61eac2d3883888"
        ),
        signature="(self, *, n_sequences, n_bytes)",
    ),
    Internal(
        "mlx_lm.models.cache:LRUPromptCache.__init__",
        f"{_SERVE} replaces its `_trie` (a PromptTrie) with its own "
        "(serve/prompt_cache.py)",
        source_sha256=(
            "dad40f4ef6ae45a0e42747c40545cc3b5d7cccf0e32c2af41a13249539d62679"
        ),
        signature="(self, max_size, max_bytes)",
    ),
    Internal(
        "mlx_lm.models.cache:PromptTrie.pop_prefixes",
        f"{_SERVE} overrides it: insert_cache drops the entries it returns, and "
        "an entry put back with `add` stays (serve/prompt_cache.py)",
        source_sha256=(
            "97a94c52e76815ebfcc3c9fae501d00732e898e20413993fc2bb5822f1944109"
        ),
        signature="(self, model, tokens)",
    ),
    Internal(
        "mlx_lm.models.cache:PromptTrie.search",
        f"{_SERVE} reads `shorter` (the longest entry a prefix of the tokens) "
        "and `model` of its result, then `get`s it (serve/prompt_cache.py)",
        source_sha256=(
            "1748a78c55ada724fb359b394a4337d7c1b5e3540c835cca9e113b0324cf642e"
        ),
        signature="(self, model, tokens)",
    ),
    # ---- mlx_lm.generate ----
    Internal(
        "mlx_lm.generate:generate_step",
        "kv_bits and prompt locals (read from its frame: mlx_flags.py; the "
        "prompt's length sets a share target's rows, auto.py); every cache's "
        "`state` evaluated after each prefill chunk and never while decoding "
        "(the prompt's end: caches/phase.py)",
        source_sha256=(
            "f5dd8df9242ffb752fc65160d08fde54ae5148813dd4332b4a7f35852f36bdb0"
        ),
        signature=(
            "(prompt, model, stream, *, max_tokens, sampler, logits_processors,"
            " max_kv_size, prompt_cache, prefill_step_size, kv_bits, "
            "kv_group_size, quantized_kv_start, prompt_progress_callback, "
            "input_embeddings)"
        ),
        local_names=("kv_bits", "prompt"),
    ),
    Internal(
        "mlx_lm.generate:speculative_generate_step",
        "kv_bits a local (read from its frame: mlx_flags.py); `state` evaluated "
        "after each prefill chunk (caches/phase.py); its `_step` makes every "
        "model call after the prefill (api.py)",
        source_sha256=(
            "84bed200ad064afddeaeb972f79469cce568f74ccc8813d8f5cda7c97ea1d0fd"
        ),
        signature=(
            "(prompt, model, draft_model, stream, *, num_draft_tokens, "
            "max_tokens, sampler, logits_processors, prompt_cache, "
            "prefill_step_size, kv_bits, kv_group_size, quantized_kv_start)"
        ),
        local_names=("kv_bits",),
    ),
    Internal(
        "mlx_lm.generate:_merge_caches",
        "builds a batch by calling the first sequence's merge per layer "
        "(caches/batch.py)",
        source_sha256=(
            "999fa426a0a52b9dbb89a83c88f742a6a0597727139ec1278aec6adc19b45e7c"
        ),
        signature="(caches)",
    ),
    Internal(
        "mlx_lm.generate:_extend_cache",
        "joins two batches with extend, layer by layer (caches/batch.py)",
        source_sha256=(
            "15c766408c4c3aa7853ed1630c8b89383058dd8acabb0801a04796350c02a75e"
        ),
        signature="(cache_a, cache_b)",
    ),
    Internal(
        "mlx_lm.generate:PromptProcessingBatch",
        "right-padded prefill between prepare and finalize, `state` evaluated "
        "after every chunk, filter and extract (caches/batch.py, phase.py)",
        source_sha256=(
            "4e0d4be705f4787f8817b7bcbaf1d45e65c0ed7fbe9ca162afd173083aa94b6f"
        ),
    ),
    Internal(
        "mlx_lm.generate:GenerationBatch",
        "decodes a batch: filter, extend and extract (caches/batch.py)",
        source_sha256=(
            "af6d7dee4ec6091ef209ff86a52e2c2d2c3dd79d5386ed9c00da13b2b4597698"
        ),
    ),
    # ---- mlx_lm.server ----
    Internal(
        "mlx_lm.server:main",
        "builds the server's parser and calls parse_args before anything else "
        "(server_parser: cli/serve.py)",
        source_sha256=(
            "747b1f39c7f17ad7832b7ee60dbaa978b9ea5ee2fb1a1389b43847ee7527348d"
        ),
        signature="()",
    ),
    Internal(
        "mlx_lm.server:_run_http_server",
        f"serves handler_class with our generator and calls its stop_and_join "
        f"on KeyboardInterrupt ({_SERVE}: serve/server.py)",
        source_sha256=(
            "a95fdf1d166a42df1f666179b237c0089a4300e6c566754c211c01d342ace8bd"
        ),
        signature="(host, port, response_generator, server_class, handler_class)",
    ),
    Internal(
        "mlx_lm.server:ModelProvider._load",
        "the attributes our providers set in its place: model_key, model, "
        "tokenizer, processor, draft_model, is_batchable (serve/server.py, "
        "scripts/bench_serve.py)",
        source_sha256=(
            "24ae8377c256c9e78eeb5210f19760180ce68b5e73a0ef6947f82e076aafeb82"
        ),
        signature="(self, model_path, adapter_path, draft_model_path)",
    ),
    Internal(
        "mlx_lm.server:ResponseGenerator.__init__",
        "starts the generation thread as _generation_thread, stopped by _stop "
        "(serve/cuts.py)",
        source_sha256=(
            "bc2b6580cacf1e00a7d452c9733175895db0211ff10d3dcd35595020a5020adb"
        ),
        signature="(self, model_provider, prompt_cache)",
    ),
    Internal(
        "mlx_lm.server:ResponseGenerator._tokenize",
        "a request's prompt tokens, as the generation thread makes them "
        "(tokenize_request: serve/server.py)",
        source_sha256=(
            "85879c0b95a42782578ef6149fe2598c122fb909d41b330d4cdab17ce968153e"
        ),
        signature="(self, tokenizer, request, args)",
    ),
    Internal(
        "mlx_lm.server:ResponseGenerator._await_response",
        "every item of a request's queue passes through it (overridden: serve/cuts.py)",
        source_sha256=(
            "1c7d2351b4c63dabf6adcb9f327a3f6b88b7bc4dcea8c2dc1432d44b9c5757f5"
        ),
        signature="(self, response_queue)",
    ),
    Internal(
        "mlx_lm.server:ResponseGenerator.generate",
        "waits through _await_response: the GenerationContext first, then "
        "progress tuples and Responses (serve/cuts.py)",
        source_sha256=(
            "b16df1fda857f4ed9b2c46c629173fc99a8c51f2424ab70be21fd57a7fc8052d"
        ),
        signature="(self, request, generation_args, progress_callback)",
    ),
    Internal(
        "mlx_lm.server:ResponseGenerator.stop_and_join",
        "sets _stop and joins _generation_thread (overridden with a bound: "
        "serve/cuts.py)",
        source_sha256=(
            "8f8ede512734ede0fb41160e0a2a6ee79d76a364f569fbff0e9cf1ee52203689"
        ),
        signature="(self)",
    ),
    Internal(
        "mlx_lm.server:ResponseGenerator._generate",
        "loads through our provider, reads is_batchable, fetches from and "
        "inserts into our prompt cache (serve/server.py, serve/prompt_cache.py)",
        source_sha256=(
            "3a4259353eae53417f6cc455c0c1263639b514cb2b62e21be6cb4e72cb49cd55"
        ),
        signature="(self)",
    ),
    Internal(
        "mlx_lm.server:ResponseGenerator._serve_single",
        "unbatched requests: stream_generate on our caches, inserted into our "
        "prompt cache (serve/prompt_cache.py); request[0] is the queue it puts the "
        "context on, then sets ctx.prompt_cache_count from its fetch, then "
        "puts more (serve/server.py ReadForTheRequest)",
        source_sha256=(
            "90f0dd09755378d410204824d6fa28b7073c8ba005d5087e8e7617a0979f0006"
        ),
        signature="(self, request, stream)",
    ),
    Internal(
        "mlx_lm.server:APIHandler.do_POST",
        "sets the request's fields as attributes, calls "
        "validate_model_parameters (a ValueError answers 400), then "
        "handle_completion (serve/server.py)",
        source_sha256=(
            "8bd4d3050d331a62a3307b3948eb15b1f2a05133e910f9cc5cce253651b5f712"
        ),
        signature="(self)",
    ),
    Internal(
        "mlx_lm.server:APIHandler.validate_model_parameters",
        "reads xtc_* as floats and stream_options['include_usage'] (our "
        "override makes them so: serve/server.py)",
        source_sha256=(
            "34cd1bb464f6f2e5059bf017d412d461c168573662990ce55088a95212111896"
        ),
        signature="(self)",
    ),
    Internal(
        "mlx_lm.server:APIHandler.handle_completion",
        "loads through the provider, generates through the generator, and "
        "stops the generation (ctx.stop()) on the way out (serve/server.py)",
        source_sha256=(
            "90c9f5f662e952e53bddf4ea62d016b775f98181153e2e19f3285defe83abe8d"
        ),
        signature="(self, request, stop_words)",
    ),
    Internal(
        "mlx_lm.server:APIHandler._set_completion_headers",
        "status and JSON headers of our error answers (serve/server.py)",
        source_sha256=(
            "d39ccb09df0f06166cb94b7e0c9661d63da347f59e7cf81422843b203591386f"
        ),
        signature="(self, status_code)",
    ),
    Internal(
        "mlx_lm.server:APIHandler.generate_response",
        "builds every answer (model from requested_model; logprobs from the "
        "tokens, token_logprobs and top_tokens keywords); ours names the served "
        "model and rebuilds logprobs, the chosen token first and sorted "
        "alternatives (serve/server.py)",
        source_sha256=(
            "81c7a8831076b3003ee668904cfe86074d40eb4a84b9e921bac31135f5edeed1"
        ),
        signature="(self, text, finish_reason, prompt_token_count, "
        "completion_token_count, prompt_cache_count, token_logprobs, top_tokens, "
        "tokens, tool_calls, reasoning_text)",
    ),
    Internal(
        "mlx_lm.server:APIHandler.completion_usage_response",
        "a stream's usage event, its model from requested_model (ours names the "
        "served model: serve/server.py)",
        source_sha256=(
            "177eb813b4f5e86584dc9ad4cacd4a28d8ade969ea5edb84972bb30ae3b1b2a4"
        ),
        signature="(self, prompt_token_count, completion_token_count, "
        "prompt_cache_count)",
    ),
    Internal(
        "mlx_lm.server:_format_top_logprobs",
        "a token's top alternatives as {id, token, logprob}, unsorted "
        "(argpartition); ours sorts them (serve/server.py)",
        source_sha256=(
            "a0da67772d363f96694f6020893def4a4e4528043f81dcb95436624eb7b205c5"
        ),
        signature="(logprobs, top_n, tokenizer)",
    ),
    Internal(
        "mlx_lm.server:APIHandler.do_GET",
        "/v1/models goes to handle_models_request (ours lists the one model "
        "served) and /health to handle_health_check (ours reads the response "
        "generator's `is_healthy` as it does; both add the algorithm, the cap "
        "and the bytes held: serve/server.py)",
        source_sha256=(
            "6112bfedf9583cb612850f5eb531cd294195c2bd2066f787fe060c63b8f76e69"
        ),
        signature="(self)",
    ),
    # ---- mlx_lm.models.ministral3 ----
    Internal(
        "mlx_lm.models.ministral3:_get_llama_4_attn_scale",
        "Ministral 3's query scale when the caller passes none "
        "(model_adapters/mistral.py)",
        source_sha256=(
            "244f8bdeeba04e805e3f2dfb7438f50bf8367da785b5a379b433bfc3ade8ca88"
        ),
        signature="(size, offset, beta, max_position_embeddings)",
    ),
)


@functools.cache
def changes() -> tuple[str, ...]:
    """What differs from the pins, one line per entry (computed once)."""
    return tuple(f"{i.name} ({why})" for i in INTERNALS if (why := i.difference()))


def check() -> None:
    """Raise MlxLmChangedError naming every internal that changed; cheap after
    the first call in a process."""
    found = changes()
    if found:
        raise MlxLmChangedError(
            f"mlx-lm {mlx_lm.__version__} differs from {CHECKED_WITH}, the "
            f"version veloxpatch was checked against, in what veloxpatch relies "
            f"on: {'; '.join(found)}. Install {REQUIREMENT!r}, or re-check those "
            "against the new source and update their pins in "
            "veloxpatch/mlx_lm_internals.py"
        )


# ---- stack-frame reads (mlx_flags.py) -------------------------------------------
def _step_codes() -> set:
    # looked up on each call: a test may swap them
    steps = (_generate.generate_step, _generate.speculative_generate_step)
    return {f.__code__ for f in steps}


def prompt_cache_request(frame) -> tuple[int | None, int | None] | None:
    """(max_kv_size, kv_bits) when `frame` runs mlx-lm's make_prompt_cache:
    its max_kv_size, and the kv_bits of its caller if that is a generate step;
    None for any other frame."""
    if frame.f_code is not _cache.make_prompt_cache.__code__:
        return None
    caller = frame.f_back
    kv_bits = None
    if caller is not None and caller.f_code in _step_codes():
        kv_bits = caller.f_locals.get("kv_bits")
    return frame.f_locals.get("max_kv_size"), kv_bits


def prompt_cache_prompt(frame) -> int | None:
    """The prompt's length when `frame` runs mlx-lm's make_prompt_cache for
    generate_step (its `prompt` local), else None."""
    if frame.f_code is not _cache.make_prompt_cache.__code__:
        return None
    caller = frame.f_back
    if caller is None or caller.f_code is not _generate.generate_step.__code__:
        return None
    prompt = caller.f_locals.get("prompt")
    return len(prompt) if prompt is not None and len(prompt) else None


@functools.lru_cache(maxsize=4)
def _nested_code(outer, name: str):
    """The code of the function `name` defined inside the code `outer` (once
    per code object: this runs on every model call), or None."""
    return next(
        (c for c in outer.co_consts if getattr(c, "co_name", None) == name), None
    )


def in_speculative_step(frame, limit: int) -> bool:
    """Whether `frame` (within `limit` frames up) runs the `_step` of mlx-lm's
    speculative_generate_step: its model calls are generated tokens, the
    target's verify call led by the prompt's last token (caches/phase.py)."""
    code = _nested_code(_generate.speculative_generate_step.__code__, "_step")
    for _ in range(limit):
        if frame is None or code is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def step_kv_bits(frame, limit: int):
    """kv_bits of the nearest mlx-lm generate step at or above `frame`
    (within `limit` frames), or None."""
    codes = _step_codes()
    for _ in range(limit):
        if frame is None:
            return None
        if frame.f_code in codes:
            return frame.f_locals.get("kv_bits")
        frame = frame.f_back
    return None


# ---- the prompt-cache module's globals (caches/io.py) -----------------------------
def make_loadable(cls: type) -> None:
    """Let load_prompt_cache rebuild `cls` by its name: it looks names up in
    mlx_lm.models.cache's globals. Adds a name, never replaces one."""
    if getattr(_cache, cls.__name__, cls) is cls:
        setattr(_cache, cls.__name__, cls)


# ---- the server ------------------------------------------------------------------
class _Captured(Exception):
    pass


def server_parser() -> argparse.ArgumentParser:
    """mlx-lm's server parser, as `mlx_lm.server.main` builds it: main builds
    and parses at once, so it is stopped at parse_args (checked first: a main
    that no longer parses first would start a server)."""
    check()

    def capture(parser, *args, **kwargs):
        raise _Captured(parser)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            _server.main()
        except _Captured as e:
            return e.args[0]
    raise MlxLmChangedError("mlx_lm.server.main no longer parses its arguments")


def tokenize_request(generator, tokenizer, request, args):
    """The generation thread's tokenization of `request`: (prompt, ...)."""
    return generator._tokenize(tokenizer, request, args)


def main() -> int:
    """Print each internal's pins as the installed mlx-lm has them, and which
    differ from INTERNALS; exit 1 if any do."""
    print(f"mlx-lm {mlx_lm.__version__} (pins read from {CHECKED_WITH})")
    stale = 0
    for entry in INTERNALS:
        why = entry.difference()
        stale += why is not None
        print(f"{entry.name}: {'matches' if why is None else why}")
        if why is not None and why != "not found":
            found = inspect.unwrap(entry.resolve())
            print(f'    source_sha256="{source_sha256(found)}"')
            if entry.signature is not None:
                print(f"    signature={parameters_of(found)!r}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
