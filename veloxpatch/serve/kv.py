"""`veloxpatch serve --kv-cap`: the KV bytes the server holds, bounded.

The bound covers every request in flight (queued or generating) plus mlx-lm's
prompt cache. A request reserves an upper bound on the KV bytes it can hold
before it is queued (its prompt is tokenized for that), and gives it back when
its response ends:
- a cache with a budget (eviction): the most of what it holds while the prompt
  is read (the whole prompt, or budget + one chunk where it cuts as it reads:
  `compress="chunks"`, kvzap) and what it holds after (its decode bound,
  `kv_budget.bound_bytes`, plus the prompt-end snapshot the prompt cache
  keeps, `kept_for_later`: the prompt itself for the SnapKV family and kvzip,
  kvzap's compressed cache), each of no more rows than its tokens. The
  snapshot is the entry mlx-lm's server would keep; with it, a request whose
  max_tokens is below the budget holds more than mlx-lm's one cache;
- any other cache (full, kivi, ...): prompt + max_tokens rows at full precision.
Rows are rounded up to the 256-row growth step, and positions (4 bytes a row)
are counted. It is a bound, not a measurement: the per-request log line says
what the caches really held, next to what mlx-lm's own cache would have held.

When a request does not fit, prompt-cache entries are evicted (least recently
used first, `RecencyOrder`) first; if it still does not fit it is refused: 503
while others hold the room (try again later), 413 when it could never fit.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import deque

import mlx.core as mx
from mlx_lm.models.cache import (
    LRUPromptCache,
    PromptTrie,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from model_adapters import adapter_for

from .. import pricing
from ..caches import VeloxCache
from ..memory import full_kv_bytes, full_rows, kv_bytes
from ..pricing import bound_bytes, holds_of, kv_dtype_size

log = logging.getLogger("veloxpatch.serve")


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
        self.dtype = dtype = kv_dtype_size(model)
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
            holds_of(options).reading_rows is not None
        )

    def request_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        rows = full_rows(prompt_tokens + max_tokens)
        held = self.sliding_row * rows
        if self.budget is None:
            return held + self.patched_row * rows
        # no cache holds more rows than the request has tokens (grown in steps)
        args = (self.options, self.dims, self.dtype, self.budget)
        decoding = bound_bytes(*args, rows, decode=True)
        if self.bounds_prompt:  # reading holds one chunk more, the prompt at most
            reading = bound_bytes(*args, full_rows(prompt_tokens))
            # kvzap's snapshot, taken once it compressed: a gather of its rows
            kept = (
                bound_bytes(*args, prompt_tokens, decode=True) if self.snapshot else 0
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

    def __init__(
        self,
        cap: int | None,
        prompt_cache: BoundedPromptCache,
        max_requests: int | None = None,
    ):
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


class KeepingPromptTrie(PromptTrie):
    """mlx-lm's trie of prompt-cache entries. Inserting a trimmable entry pops
    the entries of its prefixes (it stands for them, trimmed back); here only
    those `stands_for(prefix length)` allows, for the entry being inserted."""

    def __init__(self):
        super().__init__()
        self.stands_for = None

    def pop_prefixes(self, model, tokens):
        popped = super().pop_prefixes(model, tokens)
        if self.stands_for is None:
            return popped
        gone = []
        for n, entry in popped:
            if self.stands_for(n):
                gone.append((n, entry))
            else:  # put back: trimmed to it, the new entry would start over
                self.add(model, tokens[:n], entry)
        return gone

    def only_extended_by(self, model, tokens) -> list[int]:
        """The lengths of the entries that start `tokens` and that no entry
        but the one of `tokens` extends: a conversation's earlier turns, not a
        system prompt other conversations branch from."""
        node, found = self._trie.get(model, {}), []
        for n, tok in enumerate(tokens):
            if "__value__" in node and _values_below(node, 3) == 2:
                found.append(n)  # itself and the one entry of `tokens`
            node = node.get(tok)
            if node is None:
                break
        return found


def _values_below(node, most: int) -> int:
    """Entries at or under a trie node, counted up to `most`."""
    count, stack = 0, [node]
    while stack and count < most:
        node = stack.pop()
        count += "__value__" in node
        stack.extend(v for k, v in node.items() if k != "__value__")
    return min(count, most)


class RecencyOrder(LRUPromptCache.CacheOrder):
    """The order entries are evicted in: the least recently used first, of any
    type (mlx-lm's evicts from whichever of its assistant, user and system
    lists is longest, so a document's system entry could push out another
    user's conversation). A fetch is a use (`touch`); an entry only a newer one
    extends, a conversation that has moved on, goes first (`touch(first=True)`)."""

    def __init__(self):
        super().__init__()
        self._all = deque()  # (model, tokens, cache type), least recent first

    def push(self, model, tokens, cache_type="assistant"):
        super().push(model, tokens, cache_type)
        self._all.append((model, tokens, cache_type))

    def remove(self, model, tokens):
        super().remove(model, tokens)
        self._take(model, tokens)

    def pop(self):
        model, tokens, cache_type = self._all.popleft()
        self._lrus[cache_type].remove((model, tokens))
        return model, tokens

    def touch(self, model, tokens, first: bool = False) -> None:
        """Make an entry the most recently used (`first`: the least)."""
        item = self._take(model, tokens)
        if item is not None:
            self._all.appendleft(item) if first else self._all.append(item)

    def _take(self, model, tokens):
        for i, item in enumerate(self._all):
            if item[0] == model and item[1] == tokens:
                del self._all[i]
                return item
        return None


class BoundedPromptCache(LRUPromptCache):
    """mlx-lm's prompt cache, shared between the generation thread and request
    threads (hence the lock), trimmed to what the cap leaves it, and logging
    what each finished request's caches held. An entry keeps its prefixes'
    entries (a shared system prompt, a document) when trimming it back to
    them could not be reused (`trimmed_exactly`), and a request falls back to
    such a shorter entry when the longer one cannot serve it."""

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63):
        super().__init__(max_size, max_bytes)
        self._trie = KeepingPromptTrie()
        self._lru = RecencyOrder()
        self._lock = threading.RLock()
        self.ledger: KVLedger | None = None
        self._handed = None  # keep_system's fetch, for the request it ran for
        # the caller runs the model through ReplayingModel (one request at a
        # time): an exact prompt's entry may hand it the logits it kept
        self.replays = False
        self.disk = None  # disk.DiskEntries (--prompt-cache-dir)
        # the key of the server's options, whose entries the disk holds (None:
        # every key's); a request's own budget keys its entries apart
        self.disk_key = None
        # (key, fn(tokens) -> caches): a new request's caches under that key,
        # made for its prompt (the server's share sets rows by each prompt)
        self.fresh = None

    def fetch_nearest_cache(self, model, tokens):
        cache, rest = self._nearest(model, tokens)
        if cache is None and self.fresh is not None and self.fresh[0] == model:
            return self.fresh[1](tokens), list(tokens)  # read from the start
        return cache, rest

    def _nearest(self, model, tokens):
        handed, self._handed = self._handed, None
        if handed is not None and handed[:2] == (model, list(tokens)):
            return handed[2:]  # fetched (and read on) by keep_system
        with self._lock:
            self._load_from_disk(model, tokens)
            cache, rest = super().fetch_nearest_cache(model, tokens)
            longer = self._untrimmable_longer(model, tokens, cache, rest)
            if cache is not None:
                self._touch_used(model, tokens, len(tokens) - len(rest))
        if longer:
            log.info(
                "prompt cache: an entry shares %d of these %d tokens but its "
                "caches cannot be trimmed back to them; %s",
                longer,
                len(tokens),
                "starting over"
                if cache is None
                else f"a shorter one holds {len(tokens) - len(rest)} tokens",
            )
        shared = len(tokens) - len(rest)
        why = (
            f"the nearest entry shares {shared} of these {len(tokens)} tokens but "
            "was trimmed past evictions"
        )
        if cache is not None and not rest and tokens:
            # an entry of exactly this prompt (kept_for_later stores prompts):
            # mlx-lm needs a token to prefill, so give the last one back
            if self.replays and replay_last_token(cache, len(tokens)):
                log.info(
                    "prompt cache: the same %d-token prompt again: continues "
                    "from its entry as its prompt ended",
                    len(tokens),
                )
                return cache, tokens[-1:]
            if not can_trim_prompt_cache(cache):
                log.info(
                    "prompt cache: this prompt's entry cannot be trimmed to "
                    "read its last token again; starting over"
                )
                return None, tokens
            trim_prompt_cache(cache, 1)
            rest = tokens[-1:]
            why = (
                "this prompt's entry was compressed as its prompt ended and kept "
                "no logits to start from"
                if self.replays
                else "this prompt's entry was compressed as its prompt ended "
                "(its logits are replayed only one request at a time)"
            )
        shared = len(tokens) - len(rest)
        if cache is not None and not trimmed_exactly(cache, shared, len(rest)):
            # rows evicted (or statistics taken) after the shared prefix read what
            # followed it (another request's prompt): not reused; a shorter entry
            # (the shared system prompt) is, or the request starts over
            cache, rest = self._shorter_entry(model, tokens)
            log.info(
                "prompt cache: %s; %s",
                why,
                "starting over"
                if cache is None
                else f"a shorter one holds {len(tokens) - len(rest)} tokens",
            )
        return cache, rest

    def _load_from_disk(self, model, tokens) -> None:
        """Put the stored entry that holds the most of `tokens` into memory,
        if memory holds less of them (the fetch then treats it as any kept
        entry)."""
        if self.disk is None or not tokens:
            return
        if not self._on_disk(model):
            log.info(
                "prompt cache: the disk holds entries of the server's options "
                "only, none for this request's own budget (%s)",
                model[-1],
            )
            return
        found = self._trie.search(model, tokens)
        if found.exact is not None:
            return
        have = len(found.shorter) if found.shorter is not None else 0
        if found.longer is not None:  # mlx-lm trims it back, where it can
            longer = self._trie.get(found.model, found.longer).prompt_cache
            if can_trim_prompt_cache(longer):
                have = max(have, found.common_prefix)
        name = self.disk.nearest(tokens, have)
        loaded = self.disk.load(name) if name is not None else None
        if loaded is None:
            return
        caches, stored, cache_type, kept = loaded
        revive(caches, kept)
        self._keep(model, stored, caches, cache_type, to_disk=False)

    def _touch_used(self, model, tokens, shared: int) -> None:
        """Mark the entry a fetch of `tokens` used (sharing `shared` of them)
        as the most recently used."""
        found = self._trie.search(model, tokens)
        if found.exact is not None:
            used = found.exact
        elif found.shorter is not None and len(found.shorter) == shared:
            used = found.shorter
        else:
            used = found.longer
        if used is not None:
            self._lru.touch(model, used)

    def holds_prompt(self, tokens) -> bool:
        """Whether an entry, under any key, holds exactly these tokens."""
        with self._lock:
            return any(
                self._trie.search(key, list(tokens)).exact is not None
                for key in list(self._trie._trie)
            )

    def _on_disk(self, model) -> bool:
        """Whether entries under `model` (a prompt-cache key) go to disk."""
        return self.disk_key is None or model == self.disk_key

    def _untrimmable_longer(self, model, tokens, cache, rest) -> int:
        """The tokens a longer entry shares with `tokens` when mlx-lm passed it
        over because its caches cannot be trimmed (0: none was)."""
        found = self._trie.search(model, tokens)
        shared = len(tokens) - len(rest) if cache is not None else 0
        if found.exact is not None or found.longer is None:
            return 0
        if found.common_prefix <= shared:
            return 0
        entry = self._trie.get(found.model, found.longer)
        return 0 if can_trim_prompt_cache(entry.prompt_cache) else found.common_prefix

    def _shorter_entry(self, model, tokens):
        """A copy of the longest entry whose tokens start `tokens` (shorter than
        them) and the tokens it leaves, or (None, tokens)."""
        with self._lock:
            found = self._trie.search(model, tokens)
            if found.shorter is None:
                return None, tokens
            entry = self._trie.get(found.model, found.shorter)
            rest = tokens[len(found.shorter) :]
            # read, not trimmed: checked before it is worth a copy
            if not trimmed_exactly(entry.prompt_cache, len(found.shorter), len(rest)):
                return None, tokens
            self._lru.touch(model, found.shorter)
            return copy.deepcopy(entry.prompt_cache), rest

    def keep_system(
        self, model, key, prompt, system_end, prefill_step, compress=None
    ) -> int:
        """Before a request served one at a time: fetch its nearest entry and,
        if that starts before the end of its system prompt (`system_end`
        tokens), read up to there and insert a copy as a "system" entry, as
        mlx-lm's batched path does while it reads a prompt. Its one-at-a-time
        path only inserts the request's end, which a cache compressed as its
        prompt ended (kvzip) cannot be trimmed back to: every user of the same
        system prompt would read it again. `compress(caches, ids)`: the entry
        is the system prompt read alone and compressed by it (read from the
        start). The request's own fetch gets what was fetched and read here (no
        second copy). Returns the tokens read."""
        cache, rest = self.fetch_nearest_cache(key, prompt)
        start = len(prompt) - len(rest)
        read = 0
        if system_end - start >= 2:  # one token left would be a lone call
            if cache is None or compress is not None:
                fresh = self.fresh is not None and self.fresh[0] == key
                new = self.fresh[1](prompt) if fresh else make_prompt_cache(model)
                cache, start = new, 0
            for piece in prompt_pieces(prompt[start:system_end], prefill_step):
                model(mx.array(piece)[None], cache=cache)
                mx.eval([c.state for c in cache])  # as generate_step's prefill
            system = list(prompt[:system_end])
            if compress is not None:
                compress(cache, system)
            log.info(
                "prompt cache: the system prompt's %d tokens kept%s",
                system_end,
                ", compressed" if compress is not None else "",
            )
            self.insert_cache(key, system, copy.deepcopy(cache), cache_type="system")
            rest = prompt[system_end:]
            read = system_end - start
        self._handed = (key, list(prompt), cache, rest)
        return read

    def drop_handed(self) -> None:
        """Forget what keep_system fetched, if its request never asked for it."""
        self._handed = None

    def trim_to(self, *, n_sequences=None, n_bytes=None):
        with self._lock:
            super().trim_to(n_sequences=n_sequences, n_bytes=n_bytes)

    def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
        if cache_type == "assistant":  # a request's end (the others: segments)
            log.info(
                "request done: %d tokens, KV held %s bytes (a full cache would "
                "hold %s)",
                len(tokens),
                f"{kv_bytes(prompt_cache):,}",
                f"{full_kv_bytes(prompt_cache):,}",
            )
            kept = kept_for_later(tokens, prompt_cache)
            if kept is None:
                return
            tokens, prompt_cache, cache_type = kept
        self._keep(model, tokens, prompt_cache, cache_type)

    def _keep(self, model, tokens, prompt_cache, cache_type, to_disk=True) -> None:
        with self._lock:
            # its prefixes' entries go only where it stands for them exactly
            self._trie.stands_for = lambda n: reproduces(prompt_cache, n)
            try:
                super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
            finally:
                self._trie.stands_for = None
            for n in self._trie.only_extended_by(model, tokens):
                self._lru.touch(model, tokens[:n], first=True)  # moved on from
            self._price_logits(model, tokens, prompt_cache)
            if to_disk and self.disk is not None and self._on_disk(model):
                kept = getattr(_phase(prompt_cache), "prompt_logits", None)
                self.disk.store(tokens, prompt_cache, cache_type, kept)
            elif to_disk and self.disk is not None:
                log.info(
                    "prompt cache: an entry of a request's own budget (%s) is "
                    "kept in memory only, not on disk",
                    model[-1],
                )
            room = self.ledger.prompt_cache_room() if self.ledger else None
            if room is not None and self.nbytes > room:
                self.trim_to(n_bytes=room)

    def _price_logits(self, model, tokens, prompt_cache) -> None:
        """Add the logits an entry keeps (`ReplayingModel`) to its price: mlx-lm
        sums its caches' nbytes only."""
        extra = kept_logits_bytes(prompt_cache)
        if not extra:
            return
        try:
            entry = self._trie.get(model, tokens)
        except KeyError:  # already evicted by mlx-lm's own bounds
            return
        if entry.prompt_cache is not prompt_cache:
            return
        entry.nbytes += extra
        self._n_bytes += extra
        self._n_bytes_by_type[entry.cache_type] += extra
        if self._n_bytes > self.max_bytes:
            self.trim_to(n_bytes=self.max_bytes)


class ReplayingModel:
    """The served model as the one-at-a-time path calls it. A cache compressed
    as its prompt ended (kvzip, kvzap) cannot be trimmed to read the prompt's
    last token again, so the same prompt again could not reuse its entry: its
    prompt's last call keeps its logits (`prompt_logits`, copied into the
    snapshot), and a fetch of exactly that prompt (`replay_last_token`) has
    the next call, the last token's, return them without touching the cache.
    The generation then goes on from the state the first request decoded from."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, inputs, cache=None, **kwargs):
        phase = _phase(cache)
        if phase is not None and phase.replay is not None:
            logits, phase.replay = phase.replay, None
            if inputs.shape[-1] == 1:
                return logits
        out = self.model(inputs, cache=cache, **kwargs)
        # the last prompt call is a lone token (generate_step's `_step`)
        if phase is not None and phase.keep_snapshot and inputs.shape[-1] == 1:
            if phase.in_prompt:
                ours = [c for c in cache if hasattr(c, "phase")]
                phase.prompt_logits = (ours[0].offset, out[:, -1:, :])
        return out


def _phase(cache):
    if not cache:
        return None
    for c in cache:
        if hasattr(c, "phase"):
            return c.phase
    return None


def replay_last_token(cache, n: int) -> bool:
    """Arm `cache` (an entry of exactly n prompt tokens, past its prompt's
    end) to give its kept logits for the last token: whether it could."""
    phase = _phase(cache)
    kept = getattr(phase, "prompt_logits", None)
    if kept is None or kept[0] != n or phase.in_prompt:
        return False
    if any(c.offset != n for c in cache if hasattr(c, "phase")):
        return False
    phase.replay = kept[1]
    return True


def revive(caches, kept) -> None:
    """Caches loaded from a file (disk.py), made what the entry kept in
    memory was: one phase of every layer, snapshots at their prompt ends as
    the server asks, the kept logits of its prompt's last token."""
    ours = [c for c in caches if hasattr(c, "phase")]
    if not ours:
        return
    phase = ours[0].phase
    phase.size = len(ours)
    phase.keep_snapshot = type(ours[0]).policy_for(ours[0].options) == "prompt"
    phase.prompt_logits = kept


def kept_logits_bytes(cache) -> int:
    kept = getattr(_phase(cache), "prompt_logits", None)
    return 0 if kept is None else kept[1].nbytes


def prompt_pieces(tokens: list[int], step: int) -> list[list[int]]:
    """`tokens` in prefill calls of `step`, none of one token: after prompt
    calls a lone token is where the phase must guess whether the prompt ended
    (caches/phase.py); the entry is then kept in no such doubt."""
    pieces = [tokens[i : i + step] for i in range(0, len(tokens), step)]
    if len(pieces) > 1 and len(pieces[-1]) == 1:
        pieces[-2:] = [pieces[-2] + pieces[-1]]
    return pieces


def trimmed_exactly(caches, shared: int, coming: int | None = None) -> bool:
    """Whether caches trimmed back to `shared` tokens depend on no other
    request's prompt: nothing a trim cannot undo (an eviction, running query
    statistics) happened once they had seen more, or only generated tokens
    were trimmed (the shared tokens hold the whole prompt); and the `coming`
    tokens (None: any number) refill the query buffers the trim cut short."""
    ours = [c for c in caches if hasattr(c, "irreversible_at")]
    return all(
        c.irreversible_at is None
        or c.irreversible_at <= shared
        or (c.decode_from is not None and c.decode_from <= shared)
        for c in ours
    ) and (coming is None or all(c.queries_short <= coming for c in ours))


def reproduces(caches, n: int) -> bool:
    """Whether `caches` trimmed back to their first n tokens could be reused
    (`trimmed_exactly`): tried on a copy, unless they already could not (a
    trim only adds what it cannot undo)."""
    ours = [c for c in caches if hasattr(c, "irreversible_at")]
    if not ours or ours[0].offset <= n:
        return True
    offset = ours[0].offset
    if not trimmed_exactly(caches, n):
        return False
    trial = copy.deepcopy(caches)
    trim_prompt_cache(trial, offset - n)
    return trimmed_exactly(trial, n)


def kept_for_later(tokens, caches):
    """What of a finished request's caches the prompt cache keeps for later
    requests and turns, by the algorithm's `prompt_cache_policy`: (tokens,
    caches, cache type), or None. A cache compressed for this request's
    question is never handed to another: the snapshot taken as its prompt
    ended (uncompressed, or kvzip's reconstruction-scored cache) is kept
    instead, under the prompt's tokens; nothing where the prompt's own
    evictions read the question's queries (h2o, tova, keyformer)."""
    ours = [c for c in caches if isinstance(c, VeloxCache)]
    policy = type(ours[0]).policy_for(ours[0].options) if ours else "as_is"
    if policy == "as_is":
        return tokens, caches, "assistant"
    snapshot = ours[0].phase.snapshot if policy == "prompt" else None
    if snapshot is None:
        log.info("request done: nothing kept for later (%s policy)", policy)
        return None
    _, n, copies = snapshot
    fit_buffers(copies)  # priced at its rows, not the buffers' growth step
    kept = copies and getattr(_phase(copies), "prompt_logits", None)
    if kept:
        mx.eval(kept[1])
    # kvzip and kvzap snapshot after their (question-agnostic) compression
    when = "after its" if not ours[0].snapshot_first() else "before its question-aware"
    log.info(
        "prompt cache keeps the %d prompt tokens as they stood at the prompt's "
        "end, %s compression: %s bytes%s",
        n,
        when,
        f"{kv_bytes(copies):,}",
        f" and its last token's logits ({kept[1].nbytes:,} bytes)" if kept else "",
    )
    return list(tokens[:n]), copies, "user"


def fit_buffers(caches) -> None:
    """Free each veloxpatch cache's capacity past the rows it holds (its
    buffers grow in steps of 256 rows, as mlx-lm's): an entry kept for later
    holds its rows only."""
    for c in caches:
        if hasattr(c, "fit_buffer") and hasattr(c, "phase"):
            c.fit_buffer()
