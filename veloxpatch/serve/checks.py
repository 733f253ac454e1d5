"""Every field of a request body checked before mlx-lm reads it.

mlx-lm's server checks types and some ranges (`validate_model_parameters`),
but lets through values that crash or quietly mislead it: a `logit_bias` id
outside the vocabulary writes out of bounds (the process dies), NaN passes
every `<`/`>` test, a `top_k` or `xtc_threshold` out of range raises inside the
generation thread (which then never serves again), a string in `messages`
fails deep in its code, `n` is ignored, and a prompt longer than the model's
context runs for minutes. Each failure here is a `BadRequest` whose message
names the field; mlx-lm answers a ValueError from validation with 400
{"error": message} and keeps serving.
"""

from __future__ import annotations

import json
import math
import re
from typing import NamedTuple

from ..errors import OptionError
from ..pricing import parse_target

CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
INT32_MAX = 2**31 - 1  # mlx indexes with 32-bit ints: bounds the context sizes


class BadRequest(ValueError):
    """A request the server will not take (400); the message names the field."""


class Limits(NamedTuple):
    """What a request is checked against, read from the model once."""

    vocab: int | None  # width of the logits (the tokenizer's vocab may differ)
    context: int | None  # tokens of context the model was trained for
    tool_calling: bool = False  # the tokenizer parses tool calls (mlx-lm's test)


# OpenAI's bounds: past them a value only makes noise (temperature 1e308) or is
# ignored by mlx-lm without a word (a fifth stop string is honoured, but
# clients written for OpenAI never send one, so more is a mistake)
MAX_TEMPERATURE = 2
MAX_STOP = 4
MAX_LOGIT_BIAS = 100
MAX_REPETITION_PENALTY = 2  # mlx-lm divides (or multiplies) logits by it


def model_limits(model, tokenizer=None) -> Limits:
    return Limits(
        _output_rows(model),
        _model_arg(model, "max_position_embeddings"),
        bool(getattr(tokenizer, "has_tool_calling", False)),
    )


def _output_rows(model) -> int | None:
    # logit_bias indexes the logits, so their width is the bound: lm_head's
    # rows, or the tied embedding's (packed quantized weights keep rows whole)
    head = getattr(model, "lm_head", None)
    if head is not None and "weight" in head:
        return int(head.weight.shape[0])
    for name, module in model.named_modules():
        if name.endswith("embed_tokens") and "weight" in module:
            return int(module.weight.shape[0])
    return _model_arg(model, "vocab_size")


def _model_arg(model, key: str) -> int | None:
    args = getattr(model, "args", None)
    for source in (args, getattr(args, "text_config", None)):
        if isinstance(source, dict):
            value = source.get(key)
        else:
            value = getattr(source, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def shown(value) -> str:
    """A value as the client wrote it (JSON: NaN, Infinity, null), shortened."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(body, name, lo=None, hi=None, *, lo_open=False, integer=False, note=""):
    """`name`, if present, is a finite number (an integer if `integer`) in
    [lo, hi] (`lo` excluded if `lo_open`; None: unbounded)."""
    if name not in body:
        return
    value = body[name]
    kind = "an integer" if integer else "a finite number"
    ok = _is_int(value) if integer else _is_number(value) and math.isfinite(value)
    if ok:
        ok = (lo is None or value > lo or (value == lo and not lo_open)) and (
            hi is None or value <= hi
        )
    if not ok:
        if lo is not None and hi is not None:
            where = f" in {'(' if lo_open else '['}{lo}, {hi}]"
        elif lo is not None:
            where = f" {'>' if lo_open else '>='} {lo}"
        else:
            where = ""
        raise BadRequest(f"{name} must be {kind}{where}{note}, got {shown(value)}")


def _bool(body, name):
    if name in body and not isinstance(body[name], bool):
        raise BadRequest(f"{name} must be true or false, got {shown(body[name])}")


def _string(body, name, *, nullable=False):
    if name in body and not isinstance(body[name], str):
        if not (nullable and body[name] is None):
            raise BadRequest(f"{name} must be a string, got {shown(body[name])}")


def _object(body, name):
    if body.get(name) is not None and not isinstance(body[name], dict):
        raise BadRequest(f"{name} must be an object, got {shown(body[name])}")


def check_body(body: dict, path: str, limits: Limits) -> None:
    """Raise BadRequest at the first field the server cannot take."""
    _text(body, "the request")
    if path in CHAT_PATHS:
        _messages(body)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest(f"prompt must be a non-empty string, got {shown(prompt)}")
    _sampling(body, limits)
    _output(body, limits)
    _unserved(body, path, limits)
    _string(body, "model")
    for name in ("draft_model", "adapters"):
        _string(body, name, nullable=True)
    for name in ("chat_template_kwargs", "role_mapping"):
        _object(body, name)
    _veloxpatch(body)


FIELD = "veloxpatch"
KEYS = ("max_kv_bytes",)
SIZE_FIELD = f"{FIELD}.max_kv_bytes"


def _veloxpatch(body: dict) -> None:
    """`veloxpatch` (a request's own budget, `admission.py`), if present: an
    object of known keys, its size readable."""
    if body.get(FIELD) is None:
        return
    field = body[FIELD]
    if not isinstance(field, dict):
        raise BadRequest(
            f'{FIELD} must be an object like {{"max_kv_bytes": "8MB"}}, got '
            f"{shown(field)}"
        )
    unknown = sorted(set(field) - set(KEYS))
    if unknown:
        raise BadRequest(
            f"{FIELD}: unknown key(s) {', '.join(map(shown, unknown))}; known: "
            + ", ".join(KEYS)
        )
    if field.get("max_kv_bytes") is not None:
        try:
            parse_target(field["max_kv_bytes"], SIZE_FIELD)
        except OptionError as e:
            raise BadRequest(str(e)) from None


def _unserved(body, path: str, limits: Limits) -> None:
    """Fields mlx-lm would take and quietly ignore: refused, so that a client
    never reads an answer as honouring them."""
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise BadRequest(
            f'response_format: only {{"type": "text"}} is served (no JSON '
            f"mode or schema), got {shown(fmt)}"
        )
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise BadRequest(
                f"{name}: legacy function calling is not served; use tools"
            )
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise BadRequest(f"tools must be a list of objects, got {shown(tools)}")
    if tools and (path not in CHAT_PATHS or not limits.tool_calling):
        raise BadRequest(
            "tools: this model's tokenizer has no tool-call format, so the tools "
            "would be ignored"
            if path in CHAT_PATHS
            else "tools: only chat completions take tools"
        )
    choice = body.get("tool_choice")
    if choice not in (None, "auto") and not (choice == "none" and not tools):
        raise BadRequest(
            'tool_choice: only "auto" is served (the model chooses), got '
            + shown(choice)
        )
    if body.get("echo") not in (None, False):
        raise BadRequest(f"echo: the prompt is not echoed, got {shown(body['echo'])}")
    if body.get("best_of") not in (None, 1):
        raise BadRequest(f"best_of must be 1, got {shown(body['best_of'])}")
    if body.get("suffix") not in (None, ""):
        raise BadRequest(
            f"suffix: insertion is not served, got {shown(body['suffix'])}"
        )


def _text(value, where: str) -> None:
    """Every string in the body is Unicode text: JSON admits lone surrogates
    ("\\ud800"), which no tokenizer encodes (a stop word is encoded in the
    generation thread, where the error would stop every request)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRequest(
                f"{where} holds {shown(value[e.start : e.end])}, a lone surrogate, "
                "not text"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _text(key, where)
            _text(item, f"{where}: {shown(key)}")
    elif isinstance(value, list):
        for item in value:
            _text(item, where)


def _sampling(body, limits: Limits) -> None:
    _number(body, "temperature", 0, MAX_TEMPERATURE)
    _number(body, "top_p", 0, 1, lo_open=True)
    vocab = limits.vocab
    _number(
        body,
        "top_k",
        0,
        None if vocab is None else vocab - 1,
        integer=True,
        note=" (0: off)",
    )
    _number(body, "min_p", 0, 1)
    _number(
        body, "repetition_penalty", 0, MAX_REPETITION_PENALTY, note=" (0 or 1: off)"
    )
    for name in ("presence_penalty", "frequency_penalty"):
        _number(body, name, -2, 2)
    context = limits.context or INT32_MAX
    for name in ("repetition", "presence", "frequency"):
        _number(body, f"{name}_context_size", 0, context, integer=True)
    _number(body, "xtc_probability", 0, 1)
    _number(body, "xtc_threshold", 0, 0.5)  # mlx-lm's sampler raises above 0.5
    if body.get("seed") is not None:
        _number(body, "seed", 0, 2**64 - 1, integer=True)
    _logit_bias(body.get("logit_bias"), vocab)


def _logit_bias(bias, vocab: int | None) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise BadRequest(
            f"logit_bias must be an object of token id to bias, got {shown(bias)}"
        )
    if bias and vocab is None:
        raise BadRequest("logit_bias: this model's vocabulary size is unknown")
    for key, value in bias.items():
        if not re.fullmatch(r"-?[0-9]+", key):
            raise BadRequest(f"logit_bias keys must be token ids, got {shown(key)}")
        if not 0 <= int(key) < vocab:
            raise BadRequest(
                f"logit_bias: token id {key} is out of range: this model's ids "
                f"are 0 to {vocab - 1}"
            )
        if not (_is_number(value) and math.isfinite(value)):
            raise BadRequest(
                f"logit_bias[{key}] must be a finite number, got {shown(value)}"
            )
        if abs(value) > MAX_LOGIT_BIAS:
            raise BadRequest(
                f"logit_bias[{key}] must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], "
                f"got {shown(value)}"
            )


def _output(body, limits: Limits) -> None:
    context = limits.context or INT32_MAX
    if body.get("max_completion_tokens") is not None:  # mlx-lm reads it first
        _number(body, "max_completion_tokens", 1, context, integer=True)
    else:
        _number(body, "max_tokens", 1, context, integer=True)
    if body.get("n") is not None and (not _is_int(body["n"]) or body["n"] != 1):
        raise BadRequest(
            f"n must be 1 (one choice per request), got {shown(body['n'])}"
        )
    _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        _object(body, "stream_options")
        if "include_usage" in options and not isinstance(
            options["include_usage"], bool
        ):
            raise BadRequest(
                "stream_options.include_usage must be true or false, got "
                + shown(options["include_usage"])
            )
    _bool(body, "logprobs")
    top = body.get("top_logprobs")
    if "top_logprobs" in body and top != -1:  # -1: mlx-lm's "off"
        _number(body, "top_logprobs", 0, 11, integer=True)
        if top > 0 and body.get("logprobs") is not True:
            raise BadRequest("top_logprobs needs logprobs: true")
    if body.get("stream") and (body.get("logprobs") or (top or 0) > 0):
        # mlx-lm's stream events carry no logprobs
        raise BadRequest("logprobs: not served on streams (send stream: false)")
    stop = body.get("stop")
    if stop is not None:
        words = [stop] if isinstance(stop, str) else stop
        if not (isinstance(words, list) and all(isinstance(w, str) for w in words)):
            raise BadRequest(
                f"stop must be a string or a list of strings, got {shown(stop)}"
            )
        if any(not w for w in words):
            raise BadRequest("stop strings must not be empty")
        if len(words) > MAX_STOP:
            raise BadRequest(f"stop: at most {MAX_STOP} strings, got {len(words)}")


def _messages(body) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(
            f"messages must be a non-empty list of objects, got {shown(messages)}"
        )
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(
                f"{where} must be an object with 'role' and 'content', "
                f"got {shown(message)}"
            )
        if not isinstance(message.get("role"), str):
            raise BadRequest(
                f"{where}.role must be a string, got {shown(message.get('role'))}"
            )
        _content(message.get("content"), f"{where}.content")
        if message["role"] == "tool" and not isinstance(
            message.get("tool_call_id"), str
        ):
            raise BadRequest(
                f"{where}.tool_call_id: a tool message must name the call it "
                f"answers, got {shown(message.get('tool_call_id'))}"
            )
        calls = message.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
        ):
            raise BadRequest(
                f"{where}.tool_calls must be a list of objects, got {shown(calls)}"
            )


def _content(content, where: str) -> None:
    """A string, null (mlx-lm reads it as empty), or a list of text parts:
    there is no image processor, and mlx-lm would fetch image URLs."""
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise BadRequest(
            f"{where} must be a string or a list of content parts, got {shown(content)}"
        )
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise BadRequest(
                f"{where}[{j}] must be a text part "
                f'({{"type": "text", "text": ...}}; only text is served), '
                f"got {shown(part)}"
            )
        if not isinstance(part.get("text"), str):
            raise BadRequest(
                f"{where}[{j}].text must be a string, got {shown(part.get('text'))}"
            )


def check_length(prompt_tokens: int, max_tokens: int, limits: Limits) -> None:
    """Refuse, before any prefill, a prompt that is empty or that with
    `max_tokens` would run past the model's context."""
    if prompt_tokens == 0:
        raise BadRequest("the prompt is empty (0 tokens)")
    if limits.context is not None and prompt_tokens + max_tokens > limits.context:
        raise BadRequest(
            f"the prompt ({prompt_tokens:,} tokens) plus max_tokens "
            f"({max_tokens:,}) is {prompt_tokens + max_tokens:,} tokens, more than "
            f"the model's context length of {limits.context:,}; send a shorter "
            "prompt or a lower max_tokens"
        )
