"""A request's own KV budget: `"veloxpatch": {"max_kv_bytes": "8MB"}` in its body.

The size is that request's per-sequence byte target: its caches are made with
the patch's options and this `max_kv_bytes` in place of the server's budget
(`Patch.options_for_bytes`, priced by `pricing.py` as the option is
everywhere), its KV reservation is bounded with those options (`kv.KVEstimate`),
and its prompt-cache entries live under their own key (`RequestBudget.key`), so
that an entry made under one budget is never handed to a request with another.

`checks.check_body` reads the field's shape; `Budgets.of`
checks the size against the algorithm and the server's `--kv-cap` before the
request is queued. Each failure is a BadRequest naming the field.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, NamedTuple

from ..errors import OptionError
from ..pricing import parse_target, smallest_target
from .checks import FIELD, SIZE_FIELD, BadRequest
from .kv import KVEstimate

KEPT = 16  # bound options kept for reuse: each distinct size binds anew


class RequestBudget(NamedTuple):
    """What a request with its own `max_kv_bytes` is served with."""

    max_kv_bytes: int
    options: Any  # the patch's options with this max_kv_bytes, bound
    estimate: Any  # kv.KVEstimate of those options
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
        self._fewest = None  # the options of the fewest rows that work

    def of(self, body: dict, prompt_tokens: int) -> RequestBudget | None:
        """The budget of a request with `prompt_tokens` tokens (None: the
        server's options, as they are), or BadRequest."""
        field = body.get(FIELD) or {}
        if field.get("max_kv_bytes") is None:
            return None
        try:
            target = parse_target(field["max_kv_bytes"], SIZE_FIELD)
        except OptionError as e:
            raise BadRequest(str(e)) from None
        limit = target.bytes_for(self.patch.model, prompt_tokens)
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
        try:
            return self.patch.options_for_tokens(prompt_tokens)
        except OptionError:
            return self._fewest_rows()

    def _fewest_rows(self):
        if self._fewest is None:
            patch = self.patch
            drop = ("budget", "max_kv_bytes")
            given = {k: v for k, v in patch.requested.items() if k not in drop}
            size = smallest_target(patch.model, patch.algo, given, 1)
            self._fewest = (
                patch.options if size is None else patch.options_for_bytes(size)
            )
        return self._fewest

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


class BudgetModel:
    """The served model for a request with its own budget: mlx-lm's
    `make_prompt_cache(model)` calls `make_cache()`, which makes the caches
    with that budget's options."""

    def __init__(self, model, patch, options):
        self.model, self.patch, self.options = model, patch, options

    def make_cache(self):
        return self.patch.make_cache(options=self.options)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)


class BudgetProvider:
    """The model provider as a request with its own budget sees it: its
    model makes that budget's caches, and its prompt-cache key is the
    budget's."""

    def __init__(self, provider, budget: RequestBudget):
        self.provider = provider
        self.budget = budget
        self.model_key = budget.key
        self.model = BudgetModel(provider.model, provider.patch, budget.options)
        self.kv_options = budget.options

    def __getattr__(self, name):
        return getattr(self.provider, name)
