"""Chat benchmark: multi-turn, multi-user chat through the HTTP server.

With mlx-lm's prompt cache on (its default), as a chat client uses it:
`veloxpatch serve` with full, snapkv, streaming_llm, kvzip and
expected_attention (budget 256), and mlx-lm's own server on the same embedded
model, unpatched (scripts/bench_serve.py's `serve_unpatched`).

    .venv/bin/python scripts/bench_chat.py --conversations 20 \
        --context-tokens 1500 --out scripts/results/bench_chat.json

Each conversation is a held-out document (~context-tokens of evaluation prose,
never a calibration split) with a seeded five-digit secret number at a depth
cycling through 0.1, 0.3, 0.5, 0.7, 0.9, sent as OpenAI chat messages (no
system message) in two orders, each on its own fresh server per arm:
- needle second: turn 1 asks for a one-sentence summary, the reply goes back
  as the assistant message, turn 2 asks for the number;
- needle first: turn 1 asks for the number, turn 2 for the summary.
The document is the prose alone (no "remember the number" before it), and a
summary that gives the number away is counted: turn 2 could read it there.
Turn 2 should reuse the prompt cache: its `usage.prompt_tokens_details.
cached_tokens` is recorded, with its time to first token (streamed requests)
and the KV bytes the caches held (the servers' "KV held" log lines; the prompt
cache's bytes where the log gives them).

Cross-user check: for the first `--cross-user` documents two users send the
same document as fresh single-turn requests, one asking for the number, one
for the summary, in both orders (one fresh server per order). The answer to
the number must be the same whichever came first: a server that hands one
user's question-specific compression to the other (a prompt-cache entry
trimmed back to the shared document) fails it.

An arm is `ALGO[:key=value,...]` (options sent as `--algo-arg`), e.g.
`kivi:bits=2,recipe=kivi`: quantized rows through the same chat.

Greedy decoding; a number is correct when its five digits appear in the reply
with spaces removed.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import bench_serve
from bench_serve import KV_LINE, serve_unpatched

from veloxpatch.eval.arms import parse_arm, split_arms
from veloxpatch.eval.passkey import INTRO, QUESTION, wilson

ROOT = Path(__file__).resolve().parents[1]
ALGOS = ("full", "snapkv", "streaming_llm", "kvzip", "expected_attention")
KVZAP = "kvzap"  # an arm when asked for, with --scorer
SCORER = "scripts/results/smollm2_kvzap_linear.safetensors"
UNPATCHED = "mlx_lm_unpatched"
UNBUDGETED = ("full", "kivi")  # arms that evict nothing: no --budget
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
CODE_Q = QUESTION.strip()  # the passkey cases' question (SmolLM2 answers it)
SUMMARY_Q = "Summarize the text in one sentence."
ORDERS = ("needle_second", "needle_first")
CROSS_ORDERS = ("code_first", "summary_first")
# veloxpatch serve's per-request line: what the prompt cache held on arrival
REQUEST_LINE = re.compile(r"request: \d+ prompt tokens, .*? prompt cache ([\d,]+)")
# mlx-lm's own cache statistics (both servers; two decimals of a GB)
CACHE_STATS = re.compile(r"Prompt Cache: (\d+) sequences, ([\d.]+) GB")


@dataclass
class Document:
    index: int
    seed: int
    depth: float
    key: str
    text: str  # the prose with the secret number in it


# -- the pure parts (tests/test_bench_chat.py) ----------------------------------


def extract_code(reply: str) -> str | None:
    """The first run of five or more digits in the reply, spaces removed."""
    m = re.search(r"\d{5,}", reply.replace(" ", ""))
    return m.group(0) if m else None


def code_correct(key: str, reply: str) -> bool:
    return key in reply.replace(" ", "")


def user_message(document: str, question: str) -> dict:
    return {"role": "user", "content": f"{document}\n\n{question}"}


def first_messages(document: str, question: str) -> list[dict]:
    """Turn 1 (and a cross-user request): the document and a question."""
    return [user_message(document, question)]


def second_messages(first: list[dict], reply: str, question: str) -> list[dict]:
    """Turn 2 as an OpenAI client sends it: turn 1, its reply, the question."""
    return [
        *first,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": question},
    ]


def questions(order: str) -> tuple[str, str]:
    """(turn 1's question, turn 2's) of a conversation order."""
    if order == "needle_second":
        return SUMMARY_Q, CODE_Q
    if order == "needle_first":
        return CODE_Q, SUMMARY_Q
    raise ValueError(order)


def proportion(hits: list[bool]) -> dict:
    n, k = len(hits), sum(hits)
    lo, hi = wilson(k, n)
    return {"correct": k, "cases": n, "wilson95": [lo, hi]}


def cross_user_compare(pairs: list[dict]) -> dict:
    """How many documents got the same answer to the number (and to the
    summary) whichever user came first. Each pair: {"code_first": {"code":
    reply, "summary": reply}, "summary_first": {...}}."""
    code = [p["code_first"]["code"] == p["summary_first"]["code"] for p in pairs]
    summ = [p["code_first"]["summary"] == p["summary_first"]["summary"] for p in pairs]
    return {
        "cross_user_same": sum(code),
        "summary_same": sum(summ),
        "pairs": len(pairs),
    }


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def summarize(arm: str, conversations: dict, pairs: list[dict]) -> dict:
    """One arm's row from its conversations ({order: [conversation]}) and its
    cross-user pairs."""
    second, first = conversations["needle_second"], conversations["needle_first"]
    every = second + first
    turn1 = [c["turns"][0] for c in every]
    turn2 = [c["turns"][1] for c in every]
    reused = [
        t2["cached_tokens"] is not None and t2["cached_tokens"] >= t1["prompt_tokens"]
        for t1, t2 in zip(turn1, turn2)
    ]
    depths = sorted({c["depth"] for c in second})
    return {
        "arm": arm,
        "needle_second_turn2_code": proportion([c["correct"] for c in second]),
        "needle_first_turn1_code": proportion([c["correct"] for c in first]),
        "needle_second_key_in_summary": sum(c["key_in_turn1_reply"] for c in second),
        "needle_second_turn2_code_key_not_in_summary": proportion(
            [c["correct"] for c in second if not c["key_in_turn1_reply"]]
        ),
        "needle_second_by_depth": {
            str(d): proportion([c["correct"] for c in second if c["depth"] == d])
            for d in depths
        },
        "kv_bytes_per_conversation": _mean(t["kv_held_bytes"] for t in turn2),
        "full_kv_bytes_per_conversation": _mean(t["full_kv_bytes"] for t in turn2),
        "kv_bytes_turn1": _mean(t["kv_held_bytes"] for t in turn1),
        "prompt_cache_bytes_max": max(
            (
                t["prompt_cache_bytes"]
                for t in turn1 + turn2
                if t["prompt_cache_bytes"] is not None
            ),
            default=None,
        ),
        "prompt_cache_gb_max": max(
            (
                t["prompt_cache_gb"]
                for t in turn1 + turn2
                if t["prompt_cache_gb"] is not None
            ),
            default=None,
        ),
        "ttft_turn2_s_median": _median(t["ttft_s"] for t in turn2),
        "ttft_turn1_s_median": _median(t["ttft_s"] for t in turn1),
        "cached_tokens_turn2_median": _median(t["cached_tokens"] for t in turn2),
        "prompt_tokens_turn2_median": _median(t["prompt_tokens"] for t in turn2),
        "turn2_reused_turn1": sum(reused),
        "conversations": len(every),
        **cross_user_compare(pairs),
    }


# -- documents ------------------------------------------------------------------


def documents(tokenizer, n: int, context_tokens: int, text: str, seed: int):
    from veloxpatch.eval.passkey import hidden_key

    out = []
    for i in range(n):
        s = seed * 100_003 + i
        depth = DEPTHS[i % len(DEPTHS)]
        key, body = hidden_key(tokenizer, context_tokens, depth, s, text)
        # no "I will quiz you about the number" before the document: told
        # that, SmolLM2 answers the summary request with the number, and the
        # number then sits in the assistant message turn 2 reads (seen in a smoke run)
        out.append(Document(i, s, depth, key, body.removeprefix(INTRO)))
    return out


# -- servers --------------------------------------------------------------------


def server_command(arm: str, budget: int, port: int, scorer=SCORER) -> list[str]:
    """`ALGO[:key=value,...]`: the options go to the server as --algo-arg;
    `--budget` to every algorithm that evicts."""
    if arm == UNPATCHED:
        return [sys.executable, __file__, "--serve-unpatched", str(port)]
    algo, _, rest = arm.partition(":")
    if algo not in (*ALGOS, KVZAP, *UNBUDGETED):
        known = ", ".join((*ALGOS, KVZAP, *UNBUDGETED, UNPATCHED))
        raise SystemExit(f"unknown arm {arm!r}: {known}[:key=value,...]")
    cmd = [sys.executable, "-m", "veloxpatch.cli", "serve", "--algo", algo]
    if algo not in UNBUDGETED:
        cmd += ["--budget", str(budget)]
    options = [o for o in rest.split(",") if o]
    if algo == KVZAP and not any(o.startswith("scorer=") for o in options):
        options.append(f"scorer={scorer}")
    for option in options:
        cmd += ["--algo-arg", option]
    return cmd + ["--host", "127.0.0.1", "--port", str(port)]


def row_label(arm: str, scorer=SCORER) -> str:
    """The arm's name in the table: kvzap with another scorer than the
    default one is a row of its own."""
    if arm == KVZAP and Path(scorer) != Path(SCORER):
        return f"{KVZAP}:scorer={Path(scorer).name}"
    return arm


def server_label(arm: str, budget: int, scorer=SCORER) -> str:
    if arm == UNPATCHED:
        return "mlx-lm's server, unpatched (scripts/bench_serve.py serve_unpatched)"
    cmd = server_command(arm, budget, 0, scorer)
    return "veloxpatch serve " + shlex.join(cmd[cmd.index("--algo") : -4])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One running server: chat requests, and what its log said about each."""

    def __init__(self, port: int, log_path: Path):
        self.port, self.log_path = port, log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def chat(self, messages: list[dict], max_tokens: int) -> dict:
        offset = len(self.log())
        out = stream_chat(self.port, messages, max_tokens)
        # the KV line is written by the generation thread as the response ends
        deadline = time.time() + 10
        while True:
            part = self.log()[offset:]
            if KV_LINE.search(part) or time.time() > deadline:
                break
            time.sleep(0.05)
        kv = KV_LINE.search(part)
        req = REQUEST_LINE.search(part)
        stats = CACHE_STATS.search(part)
        out["kv_held_bytes"] = int(kv.group(1).replace(",", "")) if kv else None
        out["full_kv_bytes"] = int(kv.group(2).replace(",", "")) if kv else None
        out["prompt_cache_bytes"] = int(req.group(1).replace(",", "")) if req else None
        out["prompt_cache_gb"] = float(stats.group(2)) if stats else None
        return out


def spawn_server(cmd: list[str], log_path: Path, limit_s) -> subprocess.Popen:
    """`cmd` from the repository root in its own process group, logging to
    `log_path`, under `timeout` so it stops itself after `limit_s` seconds."""
    full = ["timeout", "--kill-after=10", str(int(limit_s)), *cmd]
    with open(log_path, "w") as log:
        return subprocess.Popen(
            full,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            start_new_session=True,
        )


@contextlib.contextmanager
def server(arm: str, args, log_path: Path):
    """A fresh server on a free loopback port, in its own process group (all
    of it killed on the way out), stopping itself after --server-timeout."""
    port = free_port()
    cmd = server_command(arm, args.budget, port, args.scorer)
    proc = spawn_server(cmd, log_path, args.server_timeout)
    try:
        wait_healthy(proc, port, log_path, args.start_timeout)
        srv = Server(port, log_path)
        srv.chat([{"role": "user", "content": "Say hello."}], 4)  # warm-up
        yield srv
    finally:
        stop(proc)


def wait_healthy(proc, port: int, log_path: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    tail = log_path.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"server did not start ({log_path}):\n{tail}")


def stop(proc) -> None:
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
    # the group may outlive its leader (timeout's child)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def stream_chat(port: int, messages: list[dict], max_tokens: int) -> dict:
    """One streamed, greedy chat request: the reply, its time to first token,
    its usage (prompt, completion and cached prompt tokens)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    out = bench_serve.stream_chat(port, body, timeout=900)
    usage = out["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return {
        "text": "".join(out["parts"]),
        "finish_reason": out["finish_reason"],
        "ttft_s": out["ttft_s"],
        "seconds": out["seconds"],
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": details.get("cached_tokens"),
    }


# -- the benchmark --------------------------------------------------------------


def max_tokens_for(question: str, args) -> int:
    return args.max_tokens if question == CODE_Q else args.summary_max_tokens


def conversation(srv: Server, doc: Document, order: str, args) -> dict:
    q1, q2 = questions(order)
    m1 = first_messages(doc.text, q1)
    r1 = srv.chat(m1, max_tokens_for(q1, args))
    r2 = srv.chat(second_messages(m1, r1["text"], q2), max_tokens_for(q2, args))
    code = r2 if q2 == CODE_Q else r1
    return {
        "document": doc.index,
        "seed": doc.seed,
        "depth": doc.depth,
        "key": doc.key,
        "order": order,
        "code_turn": 2 if q2 == CODE_Q else 1,
        "answer": extract_code(code["text"]),
        "correct": code_correct(doc.key, code["text"]),
        # needle second: the summary gave the number away, so turn 2 can read
        # it in the assistant message instead of the document
        "key_in_turn1_reply": q2 == CODE_Q and code_correct(doc.key, r1["text"]),
        "turns": [r1, r2],
    }


def cross_user(srv: Server, doc: Document, order: str, args) -> dict:
    asks = [CODE_Q, SUMMARY_Q] if order == "code_first" else [SUMMARY_Q, CODE_Q]
    out = {}
    for q in asks:
        r = srv.chat(first_messages(doc.text, q), max_tokens_for(q, args))
        out["code" if q == CODE_Q else "summary"] = r
    return out


def run_arm(arm: str, docs: list[Document], args, tmp: Path) -> dict:
    started = time.perf_counter()
    conversations = {}
    for order in ORDERS:
        with server(arm, args, tmp / f"{arm}_{order}.log") as srv:
            conversations[order] = []
            for doc in docs:
                c = conversation(srv, doc, order, args)
                conversations[order].append(c)
                t1, t2 = c["turns"]
                print(
                    f"  {arm} {order} doc {doc.index} depth {doc.depth}: "
                    f"{'right' if c['correct'] else 'wrong'} ({c['answer']}), "
                    f"turn 2 cached {t2['cached_tokens']}/{t2['prompt_tokens']}, "
                    f"TTFT {t1['ttft_s']:.2f} -> {t2['ttft_s']:.2f} s",
                    flush=True,
                )
    runs = {order: [] for order in CROSS_ORDERS}
    for order in CROSS_ORDERS if args.cross_user > 0 else ():
        with server(arm, args, tmp / f"{arm}_{order}.log") as srv:
            runs[order] = [
                cross_user(srv, d, order, args) for d in docs[: args.cross_user]
            ]
    pairs = []
    for i, doc in enumerate(docs[: args.cross_user]):
        pair = {o: {k: r["text"] for k, r in runs[o][i].items()} for o in CROSS_ORDERS}
        pairs.append(
            {
                "document": doc.index,
                "key": doc.key,
                **pair,
                "code_same": pair["code_first"]["code"]
                == pair["summary_first"]["code"],
                "correct": {
                    o: code_correct(doc.key, pair[o]["code"]) for o in CROSS_ORDERS
                },
                "requests": runs_of(runs, i),
            }
        )
    row = summarize(arm, conversations, pairs)
    row["server"] = server_label(arm, args.budget, args.scorer)
    row["seconds"] = time.perf_counter() - started
    row["conversation_records"] = conversations
    row["cross_user_records"] = pairs
    return row


def runs_of(runs: dict, i: int) -> dict:
    """The cross-user requests' records without their text (kept above)."""
    return {
        o: {
            k: {f: v for f, v in r.items() if f != "text"}
            for k, r in runs[o][i].items()
        }
        for o in runs
    }


def check_text(text: str) -> None:
    if "calibration" in text:
        raise SystemExit(f"--text {text}: never a calibration split")
    from veloxpatch.prose import check_source

    check_source(text)


def in_process_parser(doc: str) -> argparse.ArgumentParser:
    """The options of the scripts that run these documents in one process,
    without a server (`chat_turn1_probe.py`, `chat_kept_cache.py`)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--arms", required=True, help="NAME[:key=value,...],...")
    ap.add_argument("--conversations", type=int, default=10, help="documents")
    ap.add_argument("--context-tokens", type=int, default=1500)
    ap.add_argument("--text", default="evaluation")
    ap.add_argument("--budget", type=int, default=256, help="for arms naming none")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    return ap


def in_process_setup(args):
    """(arms, run info, model, tokenizer, documents) for those scripts."""
    check_text(args.text)
    from veloxpatch import blas

    blas.preload()
    import veloxpatch
    from veloxpatch.eval.arms import expand, split_arms
    from veloxpatch.eval.runinfo import run_info

    arms = expand(split_arms(args.arms), budgets=[args.budget])
    info = run_info()
    model, tokenizer = veloxpatch.load()
    docs = documents(
        tokenizer, args.conversations, args.context_tokens, args.text, args.seed
    )
    return arms, info, model, tokenizer, docs


def add_row(table: list, arm: str, field: str, value, hits: list[bool]) -> None:
    """Those scripts' row of an arm: its answers' proportion, printed too."""
    row = {"arm": arm, field: value, **proportion(hits)}
    table.append(row)
    line = f"{arm:<40} {field} {value!s:<14} {row['correct']}/{row['cases']}"
    print(line, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default=",".join((*ALGOS, UNPATCHED)))
    ap.add_argument("--conversations", type=int, default=20, help="documents")
    ap.add_argument("--context-tokens", type=int, default=1500)
    ap.add_argument("--text", default="evaluation", help="a held-out split or file")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=24, help="for the number")
    ap.add_argument("--summary-max-tokens", type=int, default=48)
    ap.add_argument(
        "--cross-user", type=int, default=3, help="documents in the cross-user check"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="scripts/results/bench_chat.json")
    ap.add_argument("--scorer", default=SCORER, help="kvzap's scorer file")
    ap.add_argument(
        "--add",
        action="store_true",
        help="add the arms to --out's table (same documents and settings)",
    )
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument(
        "--server-timeout",
        type=int,
        default=3600,
        help="seconds after which a server stops itself (each serves one order)",
    )
    ap.add_argument("--serve-unpatched", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_unpatched is not None:
        return serve_unpatched(args.serve_unpatched)

    arms = split_arms(args.arms)
    for arm in arms:
        server_command(arm, args.budget, 0, args.scorer)  # unknown arms fail here
        if arm != UNPATCHED:  # and options a server would refuse, before any runs
            from veloxpatch.api import make_options
            from veloxpatch.errors import OptionError

            parsed = parse_arm(arm)
            try:
                make_options(parsed.algo, parsed.options)
            except OptionError as e:
                raise SystemExit(f"arm {arm!r}: {e}") from None
    check_text(args.text)
    command = shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv])

    import veloxpatch
    from veloxpatch.eval.runinfo import run_info, write_results

    info = run_info()
    _, tokenizer = veloxpatch.load()
    docs = documents(
        tokenizer, args.conversations, args.context_tokens, args.text, args.seed
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench_chat_"))
    print(f"server logs in {tmp}", flush=True)
    config = {
        **{k: v for k, v in vars(args).items() if k not in ("serve_unpatched", "add")},
        "depths": list(DEPTHS),
        "code_question": CODE_Q,
        "summary_question": SUMMARY_Q,
        "system_message": None,
        "temperature": 0.0,
    }
    result = {"run": info, "command": command, "config": config, "table": []}
    if args.add:  # the same documents and settings, these arms added (or redone)
        result = added_to(args.out, config, {"run": info, "command": command})
    for arm in arms:
        label = row_label(arm, args.scorer)
        try:
            row = run_arm(arm, docs, args, tmp) | {"arm": label}
        except Exception as e:  # recorded; the other arms still run
            row = {"arm": label, "error": f"{type(e).__name__}: {e}"}
            print(f"{arm}: {row['error']}", flush=True)
        result["table"] = [r for r in result["table"] if r["arm"] != label] + [row]
        if "error" not in row:
            s, f = row["needle_second_turn2_code"], row["needle_first_turn1_code"]
            kv = row["kv_bytes_per_conversation"]
            print(
                f"{arm:<20} needle second {s['correct']}/{s['cases']}, needle first "
                f"{f['correct']}/{f['cases']}, KV/conversation "
                f"{'-' if kv is None else f'{kv / 1e6:.1f} MB'}, turn 2 TTFT "
                f"{row['ttft_turn2_s_median']:.2f} s, cached "
                f"{row['cached_tokens_turn2_median']}, cross-user same "
                f"{row['cross_user_same']}/{row['pairs']} ({row['seconds']:.0f} s)",
                flush=True,
            )
        write_results(args.out, result)  # after every arm: a long run keeps it
        write_markdown(args.out, result)


def write_markdown(out, res: dict):
    """The run's table beside its results file (`.md`)."""
    from results_markdown import mb, table, write_beside

    def share(p: dict) -> str:
        lo, hi = p["wilson95"]
        return f"{p['correct']}/{p['cases']} [{lo:.2f}, {hi:.2f}]"

    rows = []
    for r in res["table"]:
        if "error" in r:
            rows.append([f"`{r['arm']}`", "failed: " + r["error"].splitlines()[0]])
            rows[-1] += [""] * 5
            continue
        rows.append(
            [
                f"`{r['arm']}`",
                share(r["needle_second_turn2_code"]),
                share(r["needle_first_turn1_code"]),
                mb(r.get("kv_bytes_per_conversation")),
                f"{r['ttft_turn2_s_median']:.2f}",
                r["cached_tokens_turn2_median"],
                f"{r['cross_user_same']}/{r['pairs']}",
            ]
        )
    head = ["arm", "number at turn 2", "number at turn 1", "KV MB/conversation"]
    head += ["turn-2 TTFT s", "turn-2 cached tokens", "cross-user same"]
    title = "Chat through the server: turn 2 asks what turn 1 did not"
    cmd = ".venv/bin/python scripts/bench_chat.py"
    return write_beside(out, res, title, table(head, rows), cmd)


# settings the documents and questions depend on: an added arm must share them
SHARED = (
    "conversations",
    "context_tokens",
    "text",
    "budget",
    "max_tokens",
    "summary_max_tokens",
    "cross_user",
    "seed",
    "depths",
    "code_question",
    "summary_question",
    "temperature",
)


def added_to(path: str, config: dict, run: dict) -> dict:
    """The results in `path`, with `run`'s arms recorded as added to them."""
    import json

    old = json.loads(Path(path).read_text())
    for key in SHARED:
        if old["config"].get(key) != config[key]:
            raise SystemExit(
                f"--add: {path} has {key} {old['config'].get(key)!r}, "
                f"not {config[key]!r}"
            )
    old.setdefault("added", []).append({"arms": config["arms"], **run})
    return old


if __name__ == "__main__":
    main()
