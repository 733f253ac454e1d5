"""A `veloxpatch serve` process for a test, and nothing left of it afterwards.

The server runs under `timeout -s KILL` (it stops by itself if the test
process dies) in a new session, so the whole process group (timeout and the
server) is killed at the end, and the end checks that no live process of that
group remains.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after "pid (comm)": state, parent, group, ..."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _parent(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group. Zombies are done: they
    wait for a parent (here possibly a PID 1 that never reaps) to collect
    them."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except ProcessLookupError:
            return []
    members = []
    for entry in os.listdir("/proc"):
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


@dataclass
class Server:
    url: str
    log: Path
    proc: subprocess.Popen  # `timeout`, the group's leader

    @property
    def pid(self) -> int:
        """The server's own process: timeout's child. The group may hold more
        (with a cold kernel cache, mlx's CPU backend runs g++ to compile one)."""
        leader = self.proc.pid
        if os.path.isdir("/proc"):
            pids = [p for p in group_members(leader) if _parent(p) == leader]
        else:  # macOS
            out = subprocess.run(
                ["pgrep", "-P", str(leader)], capture_output=True, text=True
            )
            pids = [int(p) for p in out.stdout.split()]
        assert len(pids) == 1, pids
        return pids[0]

    def post(
        self,
        body,
        *,
        raw: bytes | None = None,
        path="/v1/chat/completions",
        headers_in=None,
    ):
        """(HTTP status, body text); `headers_in` (a threading.Event) is set once
        the status and headers have arrived, before the body is read."""
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                if headers_in is not None:
                    headers_in.set()
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


@contextmanager
def running_server(*args: str, limit_s: int = 150):
    """Start `veloxpatch serve ARGS` on a free loopback port and wait until it
    answers /health; kill its process group at the end."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = ["timeout", "-s", "KILL", str(limit_s), sys.executable, "-m"]
    cmd += ["veloxpatch.cli", "serve", *args]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"server did not start:\n{log.read()}")
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.2)
        yield Server(url, Path(log.name), proc)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # already gone (a test stopped it)
            pass
        proc.wait()
        log.close()
        os.unlink(log.name)
    deadline = time.monotonic() + 5
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_members(proc.pid) == [], "a server process outlived its test"
