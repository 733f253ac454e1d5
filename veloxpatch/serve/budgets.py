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
from ..pricing import parse_size
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
        self._kept: OrderedDict[int, RequestBudget] = OrderedDict()
        self._lock = threading.Lock()

    def of(self, body: dict) -> RequestBudget | None:
        """The request's budget (None: the server's options), or BadRequest."""
        field = body.get(FIELD) or {}
        if field.get("max_kv_bytes") is None:
            return None
        try:
            limit = parse_size(field["max_kv_bytes"], SIZE_FIELD)
        except OptionError as e:
            raise BadRequest(str(e)) from None
        if self.cap is not None and limit > self.cap:
            raise BadRequest(
                f"{SIZE_FIELD} ({limit:,} bytes) is more than the server's "
                f"--kv-cap ({self.cap:,} bytes)"
            )
        with self._lock:
            if limit in self._kept:
                self._kept.move_to_end(limit)
                return self._kept[limit]
        try:
            options = self.patch.options_for_bytes(limit)
        except OptionError as e:
            raise BadRequest(f"{SIZE_FIELD}: {e}") from None
        key = (*self.model_key, ("max_kv_bytes", limit))
        budget = RequestBudget(limit, options, KVEstimate(self.patch, options), key)
        with self._lock:
            self._kept[limit] = budget
            while len(self._kept) > KEPT:
                self._kept.popitem(last=False)
        return budget


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
