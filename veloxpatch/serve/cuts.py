"""Requests cut short: their client left, or the server is stopping.

A request's thread spends its life in mlx-lm's `ResponseGenerator.
_await_response`, waiting for the next item the generation thread puts on its
queue (its context, prompt progress, tokens). `CuttableGenerator` waits there
in short slices and, between them, looks whether the client closed its socket
or a signal asked the server to stop; then it raises `Cut` in that thread.
mlx-lm's handler stops the request's generation (`ctx.stop()`) on the way out
and ours answers what is left to answer and gives back the KV reservation.

Without this, a client that left mid-answer keeps the generation (and its KV
reservation) going until max_tokens when it is not streaming, and mlx-lm
stops on Ctrl-C only after its generation thread ends its loop, leaving
requests without an answer; SIGTERM killed the server outright.
"""

from __future__ import annotations

import logging
import select
import signal
import socket
import threading
import time
from contextlib import contextmanager
from queue import Empty

from mlx_lm.server import GenerationContext, Response, ResponseGenerator

log = logging.getLogger("veloxpatch.serve")

CLIENT_GONE = "client disconnected"
STOPPING = "server shutting down"


class Cut(BaseException):
    """Ends a request's thread early. A BaseException so that mlx-lm's
    `except Exception` around `generate` (which answers 404) lets it through."""

    def __init__(self, reason: str, tokens: int, status: int = 503):
        super().__init__(reason)
        self.reason, self.tokens, self.status = reason, tokens, status


def client_gone(sock) -> bool:
    """True once the peer has closed its end: the socket reads as EOF (or
    fails). A request is read whole before generation, so a live client
    sends nothing more and the socket is simply not readable."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        if not poller.poll(0):
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class Watch:
    """One request's thread: how to see its client leave, what it has had."""

    def __init__(self, gone):
        self.gone = gone
        self.left = False
        self.ctx = None
        self.tokens = 0


class CuttableGenerator(ResponseGenerator):
    """mlx-lm's ResponseGenerator whose waiting threads can be cut (module doc)."""

    POLL_S = 0.05  # how often a waiting request looks at its client and the signal

    def __init__(self, *args, **kwargs):
        self.stopping = threading.Event()
        self._local = threading.local()
        self._watched = 0
        self._count_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    @contextmanager
    def watching(self, gone):
        """Watch the calling thread's request; `gone()` says its client left."""
        watch = Watch(gone)
        self._local.watch = watch
        with self._count_lock:
            self._watched += 1
        try:
            yield watch
        finally:
            self._local.watch = None
            with self._count_lock:
                self._watched -= 1

    def _await_response(self, response_queue):
        watch = getattr(self._local, "watch", None)
        while True:
            if self.stopping.is_set():
                raise Cut(STOPPING, watch.tokens if watch else 0)
            if watch is not None and not watch.left and watch.gone():
                watch.left = True
            # before its context arrives the request cannot be stopped: wait
            # for it (the generation thread sends it first), then stop it
            if watch is not None and watch.left and watch.ctx is not None:
                raise Cut(CLIENT_GONE, watch.tokens)
            try:
                item = response_queue.get(timeout=self.POLL_S)
            except Empty:
                if not self.generation_available():
                    raise RuntimeError("generation thread died") from None
                continue
            if watch is not None:
                if isinstance(item, GenerationContext):
                    watch.ctx = item
                    if watch.left:
                        item.stop()
                        raise Cut(CLIENT_GONE, 0)
                elif isinstance(item, Response):
                    watch.tokens += 1
            return item

    def stop_and_join(self, grace_s: float = 2.0):
        """mlx-lm calls this once serving stops: cut every request (each
        thread answers its client), then stop the generation thread, waiting
        at most `grace_s` in all; `run` exits even if a step still runs.
        Answers get all but the last 0.5 s: on a loaded machine a request's
        thread took longer than 0.5 s to answer, and its client saw the
        connection dropped instead of the 503."""
        deadline = time.monotonic() + grace_s
        self.stopping.set()
        while self._watched and time.monotonic() < deadline - 0.5:
            time.sleep(0.01)
        self._stop = True
        self._generation_thread.join(max(0.0, deadline - time.monotonic()))

    def busy(self) -> bool:
        return self._generation_thread.is_alive()


def stop_on_signals() -> None:
    """SIGTERM and SIGINT stop the server the way mlx-lm stops on Ctrl-C (a
    KeyboardInterrupt out of `serve_forever`, then `stop_and_join`). Later
    signals are only logged: the stop is bounded already, and `timeout` or a
    service manager may send the same signal twice."""

    def again(signum, frame):
        log.info("%s: already stopping", signal.Signals(signum).name)

    def first(signum, frame):
        signal.signal(signal.SIGTERM, again)
        signal.signal(signal.SIGINT, again)
        log.info("%s: stopping", signal.Signals(signum).name)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, first)
    signal.signal(signal.SIGINT, first)
