"""Serving throughput: 1, 2, 4, 8 concurrent chat requests with long prompts
against `veloxpatch serve` (snapkv 256, kivi 4-bit, snapkv 256 + kv_bits 4)
and unpatched `mlx_lm.server` on the same embedded model, in the same run.

    .venv/bin/python scripts/bench_serve.py --concurrency 1,2,4,8 \
        --prompt-tokens 1500 --max-tokens 128 --out scripts/results/bench_serve.json

One fresh server per arm and concurrency (so its peak RSS is that level's), a
warm-up request, then N streamed requests at once, each with its own first line
(no shared prefix beyond the chat template's system prompt), end-of-text tokens
banned by logit bias so every answer is max_tokens long in every arm. Per level:
aggregate tokens/s (completion tokens / wall time of the whole wave), time to
first token, KV bytes each request's caches held when it finished and what
mlx-lm's cache would have held (the servers' log lines), the server's peak RSS
(Linux /proc; weights included), its RSS growth over the idle server while
the wave runs (sampled every 0.1 s), and whether the server batched. Each
reader gets its own passage of `--text` (a held-out split or a text file).
The unpatched arm is mlx-lm's own server code (provider, generator, handler,
prompt cache) with the embedded GGUF loaded unpatched (`--serve-unpatched`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from veloxpatch import blas

blas.preload()

ROOT = Path(__file__).resolve().parents[1]
ARMS = {
    "snapkv_256": ["--algo", "snapkv", "--budget", "256"],
    "kivi_4bit": ["--algo", "kivi", "--algo-arg", "bits=4"],
    "snapkv_256_kv4": ["--algo", "snapkv", "--budget", "256"]
    + ["--algo-arg", "kv_bits=4"],
    "auto_12mb": ["--max-kv-bytes", "12MB"],
    "auto_12mb_step1024": ["--max-kv-bytes", "12MB", "--prefill-step-size", "1024"],
    "auto_12mb_step2048": ["--max-kv-bytes", "12MB", "--prefill-step-size", "2048"],
    "kvzip_256": ["--algo", "kvzip", "--budget", "256"],
    "mlx_lm_unpatched": None,
}
KV_LINE = re.compile(r"KV held ([\d,]+) bytes \(a full cache would hold ([\d,]+)\)")


def serve_unpatched(port: int) -> None:
    """mlx-lm's server on the embedded model, unpatched (it loads from a path,
    and the embedded model is a GGUF only veloxpatch loads)."""
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
    from mlx_lm.server import ModelProvider, ResponseGenerator

    from veloxpatch.cli.serve import mlx_server_parser
    from veloxpatch.loading.models import load
    from veloxpatch.memory import full_kv_bytes, kv_bytes
    from veloxpatch.mlx_lm_internals import run_http_server

    class Provider(ModelProvider):
        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            self.model, self.tokenizer = load()
            # as mlx-lm computes it
            self.is_batchable = all(
                hasattr(c, "merge") for c in make_prompt_cache(self.model)
            )
            self.model_key = (model_path, None, None)

    class LoggingCache(LRUPromptCache):  # the same log line as veloxpatch serve
        def insert_cache(self, model, tokens, cache, *, cache_type="assistant"):
            if cache_type == "assistant":
                logging.info(
                    f"KV held {kv_bytes(cache):,} bytes (a full cache would hold "
                    f"{full_kv_bytes(cache):,})"
                )
            super().insert_cache(model, tokens, cache, cache_type=cache_type)

    args = mlx_server_parser().parse_args(["--port", str(port), "--model", "embedded"])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    provider = Provider(args)
    provider.load_default()  # before the generation thread, which then reuses it
    logging.info(f"batchable: {provider.is_batchable}")
    generator = ResponseGenerator(provider, LoggingCache(args.prompt_cache_size))
    run_http_server(args.host, port, generator)


def start(arm: str, port: int, log_path: Path) -> subprocess.Popen:
    # a server left on the port would answer the health check for this one
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        pass
    else:
        raise RuntimeError(f"port {port} is already in use: stop what listens there")
    if ARMS[arm] is None:
        cmd = [sys.executable, __file__, "--serve-unpatched", str(port)]
    else:
        cmd = [sys.executable, "-m", "veloxpatch.cli", "serve", *ARMS[arm]]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
    log = open(log_path, "w")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{arm}: server did not start, see {log_path}")


def stream_chat(port: int, body: dict, timeout: float = 600) -> dict:
    """One streamed chat request (`body` without `stream`): the reply, its time
    to first token, total seconds, finish reason and usage."""
    body = json.dumps(
        {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(
        "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    first, parts, usage, finish = None, [], None, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        msg = json.loads(line[6:])
        usage = msg.get("usage") or usage
        for choice in msg.get("choices", []):
            finish = choice.get("finish_reason") or finish
            content = choice.get("delta", {}).get("content")
            if content:
                first = first or time.perf_counter()
                parts.append(content)
    end = time.perf_counter()
    return {
        "parts": parts,
        "finish_reason": finish,
        "ttft_s": (first or end) - start,
        "seconds": end - start,
        "usage": usage or {},
    }


def request(port: int, prompt: str, max_tokens: int, banned=()) -> dict:
    """One streamed chat request: time to first token, completion tokens.
    `banned` token ids get a logit bias of -100, the most the server takes
    (the end-of-text tokens, so every arm generates exactly max_tokens)."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "logit_bias": {str(t): -100 for t in banned},
        "temperature": 0.0,
    }
    out = stream_chat(port, body)
    usage = out["usage"]
    return {
        "status": 200,
        "ttft_s": out["ttft_s"],
        "seconds": out["seconds"],
        "completion_tokens": usage.get("completion_tokens", len(out["parts"])),
        "prompt_tokens": usage.get("prompt_tokens"),
    }


def wave(port: int, prompts: list[str], max_tokens: int, banned=()):
    results = [None] * len(prompts)

    def one(i):
        results[i] = request(port, prompts[i], max_tokens, banned)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def peak_rss(pid: int, field: str = "VmHWM") -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class RSSSampler(threading.Thread):
    """The most of a process's RSS (VmRSS) every 0.1 s until stopped: the
    wave's peak, apart from the load's (VmHWM holds that one too)."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.most, self.done = pid, 0, threading.Event()

    def run(self):
        while not self.done.wait(0.1):
            self.most = max(self.most, peak_rss(self.pid, "VmRSS") or 0)


def measure(arm, n, prompts, args, port, log_path) -> dict:
    proc = start(arm, port, log_path)
    try:
        request(port, "Say hello.", 4)  # warm-up
        skip = len(KV_LINE.findall(log_path.read_text()))
        idle, sampler = peak_rss(proc.pid, "VmRSS"), RSSSampler(proc.pid)
        sampler.start()
        results, wall = wave(port, prompts[:n], args.max_tokens, args.banned)
        sampler.done.set()
        sampler.join()
        time.sleep(0.5)  # the last log lines
        kv = KV_LINE.findall(log_path.read_text())[skip:]
        rss = peak_rss(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    text = log_path.read_text()
    held = [int(a.replace(",", "")) for a, _ in kv]
    full = [int(b.replace(",", "")) for _, b in kv]
    tokens = sum(r["completion_tokens"] for r in results)
    ttft = [r["ttft_s"] for r in results]
    return {
        "arm": arm,
        "concurrency": n,
        "statuses": [r["status"] for r in results],
        "prompt_tokens": [r["prompt_tokens"] for r in results],
        "completion_tokens": tokens,
        "wall_s": wall,
        "aggregate_tokens_per_s": tokens / wall,
        "ttft_s_median": statistics.median(ttft),
        "ttft_s_max": max(ttft),
        "kv_bytes_per_request": statistics.mean(held) if held else None,
        "full_kv_bytes_per_request": statistics.mean(full) if full else None,
        "peak_rss_bytes": rss,
        "idle_rss_bytes": idle,
        "wave_rss_growth_bytes": sampler.most - idle if idle else None,
        "batched": "one at a time" not in text and "batchable: False" not in text,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--port", type=int, default=18777)
    ap.add_argument(
        "--text", default="evaluation", help="a held-out split or a text file"
    )
    ap.add_argument("--out", default="scripts/results/bench_serve.json")
    ap.add_argument("--serve-unpatched", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_unpatched is not None:
        return serve_unpatched(args.serve_unpatched)

    import veloxpatch
    from veloxpatch.eval.runinfo import run_info, write_results
    from veloxpatch.prose import prose_tokens

    info = run_info()
    levels = [int(x) for x in args.concurrency.split(",")]
    arms = args.arms.split(",")
    _, tokenizer = veloxpatch.load()
    args.banned = sorted(tokenizer.eos_token_ids)  # every answer max_tokens long
    n = args.prompt_tokens  # each reader its own passage of the text
    bodies = [
        tokenizer.decode(prose_tokens(tokenizer, n, args.text, start=i * n))
        for i in range(max(levels))
    ]
    prompts = [
        f"Reader {i + 1}, read this:\n{body}\nSummarize it in one sentence."
        for i, body in enumerate(bodies)
    ]
    rows = []
    log_path = Path(tempfile.mkdtemp()) / "server.log"  # one server at a time
    for n in levels:
        for arm in arms:  # interleaved per level, so drift hits every arm
            row = measure(arm, n, prompts, args, args.port, log_path)
            rows.append(row)
            kv = row["kv_bytes_per_request"]
            print(
                f"{n:>2} {arm:<18} {row['aggregate_tokens_per_s']:7.1f} tok/s  "
                f"TTFT {row['ttft_s_median']:6.2f} s  KV/request "
                f"{'-' if kv is None else f'{kv / 1e6:.1f} MB'}  "
                f"batched {row['batched']}",
                flush=True,
            )
    res = {"run": info, "config": vars(args), "table": rows}
    write_results(args.out, res)
    write_markdown(args.out, res)


def write_markdown(out, res: dict):
    """The run's table beside its results file (`.md`)."""
    from results_markdown import mb, table, write_beside

    rows = [
        [
            f"`{r['arm']}`",
            r["concurrency"],
            f"{r['aggregate_tokens_per_s']:.2f}",
            f"{r['ttft_s_median']:.1f}",
            mb(r.get("kv_bytes_per_request")),
            mb(r.get("full_kv_bytes_per_request")),
            mb(r.get("peak_rss_bytes")),
            mb(r.get("wave_rss_growth_bytes")),
            "yes" if r.get("batched") else "no",
        ]
        for r in res["table"]
    ]
    head = ["arm", "requests", "agg tok/s", "TTFT s", "KV MB/request"]
    head += ["full KV MB", "peak RSS MB", "RSS growth over idle MB", "batched"]
    title = "Serving: concurrent chat requests"
    cmd = ".venv/bin/python scripts/bench_serve.py"
    return write_beside(out, res, title, table(head, rows), cmd)


if __name__ == "__main__":
    main()
