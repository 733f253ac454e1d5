"""mlx-lm's server on one patched model (see the package doc).

- `PatchedModelProvider` loads the one model, patches it, and says whether its
  caches can batch; mlx-lm's provider would load any model a request names,
  unpatched, so every other name is refused here.
- `Generator` (mlx-lm's generation thread) keeps a system prompt's
  prompt-cache entry for requests served one at a time too (`prompt_cache`).
- `Handler` (mlx-lm's APIHandler) refuses other models, adapters and draft
  models, checks every field and the prompt's length (`checks`), reserves each
  request's KV bytes before queueing it (`admission`), and stops a request
  whose client left or that a SIGTERM/SIGINT cuts (`cuts`).
"""

from __future__ import annotations

import copy
import http.client
import io
import json
import logging
import os
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from queue import Queue
from types import SimpleNamespace

from mlx_lm.server import APIHandler, GenerationContext, ModelProvider

from ..api import apply
from ..caches import VeloxCache
from ..errors import OptionError
from ..loading.models import embedded_model_path, load
from ..mlx_lm_internals import run_http_server, tokenize_request
from .admission import Budgets, KVEstimate, KVLedger, Refused
from .checks import BadRequest, check_body, check_length, model_limits
from .cuts import CLIENT_GONE, Cut, CuttableGenerator, client_gone, stop_on_signals
from .disk import DiskEntries, server_identity
from .prompt_cache import BoundedPromptCache
from .replay import ReplayingModel

log = logging.getLogger("veloxpatch.serve")


def batch_refusal(caches) -> str:
    """Why mlx-lm's BatchGenerator cannot take these caches ("": it can), by
    veloxpatch's `batchable` and, for mlx-lm's own, mlx-lm's rule (`merge`)."""
    for c in caches:
        if isinstance(c, VeloxCache) and not type(c).batchable:
            return f"{type(c).__name__} cannot batch: {type(c).batch_refusal}"
        if c is not None and not hasattr(c, "merge"):
            return f"mlx-lm's {type(c).__name__} cannot batch"
    return ""


class PatchedModelProvider(ModelProvider):
    """Loads the one model this server serves and patches it."""

    def __init__(self, cli_args, model, algo, options, quantized=None):
        super().__init__(cli_args)
        self.source = model  # None: the embedded SmolLM2
        self.algo, self.options, self.quantized = algo, dict(options), quantized
        self.patch = None

    def names(self) -> set[str]:
        """The model names a request may give: mlx-lm's default, the path as
        given, its absolute form, and its file or folder name."""
        path = Path(self.source) if self.source else embedded_model_path()
        names = {"default_model", str(path), path.name, path.stem}
        if path.exists():
            names.add(str(path.resolve()))
        if self.source:
            names.add(os.fspath(self.source))
        return names

    def served_name(self) -> str:
        return str(self.source) if self.source else embedded_model_path().stem

    def load_default(self):
        self.load("default_model")

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if model_path not in self.names():
            raise Refused(404, unknown_model(model_path, self))
        if adapter_path is not None or draft_model_path not in (None, "default_model"):
            raise Refused(400, "adapters and draft models are not supported")
        if self.model is None:
            self._load_patched()
        return self.model, self.tokenizer

    def _load_patched(self):
        model, tokenizer = load(self.source, quantized=self.quantized)
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        auto = self.algo == "auto"  # chosen once, for the serve path's protocols
        path = {"auto_path": "serve"} if auto else {}
        self.patch = apply(
            model, self.algo, tokenizer=tokenizer, **path, **self.options
        )
        if auto:  # from here on the server is what auto chose, by name and options
            self.algo, self.options = self.patch.algo, dict(self.patch.requested)
        self.patch.keep_snapshots = True  # the prompt cache's policy (prompt_cache.py)
        why = batch_refusal(self.patch.make_cache(options=self.patch.options))
        self.model_key = (self.served_name(), None, None)
        # as mlx-lm calls it: the same prompt again replays its logits (replay.py)
        self.model, self.tokenizer = ReplayingModel(model), tokenizer
        self.processor, self.draft_model = None, None
        self.is_batchable = not why
        if why:
            log.warning("serving requests one at a time: %s", why)
        else:
            log.info("%s caches batch: requests are served together", self.algo)


def unknown_model(name, provider) -> str:
    return (
        f"model {name!r} is not served here: this server serves "
        f"{provider.served_name()!r} patched with {provider.algo} (omit 'model' "
        "or name that one); start another veloxpatch serve for other models"
    )


BACKLOG = 1024  # listen queue: the kernel caps it (Linux: net.core.somaxconn)
MAX_BODY_BYTES = 64 << 20  # far past any context's text; mlx-lm reads it whole


class HTTPServer(ThreadingHTTPServer):
    """mlx-lm's server class (a thread per connection) with a listen backlog
    for bursts: socketserver's default of 5 resets (macOS) or stalls (Linux)
    the connections past it."""

    request_queue_size = BACKLOG
    daemon_threads = True


class Handler(APIHandler):
    """mlx-lm's request handler, with `state` (a ServeState) set on a subclass.
    `timeout` (seconds, set with `state`) bounds each read of the request
    line and headers, and the whole body."""

    state = None
    timeout = 30.0

    def _send_error(self, status: int, message: str) -> None:
        self._set_completion_headers(status)
        if status == 503:
            self.send_header("Retry-After", "1")
        self.end_headers()
        self.wfile.write(json.dumps({"error": message}).encode())

    def parse_request(self):
        # the headers are read here: a client that stops sending them gets a
        # 408 (BaseHTTPRequestHandler would close without a word)
        try:
            return super().parse_request()
        except TimeoutError:
            self.close_connection = True
            self.headers = http.client.HTTPMessage()  # mlx-lm's CORS reads them
            log.warning("refused (408): the request headers stopped arriving")
            self._send_error(
                408, f"the request headers did not arrive within {self.timeout:g} s"
            )
            return False

    def do_POST(self):
        # mlx-lm reads -1 as "until the client closes" and decodes the body
        # outside its error handling: both left the client with no answer
        length = self.headers.get("Content-Length")
        if length is not None and length.strip().lstrip("-").isdigit():
            length = int(length)
            if length < 0:
                self._send_error(400, "Content-Length must not be negative")
                return
            if length > MAX_BODY_BYTES:
                self.close_connection = True
                self._send_error(
                    413,
                    f"the request body ({length:,} bytes) is larger than "
                    f"{MAX_BODY_BYTES:,} bytes",
                )
                return
            # read here, within the timeout: mlx-lm's read waits for as long
            # as a client that declared more than it sends keeps the socket
            body = self._read_body(length)
            if body is None:
                return
            sock_file, self.rfile = self.rfile, io.BytesIO(body)
        else:
            sock_file = None  # mlx-lm answers 411 or 400 without reading
        try:
            super().do_POST()
        except UnicodeDecodeError:
            self._headers_buffer = []
            self._send_error(400, "the request body is not UTF-8 text")
        finally:
            if sock_file is not None:
                self.rfile = sock_file

    def _read_body(self, length: int) -> bytes | None:
        """The body's `length` bytes read within `timeout` seconds in all, or
        None once a 408 is sent. A client that closes early gives a short body
        (mlx-lm then answers 400: the JSON is cut)."""
        deadline = time.monotonic() + self.timeout
        chunks, got = [], 0
        try:
            while got < length:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.connection.settimeout(left)
                chunk = self.rfile.read1(min(length - got, 1 << 16))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
        except TimeoutError:
            self.close_connection = True
            message = (
                f"the request body did not arrive: {got:,} of the {length:,} "
                f"bytes its Content-Length declares in {self.timeout:g} s"
            )
            log.warning("refused (408): %s", message)
            self._send_error(408, message)
            return None
        finally:
            self.connection.settimeout(self.timeout)
        return b"".join(chunks)

    def validate_model_parameters(self):
        # do_POST calls this for both endpoints with the parsed body, and
        # answers a ValueError (BadRequest is one) with 400 {"error": ...}
        try:
            check_body(self.body, self.path, self.state.limits)
        except BadRequest as e:
            log.warning("refused (400): %s", e)
            raise
        # mlx-lm wants floats here and reads include_usage without a default
        self.xtc_probability = float(self.xtc_probability)
        self.xtc_threshold = float(self.xtc_threshold)
        if self.stream_options is not None:
            usage = self.stream_options.get("include_usage", False)
            self.stream_options = {"include_usage": usage}
        super().validate_model_parameters()

    def end_headers(self):
        super().end_headers()
        self.headers_sent = True  # after this a cut can only end the stream

    def handle_completion(self, request, stop_words):
        state = self.state
        provider = state.provider
        try:
            provider.load(
                self.requested_model, self.adapter, self.requested_draft_model
            )
            prompt_tokens = self._prompt_tokens(request)
            check_length(prompt_tokens, self.max_tokens, state.limits)
            # "veloxpatch": its own budget; else the server's, for this prompt
            budget = state.budgets.of(self.body, prompt_tokens)
            estimate = (
                state.budgets.server_estimate(prompt_tokens, state.estimate)
                if budget is None
                else budget.estimate
            )
            need = estimate.request_bytes(prompt_tokens, self.max_tokens)
            state.ledger.admit(need)
        except Refused as e:
            log.warning("refused (%d): %s", e.status, e)
            self._send_error(e.status, str(e))
            return
        except BadRequest as e:
            log.warning("refused (400): %s", e)
            self._send_error(400, str(e))
            return
        except Exception as e:  # a prompt the template cannot take, say
            self._send_error(400, f"cannot read the request: {e}")
            return
        fields = {"kv_budget": budget} if budget is not None else {}
        if state.prompt_cache.holds_prompt(self._prompt_ids):
            fields["replay"] = True
        if fields:  # its args carry them to the generation thread
            self.response_generator = WithArgs(self.response_generator, **fields)
        log.info(
            "request: %d prompt tokens, max_tokens %d%s: reserves %s KV bytes "
            "(a full cache: %s); %d in flight hold %s, prompt cache %s, cap %s",
            prompt_tokens,
            self.max_tokens,
            f", {budget.note()}" if budget else state.budgets.share_note(estimate),
            f"{need:,}",
            f"{state.estimate.full_bytes(prompt_tokens, self.max_tokens):,}",
            state.ledger.in_flight,
            f"{state.ledger.reserved:,}",
            f"{state.prompt_cache.nbytes:,}",
            "none" if state.ledger.cap is None else f"{state.ledger.cap:,}",
        )
        cut = None
        with state.generator.watching(lambda: client_gone(self.connection)) as w:
            try:
                super().handle_completion(request, stop_words)
            except Cut as e:
                cut = e
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                # a stream's write, to a client gone or not reading
                cut = Cut(CLIENT_GONE, w.tokens)
            except Exception as e:  # raised by the generation: answer, not hang up
                log.exception("request failed during generation")
                reason = f"generation failed ({type(e).__name__}: {e})"
                cut = Cut(reason, w.tokens, status=500)
            finally:
                state.ledger.release(need)
            if cut is not None:
                self._answer_cut(cut, need)

    def _answer_cut(self, cut: Cut, released: int) -> None:
        """mlx-lm's handler has stopped the generation (ctx.stop()) and the
        reservation is back; tell the client why, if it is still there."""
        log.warning(
            "request cut (%s) after %d generated tokens: generation stopped, "
            "%s reserved KV bytes released",
            cut.reason,
            cut.tokens,
            f"{released:,}",
        )
        self.close_connection = True
        if cut.reason == CLIENT_GONE:
            return
        message = f"{cut.reason}: request cut after {cut.tokens} generated tokens"
        status = cut.status
        try:
            if getattr(self, "headers_sent", False):  # a stream: an error event
                error = {"message": message, "type": "server_error", "code": status}
                self.wfile.write(f"data: {json.dumps({'error': error})}\n\n".encode())
                self.wfile.flush()
            else:  # mlx-lm's 200 headers are still only buffered: drop them
                self._headers_buffer = []
                self._send_error(status, message)
        except OSError:
            pass

    def _prompt_tokens(self, request) -> int:
        """The prompt's length, tokenized as the generation thread will (on a
        copy: mlx-lm rewrites message contents in place)."""
        args = SimpleNamespace(chat_template_kwargs=self.chat_template_kwargs)
        with self.state.tokenizer_lock:
            prompt = tokenize_request(
                self.state.generator,
                self.state.provider.tokenizer,
                copy.deepcopy(request),
                args,
            )[0]
        # chat_template_kwargs can make the template return text or a dict,
        # which the generation thread would fail on outside its error handling
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            raise BadRequest("chat_template_kwargs: the chat template gave no tokens")
        self._prompt_ids = prompt
        return len(prompt)

    def generate_response(self, text, finish_reason, *args, **kwargs):
        response = super().generate_response(text, finish_reason, *args, **kwargs)
        response["model"] = self.state.provider.served_name()  # not "default_model"
        tokens = kwargs.get("tokens")
        if tokens and self.logprobs and kwargs.get("token_logprobs"):
            response["choices"][0]["logprobs"] = {
                "content": self._logprobs(
                    tokens, kwargs.get("token_logprobs"), kwargs.get("top_tokens")
                )
            }
        return response

    def _logprobs(self, tokens, token_logprobs, top_tokens) -> list[dict]:
        """OpenAI's logprobs content: each chosen token with its logprob and its
        alternatives by descending logprob. mlx-lm 0.32.2 reports the first of
        an unsorted top-k (argpartition) as the chosen token."""
        pieces = self.state.provider.tokenizer.convert_ids_to_tokens(list(tokens))
        content = []
        for k, (token, piece) in enumerate(zip(tokens, pieces)):
            entry = {"id": token, "token": piece, "logprob": token_logprobs[k]}
            if top_tokens:
                top = sorted(top_tokens[k], key=lambda t: (-t["logprob"], t["id"]))
                entry["top_logprobs"] = top
            content.append(entry)
        return content

    def completion_usage_response(self, *args, **kwargs):
        response = super().completion_usage_response(*args, **kwargs)
        response["model"] = self.state.provider.served_name()
        return response

    def kv_report(self) -> dict:
        """What this server compresses with and holds: the algorithm and its
        options, the cap, the reservations in flight and the prompt cache."""
        state = self.state
        cap = state.ledger.cap
        return {
            "algorithm": state.provider.algo,
            "options": str(state.provider.patch.options),
            "kv_cap_bytes": cap,
            "requests_in_flight": state.ledger.in_flight,
            "reserved_bytes": state.ledger.reserved,
            "prompt_cache_bytes": state.prompt_cache.nbytes,
            "prompt_cache_entries": len(state.prompt_cache),
        }

    def handle_health_check(self):
        healthy = self.response_generator.is_healthy
        self._set_completion_headers(200 if healthy else 503)
        self.end_headers()
        body = {"status": "ok" if healthy else "unavailable"}
        body["veloxpatch"] = self.kv_report()
        self.wfile.write(json.dumps(body).encode())
        self.wfile.flush()

    def handle_models_request(self):
        # mlx-lm lists every model in the Hugging Face cache; only one is served
        self._set_completion_headers(200)
        self.end_headers()
        entry = {
            "id": self.state.provider.served_name(),
            "object": "model",
            "created": self.created,
            "veloxpatch": self.kv_report(),
        }
        self.wfile.write(json.dumps({"object": "list", "data": [entry]}).encode())
        self.wfile.flush()


class WithArgs:
    """A request's view of the generator: its generation arguments carry
    `fields` to the generation thread (`kv_budget`: its own budget,
    `admission.RequestBudget`; `replay`: a prompt-cache entry holds its prompt)."""

    def __init__(self, generator, **fields):
        self.generator, self.fields = generator, fields

    def generate(self, request, args, *rest, **kwargs):
        for name, value in self.fields.items():
            setattr(args, name, value)
        return self.generator.generate(request, args, *rest, **kwargs)

    def __getattr__(self, name):
        return getattr(self.generator, name)


class ReplaysFirst(Queue):
    """The generation thread's queue. A request whose prompt an entry holds
    exactly (a retry, a regenerated answer) reads nothing: it goes before the
    requests that do, instead of waiting out their prefills."""

    def _get(self):
        for i, item in enumerate(self.queue):
            if getattr(item[2], "replay", False):
                del self.queue[i]
                return item
        return self.queue.popleft()


class Generator(CuttableGenerator):
    """mlx-lm's generation thread, its requests cuttable (`cuts`) and replays
    served first (`ReplaysFirst`), whose one-at-a-time requests keep their
    system prompt's prompt-cache entry as its batches do
    (`prompt_cache.BoundedPromptCache.keep_system`); with `compress_system`, that entry
    is the system prompt compressed on its own (question-agnostic, kvzip's
    reconstruction), once for every user of it."""

    compress_system = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.requests = ReplaysFirst()  # nothing is queued before the server starts

    def _is_batchable(self, args):
        # a request with its own budget is served alone: a batch would hold
        # caches of other options (and mlx-lm makes a batch's caches once)
        if getattr(args, "kv_budget", None) is not None:
            return False
        if self.compress_system:  # `_keep_system` runs one request at a time
            return False
        return super()._is_batchable(args)

    def _serve_single(self, request, stream):
        queue, body, args = request
        read = 0
        provider = self.model_provider
        budget = getattr(args, "kv_budget", None)
        if budget is not None:  # its caches and prompt-cache key are its own
            self.model_provider = copy.copy(provider)
            self.model_provider.model_key = budget.key
            self.prompt_cache.fresh[budget.key] = lambda tokens: (
                provider.patch.make_cache(options=budget.options)
            )
        try:
            try:
                read = self._keep_system(body, args)
            except OptionError as e:  # the request meets it again, and answers it
                log.warning(
                    "the system prompt's prompt-cache entry was not kept: %s", e
                )
            except Exception:  # the request goes on and reads its system prompt
                log.exception("the system prompt's prompt-cache entry was not kept")
            if read:
                queue = ReadForTheRequest(queue, read)
            super()._serve_single((queue, body, args), stream)
        finally:  # a request that failed before its fetch leaves nothing held
            if budget is not None:
                self.prompt_cache.fresh.pop(budget.key, None)
            self.model_provider = provider
            self.prompt_cache.drop_handed()

    def _keep_system(self, body, args) -> int:
        provider = self.model_provider
        # on a copy: mlx-lm rewrites message contents in place
        tokenized = tokenize_request(
            self, provider.tokenizer, copy.deepcopy(body), args
        )
        prompt, segments, kinds, _, vision = tokenized
        if vision is not None or len(kinds) < 2 or kinds[0] != "system":
            return 0
        compress = None
        if self.compress_system:
            patch, tokenizer = provider.patch, provider.tokenizer

            def compress(caches, ids):
                patch.cache_cls.finish_context(patch.model, caches, ids, tokenizer)
                patch.end_prompt(caches)

        return self.prompt_cache.keep_system(
            provider.model,
            provider.model_key,
            prompt,
            len(segments[0]),
            self.cli_args.prefill_step_size,
            compress,
        )


class ReadForTheRequest:
    """A request's queue, for a request whose system prompt `keep_system` read:
    mlx-lm counts what its fetch returned as cached prompt tokens (usage's
    cached_tokens); the `read` tokens were not. mlx-lm queues the context before
    it sets that count, and queues more (progress, tokens, the end) after."""

    def __init__(self, queue, read: int):
        self.queue, self.read, self.ctx = queue, read, None

    def put(self, item, *args, **kwargs):
        if self.ctx is not None and self.read:
            self.ctx.prompt_cache_count -= self.read
            self.read = 0
        if isinstance(item, GenerationContext):
            self.ctx = item
        self.queue.put(item, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.queue, name)


class ServeState(SimpleNamespace):
    """What every request thread shares: provider, generator, estimate, ledger."""


def run(
    cli_args,
    model,
    algo,
    options,
    *,
    kv_cap=None,
    kv_cap_note=None,
    quantized=None,
    compress_system=False,
    read_timeout=30.0,
    max_requests=None,
    prompt_cache_dir=None,
    prompt_cache_disk_bytes=None,
):
    """Load and patch the model (errors stop here, before serving), then serve
    until interrupted."""
    provider = PatchedModelProvider(cli_args, model, algo, options, quantized)
    provider.load_default()
    cap_bytes = cli_args.prompt_cache_bytes
    prompt_cache = BoundedPromptCache(
        cli_args.prompt_cache_size, cap_bytes if cap_bytes is not None else 1 << 63
    )
    state = ServeState(
        provider=provider,
        prompt_cache=prompt_cache,
        estimate=KVEstimate(provider.patch),
        ledger=KVLedger(kv_cap, prompt_cache, max_requests),
        tokenizer_lock=threading.Lock(),
        limits=model_limits(provider.model, provider.tokenizer),
        budgets=Budgets(provider.patch, provider.model_key, kv_cap),
    )
    if prompt_cache_dir is not None:
        identity = server_identity(provider)
        prompt_cache.disk = DiskEntries(
            prompt_cache_dir, prompt_cache_disk_bytes, identity
        )
        prompt_cache.disk_key = provider.model_key  # the entries of its options
    if provider.patch.rows_by_prompt():  # a share: each new prompt's own rows
        budgets, patch = state.budgets, provider.patch
        prompt_cache.fresh[provider.model_key] = lambda tokens: patch.make_cache(
            options=budgets.server_options(len(tokens))
        )
    state.generator = Generator(provider, prompt_cache)
    state.generator.compress_system = compress_system
    log.info(
        "serving %s patched with %s %s; KV cap %s",
        provider.served_name(),
        provider.algo,
        provider.patch.options,
        kv_cap_note or ("none" if kv_cap is None else f"{kv_cap:,} bytes"),
    )
    log.info(
        "connections: backlog %d, a thread each; requests in flight at most %s "
        "(then 503); reads time out after %g s (408)",
        BACKLOG,
        "unbounded" if max_requests is None else max_requests,
        read_timeout,
    )
    handler = type("Handler", (Handler,), {"state": state, "timeout": read_timeout})
    stop_on_signals()
    run_http_server(
        cli_args.host,
        cli_args.port,
        state.generator,
        server_class=HTTPServer,
        handler_class=handler,
    )
    # a signal stopped it: requests are answered. Exit without the interpreter's
    # teardown: a generation step still running would hold it (its thread is
    # not a daemon), and mlx's threads abort it ("terminate called ...", 134)
    if state.generator.busy():
        log.warning("generation still running a step: exiting without it")
    log.info("stopped")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
