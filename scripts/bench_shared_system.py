"""Users sharing a system prompt on one server: each sends the same long system
message (a document with a five-digit secret number in it, bench_chat's
documents) with a question of their own, one after another, to a fresh server
per arm; the last user asks for the number. Per user: time to first token and
the prompt tokens the server's prompt cache gave it (usage's cached_tokens);
per document, whether the number came back.

    .venv/bin/python scripts/bench_shared_system.py --documents 3 --users 4 \
        --system-tokens 1500 --out scripts/results/bench_shared_system.json

kvzip is served one request at a time (its reconstruction reads each prompt's
ids), where mlx-lm's server keeps only a request's end in its prompt cache;
`kvzip_compressed_system` is `--compress-system-prompt` (the system prompt
compressed alone, once). `full` and mlx-lm's own server batch, and keep the
system prompt's entry as they read it. Greedy, short answers (`--max-tokens`),
so the time to first token is the prompt's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import bench_chat
import bench_serve

ARMS = {
    "kvzip": ["--algo", "kvzip"],
    "kvzip_compressed_system": ["--algo", "kvzip", "--compress-system-prompt"],
    "full": ["--algo", "full"],
    "mlx_lm_unpatched": None,
}
QUESTIONS = [
    "In one sentence, what is this document about?",
    "Name one keyword the document mentions.",
    "Give the document a short title.",
    "Does the document mention exceptions? Answer yes or no.",
    "What would a beginner find hardest in it?",
]
SYSTEM = "Answer questions about this document.\n{text}"


def measure(arm, doc, args, log_path) -> dict:
    system = SYSTEM.format(text=doc.text)
    users = []
    proc = bench_serve.start(arm, args.port, log_path)
    try:
        for question in [*QUESTIONS[: args.users - 1], bench_chat.CODE_Q]:
            body = {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
            }
            out = bench_serve.stream_chat(args.port, body)
            usage = out["usage"]
            details = usage.get("prompt_tokens_details") or {}
            users.append(
                {
                    "ttft_s": out["ttft_s"],
                    "prompt_tokens": usage.get("prompt_tokens"),
                    "cached_tokens": details.get("cached_tokens"),
                    "reply": "".join(out["parts"]),
                }
            )
    finally:
        proc.kill()
        proc.wait()
    later = [u["ttft_s"] for u in users[1:]]
    return {
        "arm": arm,
        "document": doc.index,
        "depth": doc.depth,
        "number_correct": bench_chat.code_correct(doc.key, users[-1]["reply"]),
        "users": users,
        "ttft_s_first": users[0]["ttft_s"],
        "ttft_s_later_median": statistics.median(later) if later else None,
        "cached_tokens_later": [u["cached_tokens"] for u in users[1:]],
        "system_read_once": "the system prompt's" in log_path.read_text(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--documents", type=int, default=3)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--port", type=int, default=18779)
    ap.add_argument("--out", default="scripts/results/bench_shared_system.json")
    args = ap.parse_args()
    if not 2 <= args.users <= len(QUESTIONS) + 1:
        ap.error(f"--users must be 2 to {len(QUESTIONS) + 1}")

    import veloxpatch
    from veloxpatch.eval.runinfo import run_info, write_results

    info = run_info()
    bench_serve.ARMS.update(ARMS)
    _, tokenizer = veloxpatch.load()
    docs = bench_chat.documents(
        tokenizer, args.documents, args.system_tokens, "evaluation", args.seed
    )
    rows = []
    log_path = Path(tempfile.mkdtemp()) / "server.log"  # one server at a time
    for doc in docs:
        for arm in args.arms.split(","):  # interleaved, so drift hits every arm
            row = measure(arm, doc, args, log_path)
            rows.append(row)
            print(
                f"doc {doc.index} {arm:<24} TTFT first {row['ttft_s_first']:6.2f} "
                f"s, later (median) {row['ttft_s_later_median']:6.2f} s; cached "
                f"later {row['cached_tokens_later']}; number {row['number_correct']}",
                flush=True,
            )
    write_results(args.out, {"run": info, "config": vars(args), "table": rows})


if __name__ == "__main__":
    main()
