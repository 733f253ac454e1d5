"""Soak benchmark: N simulated chat users against one server for a set time,
recording its memory, every status code and every time to first token.

    .venv/bin/python scripts/bench_soak.py --users 8 --minutes 20 \
        --serve-args "--algo kvzip --budget 256" --out scripts/results/bench_soak.json
    .venv/bin/python scripts/bench_soak.py --users 8 --minutes 20 --arm mlx \
        --out scripts/results/bench_soak.json        # added beside the first run

The server (`veloxpatch serve SERVE_ARGS`, or with `--arm mlx` mlx-lm's own
server on the same embedded model, unpatched: scripts/bench_serve.py's
`serve_unpatched`) starts on 127.0.0.1 in its own process group, stopped by
`timeout` if this script dies, and the whole group is killed at the end.
Each user loops over a seeded mix, all greedy and streamed:
- new: a document of --doc-tokens-min to --doc-tokens-max tokens (about four
  characters a token) of held-out prose from a seeded place, and a question;
- followup: the conversation so far, its last reply, another question;
- retry: the last finished request sent again (is the text the same?);
- disconnect: a new document or follow-up, the socket closed at the first
  content chunk;
- bad: a malformed body or a bad field, which should get a 4xx.
Every --sample-s seconds: the server group's RSS (the sum of VmRSS over its
processes) and, from veloxpatch's /health, the KV reserved by requests in
flight and the prompt cache's bytes. Summary: RSS at each quarter of the run,
RSS max/min after the first quarter (flat: within 10%), the last quarter's
RSS peak over the second's (growth), status counts per kind,
TTFT p50/p90/p99 (time to the first content chunk), and a PNG of the samples
(matplotlib, the `plot` extra; without it the plot is skipped with a note).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("new", "followup", "retry", "disconnect", "bad")
# the mix once a user has a conversation (the first request is always "new")
WEIGHTS = {"new": 0.25, "followup": 0.35, "retry": 0.15, "disconnect": 0.1}
WEIGHTS["bad"] = 0.15
MAX_TURNS = 4  # a conversation's user turns before the user opens a new document
CHARS_PER_TOKEN = 4
QUESTIONS = (
    "Summarize the text in one sentence.",
    "What is the main point of the text?",
    "List two terms the text defines.",
)
FOLLOWUPS = (
    "Give one detail from the text that supports that.",
    "Say it again in simpler words.",
    "What would a reader ask next about it?",
    "Name one thing the text does not explain.",
)
# bodies a server must refuse with a 4xx (raw bytes: some are not JSON)
BAD_BODIES = (
    b'{"messages": [{"role": "user", "content": "hi"}',  # cut short
    b"not json at all",
    json.dumps({"messages": [], "max_tokens": 8}).encode(),
    json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}
    ).encode(),
    json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}
    ).encode(),
)


# -- the summary (tests/test_bench_soak.py) -------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the closest ranks (numpy's
    default); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def value_at(samples: list[dict], t: float, key: str):
    """The last sample's `key` at or before `t` seconds (the first if none)."""
    before = [s for s in samples if s["t"] <= t and s.get(key) is not None]
    if before:
        return before[-1][key]
    after = [s for s in samples if s.get(key) is not None]
    return after[0][key] if after else None


def flatness(samples: list[dict], warmup_s: float, key: str = "rss_bytes") -> dict:
    """max/min of `key` over the samples after `warmup_s` (flat: within 10%)."""
    xs = [s[key] for s in samples if s["t"] >= warmup_s and s.get(key) is not None]
    if not xs or min(xs) <= 0:
        return {"max": None, "min": None, "ratio": None, "flat": None}
    ratio = max(xs) / min(xs)
    return {"max": max(xs), "min": min(xs), "ratio": ratio, "flat": ratio <= 1.10}


def peak_growth(samples: list[dict], seconds: float, key: str = "rss_bytes"):
    """The last quarter's peak of `key` over the second quarter's: whether what
    a request holds while it runs (a prompt's prefill, max/min's swing) grows."""

    def peak(a, b):
        xs = [s[key] for s in samples if a <= s["t"] < b and s.get(key) is not None]
        return max(xs, default=None)

    second, last = peak(seconds / 4, seconds / 2), peak(seconds * 3 / 4, seconds + 1)
    return None if not second or last is None else last / second


def expected(record: dict) -> bool:
    """A bad request got a 4xx; any other got a 200."""
    status = record["status"]
    if record["kind"] == "bad":
        return isinstance(status, int) and 400 <= status < 500
    return status == 200


def summarize(samples: list[dict], records: list[dict], seconds: float) -> dict:
    """One run's numbers from its samples and request records."""
    quarters = [seconds * k / 4 for k in (1, 2, 3, 4)]
    by_kind = {
        kind: dict(Counter(str(r["status"]) for r in records if r["kind"] == kind))
        for kind in KINDS
    }
    ttft = [r["ttft_s"] for r in records if r.get("ttft_s") is not None]
    ttft_kind = {
        kind: percentile(
            [r["ttft_s"] for r in records if r["kind"] == kind and r.get("ttft_s")], 50
        )
        for kind in KINDS
        if kind != "bad"
    }
    retries = [r for r in records if r.get("same_text") is not None]

    def peak(key):
        return max((s[key] for s in samples if s.get(key) is not None), default=None)

    return {
        "seconds": seconds,
        "requests": len(records),
        "statuses": dict(Counter(str(r["status"]) for r in records)),
        "statuses_by_kind": by_kind,
        "unexpected": sum(not expected(r) for r in records),
        "ttft_s": {f"p{q}": percentile(ttft, q) for q in (50, 90, 99)},
        "ttft_s_p50_by_kind": ttft_kind,
        "retries_same_text": f"{sum(r['same_text'] for r in retries)}/{len(retries)}",
        "rss_at": [
            {
                "minutes": round(t / 60, 2),
                "rss_bytes": value_at(samples, t, "rss_bytes"),
            }
            for t in quarters
        ],
        "rss_after_warmup": flatness(samples, quarters[0]),
        "rss_peak_growth": peak_growth(samples, seconds),
        "rss_max_bytes": peak("rss_bytes"),
        "reserved_max_bytes": peak("reserved_bytes"),
        "prompt_cache_max_bytes": peak("prompt_cache_bytes"),
    }


# -- the server ----------------------------------------------------------------


def server_command(arm: str, serve_args: str, port: int) -> list[str]:
    if arm == "mlx":
        return [sys.executable, __file__, "--serve-unpatched", str(port)]
    cmd = [sys.executable, "-m", "veloxpatch.cli", "serve", *shlex.split(serve_args)]
    return cmd + ["--host", "127.0.0.1", "--port", str(port)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], port: int, log_path: Path, limit_s: float, wait_s):
    """`cmd` in its own process group under `timeout` (it stops itself after
    `limit_s` if this script cannot), once /health answers 200."""
    from bench_chat import spawn_server

    proc = spawn_server(cmd, log_path, limit_s)
    try:
        deadline = time.time() + wait_s
        while time.time() < deadline and proc.poll() is None:
            if health(port) is not None:
                return proc
            time.sleep(0.5)
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"server did not start ({log_path}):\n{tail}")
    except BaseException:
        stop_server(proc)
        raise


def stop_server(proc) -> None:
    """SIGTERM to the whole group, SIGKILL to what is left."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # the group may outlive its leader (timeout's child)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def health(port: int) -> dict | None:
    """/health's JSON when it answers 200, else None."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
    except (OSError, http.client.HTTPException):
        return None
    if resp.status != 200:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return {}


def group_rss(pgid: int) -> int | None:
    """The sum of VmRSS (bytes) over the processes of group `pgid`."""
    total, found = 0, False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for line in Path(f"/proc/{entry}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    found = True
        except (OSError, ValueError, IndexError):
            continue  # a process that ended while read
    return total if found else None


def sample(pgid: int, port: int, t: float) -> dict:
    vp = (health(port) or {}).get("veloxpatch") or {}
    return {
        "t": round(t, 2),
        "rss_bytes": group_rss(pgid),
        "reserved_bytes": vp.get("reserved_bytes"),
        "prompt_cache_bytes": vp.get("prompt_cache_bytes"),
        "prompt_cache_entries": vp.get("prompt_cache_entries"),
        "requests_in_flight": vp.get("requests_in_flight"),
    }


# -- the users -----------------------------------------------------------------


def paragraphs(text: str) -> list[str]:
    from veloxpatch.prose import prose

    return [p for p in prose(text).split("\n") if p.strip()]


def document(paras: list[str], rng: random.Random, lo: int, hi: int) -> str:
    """Consecutive paragraphs from a seeded place, about lo..hi tokens."""
    chars = rng.randint(lo, hi) * CHARS_PER_TOKEN
    i = rng.randrange(len(paras))
    out, n = [], 0
    while n < chars:
        p = paras[i % len(paras)]
        out.append(p[: chars - n])
        n += len(out[-1]) + 1
        i += 1
    return "\n".join(out)


def stream(port: int, body: bytes, timeout: float, cut: bool = False) -> dict:
    """One streamed request: its status (or exception class), TTFT and text.
    `cut`: close the socket at the first content chunk. `timeout` bounds each
    read and the whole request."""
    start = time.perf_counter()
    out = {"status": None, "ttft_s": None, "text": None}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        out["status"] = resp.status
        if resp.status != 200:
            resp.read()
            return out
        parts = []
        for raw in resp:
            if time.perf_counter() - start > timeout:
                out["status"] = "Timeout"
                return out
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                out["status"] = f"stream error {msg['error'].get('code')}"
                return out
            for choice in msg.get("choices", []):
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if out["ttft_s"] is None:
                        out["ttft_s"] = time.perf_counter() - start
                        if cut:
                            return out
                    parts.append(content)
        out["text"] = "".join(parts)
    except Exception as e:  # recorded: a reset, a timeout, a bad stream
        out["status"] = type(e).__name__
    finally:
        conn.close()
        out["seconds"] = time.perf_counter() - start
    return out


def bad_request(port: int, body: bytes, timeout: float) -> dict:
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        resp.read()
        status = resp.status
    except Exception as e:
        status = type(e).__name__
    finally:
        conn.close()
    return {"status": status, "ttft_s": None, "seconds": time.perf_counter() - start}


class User:
    """One simulated user: a seeded loop of requests until `stop` is set."""

    def __init__(self, index: int, port: int, args, paras, record, stop):
        self.index, self.port, self.args = index, port, args
        self.paras, self.record, self.stop = paras, record, stop
        self.rng = random.Random(args.seed * 1_000_003 + index)
        self.messages: list[dict] = []  # the conversation so far
        self.last = None  # (body, text) of the last finished request

    def choose(self) -> str:
        if not self.messages:
            return "new"
        kinds = list(WEIGHTS)
        kind = self.rng.choices(kinds, [WEIGHTS[k] for k in kinds])[0]
        turns = sum(m["role"] == "user" for m in self.messages)
        if kind == "followup" and turns >= MAX_TURNS:
            return "new"
        if kind == "retry" and self.last is None:
            return "followup"
        return kind

    def body(self, messages: list[dict]) -> bytes:
        return json.dumps(
            {
                "messages": messages,
                "max_tokens": self.args.max_tokens,
                "temperature": 0.0,
                "stream": True,
            }
        ).encode()

    def new_messages(self) -> list[dict]:
        a = self.args
        doc = document(self.paras, self.rng, a.doc_tokens_min, a.doc_tokens_max)
        question = self.rng.choice(QUESTIONS)
        return [{"role": "user", "content": f"{doc}\n\n{question}"}]

    def followup_messages(self) -> list[dict]:
        return [*self.messages, {"role": "user", "content": self.rng.choice(FOLLOWUPS)}]

    def step(self) -> None:
        kind = self.choose()
        timeout = self.args.request_timeout
        started = time.time()
        if kind == "bad":
            out = bad_request(self.port, self.rng.choice(BAD_BODIES), timeout)
        elif kind == "retry":
            body, text = self.last
            out = stream(self.port, body, timeout)
            if out["status"] == 200:
                out["same_text"] = out["text"] == text
        else:
            if kind == "disconnect":
                fresh = not self.messages or self.rng.random() < 0.5
            else:
                fresh = kind == "new"
            messages = self.new_messages() if fresh else self.followup_messages()
            body = self.body(messages)
            out = stream(self.port, body, timeout, cut=kind == "disconnect")
            if kind != "disconnect" and out["status"] == 200:
                reply = {"role": "assistant", "content": out["text"]}
                self.messages = [*messages, reply]
                self.last = (body, out["text"])
        out.pop("text", None)
        self.record({"user": self.index, "kind": kind, "start": started, **out})

    def run(self) -> None:
        while not self.stop.is_set():
            self.step()


# -- one run -------------------------------------------------------------------


def soak(cmd: list[str], port: int, args, log_path: Path) -> dict:
    """Start the server, run the users for --minutes while sampling, stop it
    (always, the whole group); the run's summary, samples and requests."""
    seconds = args.minutes * 60
    limit = args.start_timeout + seconds + args.drain_s + 60
    proc = start_server(cmd, port, log_path, limit, args.start_timeout)
    records: list[dict] = []
    lock = threading.Lock()
    closed = threading.Event()  # requests ending after the server stops are not kept

    def record(r):
        with lock:
            if not closed.is_set():
                r["start"] = round(r["start"] - t0, 2)
                records.append(r)

    try:
        paras = paragraphs(args.text)
        stop = threading.Event()
        t0 = time.time()
        samples = [sample(proc.pid, port, 0.0)]
        users = [User(i, port, args, paras, record, stop) for i in range(args.users)]
        threads = [threading.Thread(target=u.run, daemon=True) for u in users]
        for t in threads:
            t.start()
        next_at = t0 + args.sample_s
        while time.time() < t0 + seconds:
            time.sleep(max(0.0, min(next_at, t0 + seconds) - time.time()))
            if time.time() >= next_at:
                samples.append(sample(proc.pid, port, time.time() - t0))
                next_at += args.sample_s
        stop.set()  # no new requests; the ones in flight may finish
        samples.append(sample(proc.pid, port, time.time() - t0))
        drain_until = time.time() + args.drain_s
        for t in threads:
            t.join(timeout=max(0.0, drain_until - time.time()))
        with lock:
            closed.set()
            unfinished = sum(t.is_alive() for t in threads)
            kept = list(records)
    finally:
        stop_server(proc)
    summary = summarize(samples, kept, seconds)
    summary["unfinished_at_end"] = unfinished
    return {**summary, "samples": samples, "records": kept}


def arm_label(arm: str, serve_args: str) -> str:
    if arm == "mlx":
        return "mlx_lm.server (unpatched)"
    return "veloxpatch serve " + serve_args


# -- results -------------------------------------------------------------------


def write_plot(out, res: dict) -> str | None:
    """A PNG beside `out` of every arm's samples; None (and a note in `res`)
    when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        res["plot"] = "skipped: matplotlib is not installed (the `plot` extra)"
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for row in res["table"]:
        if "samples" not in row:
            continue
        ts = [s["t"] / 60 for s in row["samples"]]

        def mb(key, samples=row["samples"]):
            return [None if s.get(key) is None else s[key] / 1e6 for s in samples]

        top.plot(ts, mb("rss_bytes"), label=row["arm"])
        if any(v is not None for v in mb("prompt_cache_bytes")):
            bottom.plot(ts, mb("reserved_bytes"), label=f"{row['arm']}: KV reserved")
            bottom.plot(
                ts, mb("prompt_cache_bytes"), label=f"{row['arm']}: prompt cache"
            )
    top.set_ylabel("server RSS (MB)")
    bottom.set_ylabel("MB (/health)")
    bottom.set_xlabel("minutes")
    top.legend(fontsize=8)
    bottom.legend(fontsize=8)
    top.set_title("Soak: server memory over time")
    path = str(Path(out).with_suffix(".png"))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    res["plot"] = Path(path).name
    return path


def write_markdown(out, res: dict):
    """The runs side by side beside the results file (`.md`)."""
    from results_markdown import mb, table, write_beside

    def pct(r, q):
        v = r["ttft_s"][f"p{q}"]
        return "" if v is None else f"{v:.2f}"

    rows = []
    for r in res["table"]:
        if "error" in r:
            rows.append([f"`{r['arm']}`", "failed: " + r["error"].splitlines()[0]])
            continue
        flat = r["rss_after_warmup"]
        growth = r.get("rss_peak_growth") or peak_growth(r["samples"], r["seconds"])
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items()))
        rows.append(
            [
                f"`{r['arm']}`",
                r["users"],
                f"{r['seconds'] / 60:.0f}",
                " / ".join(mb(q["rss_bytes"]) for q in r["rss_at"]),
                "" if flat["ratio"] is None else f"{flat['ratio']:.3f}",
                "" if growth is None else f"{growth:.3f}",
                mb(r.get("reserved_max_bytes")),
                mb(r.get("prompt_cache_max_bytes")),
                r["requests"],
                statuses,
                r["unexpected"],
                pct(r, 50),
                pct(r, 90),
                pct(r, 99),
                retry_over_new(r.get("ttft_s_p50_by_kind") or {}),
                r["retries_same_text"],
            ]
        )
    head = ["server", "users", "minutes", "RSS MB at each quarter"]
    head += ["RSS max/min after 1st quarter", "RSS peak, 4th quarter / 2nd"]
    head += ["KV reserved max MB"]
    head += ["prompt cache max MB", "requests", "statuses", "unexpected"]
    head += ["TTFT p50 s", "TTFT p90 s", "TTFT p99 s"]
    head += ["TTFT p50 retry / new document s", "retries same text"]
    body = table(head, rows)
    body += [
        "",
        "Unexpected: a bad request answered other than 4xx, or any other request "
        "answered other than 200 (a status, an exception class, `Timeout`).",
    ]
    runs = [r for r in res["table"] if r.get("command")]
    if len(runs) > 1:
        body += ["", "Each server's run:", ""]
        body += [f"- `{r['arm']}`: `{r['command']}`" for r in runs]
    if res.get("plot"):
        plot = res["plot"]
        body += ["", f"![memory over time]({plot})" if plot.endswith(".png") else plot]
    title = "Soak: simulated users against one server"
    return write_beside(out, res, title, body, ".venv/bin/python scripts/bench_soak.py")


def retry_over_new(p50: dict) -> str:
    """A retry's first token against a new document's (p50s, and their ratio)."""
    retry, new = p50.get("retry"), p50.get("new")
    if retry is None or not new:
        return ""
    return f"{retry:.2f} / {new:.2f} ({retry / new:.2f}x)"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=("veloxpatch", "mlx"), default="veloxpatch")
    ap.add_argument(
        "--serve-args",
        default="--algo kvzip --budget 256",
        help="veloxpatch serve's flags (not --host/--port)",
    )
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--minutes", type=float, default=20)
    ap.add_argument("--sample-s", type=float, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--doc-tokens-min", type=int, default=300)
    ap.add_argument("--doc-tokens-max", type=int, default=1500)
    ap.add_argument("--text", default="evaluation", help="a held-out split or file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument(
        "--drain-s",
        type=float,
        default=300,
        help="after the run, seconds the requests in flight may take to finish",
    )
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--out", default="scripts/results/bench_soak.json")
    ap.add_argument("--add", action="store_true", help="add this run to --out's table")
    ap.add_argument("--serve-unpatched", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_unpatched is not None:
        return args
    checks = (
        (args.users >= 1, "--users must be at least 1"),
        (args.minutes > 0, "--minutes must be more than 0"),
        (args.sample_s > 0, "--sample-s must be more than 0"),
        (args.max_tokens >= 1, "--max-tokens must be at least 1"),
        (
            0 < args.doc_tokens_min <= args.doc_tokens_max,
            "--doc-tokens-min must be more than 0 and at most --doc-tokens-max",
        ),
        (args.request_timeout > 0, "--request-timeout must be more than 0"),
        (args.drain_s >= 0, "--drain-s must be at least 0"),
    )
    for ok, message in checks:
        if not ok:
            ap.error(message)
    if "calibration" in args.text:
        ap.error(f"--text {args.text}: never a calibration split")
    if any(f in shlex.split(args.serve_args) for f in ("--host", "--port")):
        ap.error("--serve-args must not set --host or --port (loopback, a free port)")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.serve_unpatched is not None:
        from bench_serve import serve_unpatched

        return serve_unpatched(args.serve_unpatched)
    from veloxpatch.errors import OptionError
    from veloxpatch.prose import check_source

    try:
        check_source(args.text)
    except OptionError as e:
        print(f"bench_soak.py: {e}", file=sys.stderr)
        return 2
    # SIGTERM as Ctrl-C: the finally blocks stop the server's group
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from veloxpatch.eval.runinfo import run_info, write_results

    command = shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv])
    config = {
        k: v for k, v in vars(args).items() if k not in ("serve_unpatched", "add")
    }
    # a second run (--add, or --arm mlx) joins the file's table
    joined = (args.add or args.arm == "mlx") and Path(args.out).is_file()
    old = added_to(args.out, config) if joined else None
    info = run_info()
    res = {"run": info, "command": command, "config": config, "table": []}
    if old is not None:
        res = old
        res.setdefault("added", []).append(
            {"run": info, "command": command, "config": config}
        )
    label = arm_label(args.arm, args.serve_args)
    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="bench_soak_")) / "server.log"
    print(f"{label}: server log {log_path}", flush=True)
    try:
        cmd = server_command(args.arm, args.serve_args, port)
        row = soak(cmd, port, args, log_path)
    except KeyboardInterrupt:  # soak's finally has stopped the server
        print("interrupted: the server is stopped, nothing written", file=sys.stderr)
        return 130
    row = {"arm": label, "users": args.users, "command": command, **row}
    res["table"] = [r for r in res["table"] if r["arm"] != label] + [row]
    write_plot(args.out, res)
    write_results(args.out, res)
    print(write_markdown(args.out, res), flush=True)
    print(report(row), flush=True)
    return 0


# settings the users' requests depend on: runs side by side must share them
SHARED = (
    "users",
    "minutes",
    "sample_s",
    "max_tokens",
    "doc_tokens_min",
    "doc_tokens_max",
    "text",
    "seed",
    "request_timeout",
)


def added_to(path, config: dict) -> dict:
    """The results in `path`, which a run with `config` may join (one line
    and exit status 2 when a shared setting differs)."""
    old = json.loads(Path(path).read_text())
    for key in SHARED:
        if old["config"].get(key) != config[key]:
            print(
                f"bench_soak.py: {path} ran with {key} {old['config'].get(key)!r}, "
                f"not {config[key]!r}: the runs would not be side by side",
                file=sys.stderr,
            )
            raise SystemExit(2)
    return old


def report(row: dict) -> str:
    flat = row["rss_after_warmup"]
    ratio = "-" if flat["ratio"] is None else f"{flat['ratio']:.3f}"
    rss = " / ".join(
        "-" if q["rss_bytes"] is None else f"{q['rss_bytes'] / 1e6:.0f}"
        for q in row["rss_at"]
    )
    ttft = ", ".join(
        f"{k} {'-' if v is None else f'{v:.2f}'}" for k, v in row["ttft_s"].items()
    )
    return (
        f"{row['arm']}: {row['requests']} requests {row['statuses']}, unexpected "
        f"{row['unexpected']}, unfinished at end {row['unfinished_at_end']}; "
        f"RSS MB at quarters {rss}, max/min after warm-up {ratio}; TTFT s {ttft}; "
        f"retries same text {row['retries_same_text']}"
    )


if __name__ == "__main__":
    sys.exit(main())
