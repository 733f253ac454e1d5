"""`veloxpatch serve --prompt-cache-dir DIR`: the prompt cache's entries on disk.

Every entry the prompt cache keeps (`prompt_cache.BoundedPromptCache.insert_cache`) is
also written to DIR as `entry-<hash>.safetensors` in the project's cache file
format (`caches.io.save_cache`: checksummed, written to a temporary name in DIR
and renamed), with what made it (`identity`: the served model, a hash of its
fingerprint, the algorithm and its options), its token ids, its type, and any
last-token logits it keeps (`replay.py`).

A request whose prompt starts with a stored entry's tokens, or shares a start
with a longer entry that can be trimmed back to it (mlx-lm's own fetch rule),
and gets more of its prompt from it than from memory, loads it into the
in-memory prompt cache, which then serves it exactly as an entry kept in
memory. The directory is bounded (`cap` bytes): least recently used files (by
mtime; a load touches its file) are deleted to fit.

Faults are each one log line, and the request is served from scratch: at start
a temporary file (a write cut by kill -9) is removed, and a file whose header
is damaged, or made by another model, algorithm or options, is removed; a
file whose checksum fails when it is loaded is removed; a directory that
cannot be written leaves the server serving from memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from model_adapters.base import fingerprint

from ..caches.io import load_cache, save_cache
from ..errors import CacheFileError, VeloxpatchError
from ..loading.safetensors_header import check_safetensors

log = logging.getLogger("veloxpatch.serve")

FORMAT = "veloxpatch-prompt-cache/1"
ENTRY = re.compile(r"^entry-[0-9a-f]{32}\.safetensors$")
# checked_io writes "<name>.<pid>-<hex>.tmp.safetensors", then renames it
TEMP = re.compile(r"^entry-[0-9a-f]{32}\.safetensors\..*\.tmp\.safetensors$")


def server_identity(provider) -> dict:
    """What an entry must have been made by to be loaded by this server."""
    fp = json.dumps(fingerprint(provider.model), sort_keys=True)
    return {
        "model": provider.served_name(),
        "fingerprint": hashlib.sha256(fp.encode()).hexdigest(),
        "algo": provider.algo,
        "options": json.dumps(provider.patch.options.as_dict(), sort_keys=True),
    }


@dataclass
class Stored:
    tokens: tuple[int, ...]
    size: int
    trimmable: bool


class DiskEntries:
    """The entries of one directory that this server (`identity`) may load,
    and their bytes, bounded by `cap`."""

    def __init__(self, directory, cap: int, identity: dict):
        self.dir = Path(directory)
        self.cap = cap
        self.identity = identity
        self.index: dict[str, Stored] = {}
        self.writable = True
        self._scan()

    # ---- start ---------------------------------------------------------------
    def _scan(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            names = sorted(os.listdir(self.dir))
        except OSError as e:
            self.writable = False
            log.warning(
                "prompt cache on disk: cannot use %s (%s); serving from memory only",
                self.dir,
                e.strerror or e,
            )
            return
        for name in names:
            path = self.dir / name
            if TEMP.match(name):
                self._remove(path, "a partial write (a stopped server's)")
            elif ENTRY.match(name):
                self._index(path)
        if not os.access(self.dir, os.W_OK | os.X_OK):
            self.writable = False
            log.warning(
                "prompt cache on disk: %s is not writable; its entries are read "
                "but new ones are not written",
                self.dir,
            )
        self._evict()
        log.info(
            "prompt cache on disk: %s, %d entries of this model and algorithm, "
            "%s bytes (--prompt-cache-disk-bytes %s)",
            self.dir,
            len(self.index),
            f"{self.nbytes:,}",
            f"{self.cap:,}",
        )

    def _index(self, path: Path) -> None:
        try:
            header = check_safetensors(path, CacheFileError)
            info = json.loads(header.get("__metadata__", {}).get("veloxpatch", ""))
            meta = info["metadata"]
            tokens = meta["tokens"]
            trimmable = meta["trimmable"]
            ok = meta.get("format") == FORMAT and isinstance(tokens, list)
            ok = ok and isinstance(trimmable, bool)
            if not ok or not all(type(t) is int for t in tokens):
                raise ValueError("no prompt-cache entry in its metadata")
            size = path.stat().st_size
        except (VeloxpatchError, ValueError, KeyError, TypeError, OSError) as e:
            self._remove(path, f"damaged ({_reason(e)})")
            return
        if meta.get("identity") != self.identity:
            # removed, as a damaged one: out of the index it would escape the bound
            made_by = _made_by(meta.get("identity"))
            self._remove(path, f"written by another model or algorithm ({made_by})")
            return
        self.index[path.name] = Stored(tuple(tokens), size, trimmable)

    # ---- requests ------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self.index.values())

    def name_for(self, tokens) -> str:
        key = json.dumps([self.identity, list(tokens)], sort_keys=True)
        return f"entry-{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"

    def nearest(self, tokens, longer_than: int) -> str | None:
        """The stored entry that holds the most of `tokens`' start, if more
        than `longer_than`: one whose tokens start them, or a longer one that
        can be trimmed back to what it shares with them (mlx-lm's fetch trims
        it once it is in memory)."""
        best, most = None, longer_than
        tokens = list(tokens)
        for name, s in self.index.items():
            n = _shared(tokens, s.tokens)
            if n > most and (n == len(s.tokens) or s.trimmable):
                best, most = name, n
        return best

    def load(self, name: str):
        """(caches, tokens, cache type, kept logits or None) of a stored entry,
        or None (one log line, the file removed) if it does not load whole."""
        path = self.dir / name
        try:
            caches, meta, extra = load_cache(
                path, return_metadata=True, return_extra=True
            )
            if meta.get("identity") != self.identity or meta.get("format") != FORMAT:
                raise CacheFileError(f"{path}: its metadata changed since start")
            tokens = [int(t) for t in meta["tokens"]]
            logits = extra.get("logits")
            at = meta.get("logits_offset")
            kept = None if logits is None or at is None else (int(at), logits)
            os.utime(path)  # recently used
        except (VeloxpatchError, ValueError, KeyError, TypeError, OSError) as e:
            self.index.pop(name, None)
            self._remove(path, f"not loaded ({_reason(e)})")
            return None
        log.info(
            "prompt cache on disk: loaded %s (%d tokens, %s bytes)",
            name,
            len(tokens),
            f"{self.index[name].size:,}",
        )
        return caches, tokens, str(meta.get("cache_type", "user")), kept

    def store(self, tokens, caches, cache_type: str, kept) -> None:
        """Write an entry the prompt cache keeps (once per token sequence; a
        later keep of the same tokens only marks it recently used)."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        if not self.writable:
            return
        name = self.name_for(tokens)
        path = self.dir / name
        if name in self.index:
            try:
                os.utime(path)
                return
            except OSError:  # removed behind our back: write it again
                self.index.pop(name)
        meta = {
            "format": FORMAT,
            "identity": self.identity,
            "tokens": [int(t) for t in tokens],
            "cache_type": cache_type,
            "trimmable": bool(can_trim_prompt_cache(caches)),
            "logits_offset": None if kept is None else int(kept[0]),
        }
        extra = {} if kept is None else {"logits": kept[1]}
        try:
            save_cache(path, caches, meta, extra)
            size = path.stat().st_size
        except (VeloxpatchError, OSError) as e:
            log.warning("prompt cache on disk: entry not written: %s", _reason(e))
            return
        if size > self.cap:
            self._remove(path, f"its {size:,} bytes exceed the disk cap")
            return
        self.index[name] = Stored(tuple(meta["tokens"]), size, meta["trimmable"])
        log.info(
            "prompt cache on disk: wrote %s (%d tokens, %s bytes)",
            name,
            len(tokens),
            f"{size:,}",
        )
        self._evict()

    def _evict(self) -> None:
        """Delete the least recently used entries until the cap holds."""
        total = self.nbytes
        if total <= self.cap:
            return

        def used(name):
            try:
                return (self.dir / name).stat().st_mtime_ns
            except OSError:
                return 0

        for name in sorted(self.index, key=used):
            if total <= self.cap:
                break
            total -= self.index.pop(name).size
            why = "least recently used, over the disk cap"
            self._remove(self.dir / name, why, logging.INFO)

    def _remove(self, path: Path, why: str, level=logging.WARNING) -> None:
        try:
            path.unlink()
            log.log(level, "prompt cache on disk: removed %s: %s", path.name, why)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning(
                "prompt cache on disk: skipped %s: %s (cannot remove it: %s)",
                path.name,
                why,
                e.strerror or e,
            )


def _shared(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _reason(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def _made_by(identity) -> str:
    if not isinstance(identity, dict):
        return "no identity"
    return f"{identity.get('model')}, {identity.get('algo')} {identity.get('options')}"
