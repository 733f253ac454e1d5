"""Pricing and admission: what a request may hold, reserved before it is
queued, under `veloxpatch serve --kv-cap` (the cap covers the requests in
flight and mlx-lm's prompt cache; docs/serving.md, "--kv-cap").

`KVEstimate` bounds a request's KV bytes from its prompt's length: with a
budget, the more of reading (the whole prompt, or budget + one chunk where the
cache cuts as it reads) and after (the decode bound plus the prompt-end
snapshot the prompt cache keeps), each of no more rows than its tokens;
without one, prompt + max_tokens rows. `KVLedger` reserves it, evicting
prompt-cache entries for room, or refuses: 503 while others hold the room, 413
when it could never fit.

`Budgets`: a request's own rows, a size or a share in its body (`"veloxpatch":
{"max_kv_bytes": ...}`: served alone, its entries under their own key, so an
entry made under one budget never reaches another), or under the server's
share (`--max-kv-bytes 20%`) the rows its prompt buys, under the server's key,
batched (the prompt cache makes its caches, `BoundedPromptCache.fresh`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, NamedTuple

from model_adapters import adapter_for

from .. import pricing
from ..errors import OptionError
from ..memory import full_rows
from .checks import FIELD, SIZE_FIELD, BadRequest


class Refused(Exception):
    """A request the server will not take; `status` is its HTTP code."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class KVEstimate:
    """Upper bound on one request's KV bytes (module doc), from the patch
    (`options`: bound options of its algorithm the request's caches are made
    with instead, a request's own budget)."""

    def __init__(self, patch, options=None):
        model, options = patch.model, options or patch.options
        self.dims = dims = adapter_for(model).dims(model)
        self.dtype = dtype = pricing.kv_dtype_size(model)
        self.options = options
        layers = list(zip(dims.kv_heads, dims.head_dims, dims.sliding))
        # sliding-window layers keep mlx-lm's cache: counted whole, as a bound
        self.sliding_row = sum(h * 2 * d * dtype for h, d, s in layers if s)
        self.patched_row = sum(h * (2 * d * dtype + 4) for h, d, s in layers if not s)
        self.model = model
        # the snapshot the prompt cache keeps (kept_for_later) is held too
        self.snapshot = patch.cache_cls.policy_for(options) == "prompt"
        self.budget = getattr(options, "budget", None)
        # compress="chunks": that bound holds while the prompt is read too
        self.bounds_prompt = self.budget is not None and (
            pricing.holds_of(options).reading_rows is not None
        )

    def request_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        rows = full_rows(prompt_tokens + max_tokens)
        held = self.sliding_row * rows
        if self.budget is None:
            return held + self.patched_row * rows
        # no cache holds more rows than the request has tokens (grown in steps)
        args = (self.options, self.dims, self.dtype, self.budget)
        decoding = pricing.bound_bytes(*args, rows, decode=True)
        if self.bounds_prompt:  # reading holds one chunk more, the prompt at most
            reading = pricing.bound_bytes(*args, full_rows(prompt_tokens))
            # kvzap's snapshot, taken once it compressed: a gather of its rows
            kept = (
                pricing.bound_bytes(*args, prompt_tokens, decode=True)
                if self.snapshot
                else 0
            )
        else:  # the whole prompt while it is read, and the snapshot taken then
            reading = self.patched_row * full_rows(prompt_tokens)
            kept = self.patched_row * prompt_tokens if self.snapshot else 0
        return held + int(max(reading, decoding + kept))

    def full_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        """What mlx-lm's own KVCache would hold for the same request."""
        rows = full_rows(prompt_tokens + max_tokens)
        return pricing.full_bytes(self.model, rows) + self.sliding_row * rows


class KVLedger:
    """Reservations of the requests in flight, and the cap (None: no cap)."""

    def __init__(self, cap: int | None, prompt_cache, max_requests: int | None = None):
        self.cap = cap
        self.max_requests = max_requests  # in flight at once (None: no bound)
        self.prompt_cache = prompt_cache
        self.reserved = 0
        self.in_flight = 0
        self._lock = threading.Lock()
        prompt_cache.ledger = self

    def admit(self, need: int) -> int:
        """Reserve `need` bytes (evicting prompt-cache entries if that makes
        room) or raise Refused."""
        with self._lock:
            if self.max_requests is not None and self.in_flight >= self.max_requests:
                raise Refused(
                    503,
                    f"server busy: {self.in_flight} requests in flight, the "
                    f"server's --max-requests {self.max_requests}; retry later",
                )
            if self.cap is not None:
                if need > self.cap:
                    raise Refused(
                        413,
                        f"this request may hold up to {need:,} bytes of KV cache, "
                        f"more than the server's --kv-cap {self.cap:,}; "
                        "send a shorter prompt, a lower max_tokens or a smaller "
                        "budget (the algorithm's bound may not depend on the prompt)",
                    )
                if self.reserved + need > self.cap:
                    raise Refused(
                        503,
                        f"KV cache full: {self.in_flight} requests in flight hold "
                        f"up to {self.reserved:,} of --kv-cap {self.cap:,} "
                        f"bytes and this one may need {need:,}; retry later",
                    )
                room = self.cap - self.reserved - need
                if self.prompt_cache.nbytes > room:
                    self.prompt_cache.trim_to(n_bytes=room)
            self.reserved += need
            self.in_flight += 1
            return need

    def release(self, need: int) -> None:
        with self._lock:
            self.reserved -= need
            self.in_flight -= 1

    def prompt_cache_room(self) -> int | None:
        return None if self.cap is None else self.cap - self.reserved


KEPT = 16  # bound options kept for reuse: each distinct size binds anew


class RequestBudget(NamedTuple):
    """What a request with its own `max_kv_bytes` is served with."""

    max_kv_bytes: int
    options: Any  # the patch's options with this max_kv_bytes, bound
    estimate: Any  # KVEstimate of those options
    key: tuple  # its prompt-cache entries' model key

    def note(self) -> str:
        return (
            f"{SIZE_FIELD} {self.max_kv_bytes:,} (budget "
            f"{getattr(self.options, 'budget', '?')} rows)"
        )


class Budgets:
    """The budgets requests ask for, checked and bound once per size (the
    last `KEPT` sizes are kept)."""

    def __init__(self, patch, model_key: tuple, cap: int | None):
        self.patch, self.model_key, self.cap = patch, model_key, cap
        self._kept: OrderedDict[tuple, RequestBudget] = OrderedDict()
        self._lock = threading.Lock()

    def of(self, body: dict, prompt_tokens: int) -> RequestBudget | None:
        """The budget of a request with `prompt_tokens` tokens (None: the
        server's options, as they are), or BadRequest."""
        field = body.get(FIELD) or {}
        if field.get("max_kv_bytes") is None:
            return None
        try:
            target = pricing.parse_target(field["max_kv_bytes"], SIZE_FIELD)
        except OptionError as e:
            raise BadRequest(str(e)) from None
        patch = self.patch
        try:  # a share too small for this prompt: the fewest rows that work
            limit, _ = pricing.target_bytes(
                patch.model, patch.algo, target, prompt_tokens, patch.given()
            )
        except OptionError as e:
            raise BadRequest(f"{SIZE_FIELD}: {e}") from None
        if self.cap is not None and limit > self.cap:
            raise BadRequest(
                f"{SIZE_FIELD} ({target}: {limit:,} bytes) is more than the "
                f"server's --kv-cap ({self.cap:,} bytes)"
            )
        key = (*self.model_key, ("max_kv_bytes", target.size or str(target)))
        with self._lock:
            if (limit, key) in self._kept:
                self._kept.move_to_end((limit, key))
                return self._kept[limit, key]
        try:
            options = self.patch.options_for_bytes(limit)
        except OptionError as e:
            share = f"={target}" if target.ratio is not None else ""
            raise BadRequest(f"{SIZE_FIELD}{share}: {e}") from None
        budget = RequestBudget(limit, options, KVEstimate(self.patch, options), key)
        with self._lock:
            self._kept[limit, key] = budget
            while len(self._kept) > KEPT:
                self._kept.popitem(last=False)
        return budget

    def server_options(self, prompt_tokens: int):
        """The server's options for a prompt of `prompt_tokens`: the patch's
        own, or under a share the rows it buys for this prompt (a prompt too
        short for them: the fewest rows the algorithm works with)."""
        if not self.patch.rows_by_prompt():
            return self.patch.options
        return self.patch.options_for_tokens(prompt_tokens)

    def share_note(self, estimate) -> str:
        """The log's note of the rows the server's share gave a request."""
        if not self.patch.rows_by_prompt():
            return ""
        return f", {estimate.budget} rows a KV head for this prompt"

    def server_estimate(self, prompt_tokens: int, estimate):
        """`estimate` (the server's), or, under a share, one of this prompt's
        rows."""
        if not self.patch.rows_by_prompt():
            return estimate
        return KVEstimate(self.patch, self.server_options(prompt_tokens))
