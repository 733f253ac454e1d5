"""The server's prompt cache: mlx-lm's `LRUPromptCache`, bounded by what the
`--kv-cap` leaves it, with a trie that keeps an entry's prefixes where
trimming it back could not serve them (`KeepingPromptTrie`), one
least-recently-used order over every kind of entry (`RecencyOrder`), and the
policy of what a finished request leaves for later (`kept_for_later`): never
a cache compressed for its own question.
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

from ..caches import VeloxCache
from ..memory import full_kv_bytes, kv_bytes
from .replay import kept_logits, replay_last_token, revive

log = logging.getLogger("veloxpatch.serve")


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


def _instead(cache, tokens, rest) -> str:
    """What a fetch that passed an entry over serves from instead."""
    if cache is None:
        return "starting over"
    return f"a shorter one holds {len(tokens) - len(rest)} tokens"


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
        self.ledger = None  # admission.KVLedger, whose cap bounds it
        self._handed = None  # keep_system's fetch, for the request it ran for
        self.disk = None  # disk.DiskEntries (--prompt-cache-dir)
        # the key of the server's options, whose entries the disk holds (None:
        # every key's); a request's own budget keys its entries apart
        self.disk_key = None
        # key -> fn(tokens) -> caches: a new request's caches under that key,
        # made for its prompt (a share, a request's own budget); else mlx-lm's
        self.fresh: dict = {}

    def fetch_nearest_cache(self, model, tokens):
        cache, rest = self._nearest(model, tokens)
        if cache is None and model in self.fresh:
            return self.fresh[model](tokens), list(tokens)  # read from the start
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
                _instead(cache, tokens, rest),
            )
        shared = len(tokens) - len(rest)
        why = (
            f"the nearest entry shares {shared} of these {len(tokens)} tokens but "
            "was trimmed past evictions"
        )
        if cache is not None and not rest and tokens:
            # an entry of exactly this prompt (kept_for_later stores prompts):
            # mlx-lm needs a token to prefill, so give the last one back; the
            # model, called through ReplayingModel, replays its kept logits
            if replay_last_token(cache, len(tokens)):
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
            )
        shared = len(tokens) - len(rest)
        if cache is not None and not trimmed_exactly(cache, shared, len(rest)):
            # rows evicted (or statistics taken) after the shared prefix read what
            # followed it (another request's prompt): not reused; a shorter entry
            # (the shared system prompt) is, or the request starts over
            cache, rest = self._shorter_entry(model, tokens)
            log.info("prompt cache: %s; %s", why, _instead(cache, tokens, rest))
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
                new = self.fresh.get(key, lambda _: make_prompt_cache(model))
                cache, start = new(prompt), 0
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
                self.disk.store(
                    tokens, prompt_cache, cache_type, kept_logits(prompt_cache)
                )
            room = self.ledger.prompt_cache_room() if self.ledger else None
            if room is not None and self.nbytes > room:
                self.trim_to(n_bytes=room)

    def _price_logits(self, model, tokens, prompt_cache) -> None:
        """Add the logits an entry keeps (`ReplayingModel`) to its price: mlx-lm
        sums its caches' nbytes only."""
        kept = kept_logits(prompt_cache)
        if kept is None:
            return
        extra = kept[1].nbytes
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
    kept = kept_logits(copies)
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
