"""A document remembered across a restart (`serve --prompt-cache-dir`), and a
retry: turn 1 (a ~1,500-token document and a question) on a fresh server writing
to an empty directory, then the same request again (a client's retry); the
server is killed and started again on the same directory; turn 2 (a follow-up
question on the same document). Reports the times to first token, cached_tokens,
whether the retry's text is the first's, the directory's bytes after turn 1, and
what `mlx_lm.cache_prompt` writes for turn 1's prompt (the same document,
uncompressed; its steps run here, on the model the server loads). Writes JSON
and its table beside it.

    .venv/bin/python scripts/bench_disk_cache.py --budget 256 --context-tokens 1500 \
        --out scripts/results/bench_disk_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import bench_chat
import bench_serve

Q1 = "In one sentence, what is this document about?"
Q2 = "Give the document a short title."


def turn(port, messages, max_tokens) -> dict:
    out = bench_serve.stream_chat(
        port, {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    )
    details = out["usage"].get("prompt_tokens_details") or {}
    return {
        "ttft_s": out["ttft_s"],
        "prompt_tokens": out["usage"].get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens"),
        "reply": "".join(out["parts"]),
    }


def served(arm, port, log_path, messages, max_tokens, retry=False):
    """One turn on a fresh server (and, with `retry`, the same request again),
    waiting for its entry on disk before the server is killed."""
    proc = bench_serve.start(arm, port, log_path)
    try:
        out = turn(port, messages, max_tokens)
        if retry:
            out = (out, turn(port, messages, max_tokens))
        # the generation thread writes the entry after the answer has gone out
        deadline = time.monotonic() + 120
        while "on disk: wrote" not in log_path.read_text():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no entry written, see {log_path}")
            time.sleep(0.1)
        return out
    finally:
        proc.kill()  # no clean stop: what is on disk is what a crash leaves
        proc.wait()


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.name.startswith("entry-"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algo", default="kvzip")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--context-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--port", type=int, default=18781)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="scripts/results/bench_disk_cache.json")
    args = ap.parse_args()

    import veloxpatch
    from veloxpatch.eval.runinfo import run_info, write_results

    info = run_info()

    _, tokenizer = veloxpatch.load()
    (doc,) = bench_chat.documents(
        tokenizer, 1, args.context_tokens, "evaluation", args.seed
    )
    tmp = Path(tempfile.mkdtemp())
    entries, log_path = tmp / "entries", tmp / "server.log"
    bench_serve.ARMS["disk"] = [
        "--algo", args.algo, "--budget", str(args.budget),
        "--prompt-cache-dir", str(entries),
    ]  # fmt: skip
    first = bench_chat.first_messages(doc.text, Q1)
    t1, retry = served("disk", args.port, log_path, first, args.max_tokens, retry=True)
    written = dir_bytes(entries)
    second = bench_chat.second_messages(first, t1["reply"], Q2)
    t2 = served("disk", args.port, log_path, second, args.max_tokens)
    loaded = "prompt cache on disk: loaded" in log_path.read_text()
    print(json.dumps({"turn1": t1, "turn2": t2, "written": written}), flush=True)

    # mlx_lm.cache_prompt's steps for turn 1's user message (the same
    # document), on the model as the server loads it (its CLI reads no GGUF)
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

    model, _ = veloxpatch.load()
    messages = [{"role": "user", "content": first[0]["content"]}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    cache = make_prompt_cache(model)
    for _ in generate_step(mx.array(prompt), model, max_tokens=0, prompt_cache=cache):
        pass
    mlx_file = tmp / "mlx_lm_prompt.safetensors"
    save_prompt_cache(str(mlx_file), cache, {"model": "embedded"})
    mlx_bytes = os.path.getsize(mlx_file)

    res = {
        "run": info,
        "config": vars(args),
        "algo": args.algo,
        "budget": args.budget,
        "turn1": t1,
        "retry": retry,
        "retry_ttft_ratio": retry["ttft_s"] / t1["ttft_s"],
        "retry_same_text": retry["reply"] == t1["reply"],
        "turn2_after_restart": t2,
        "loaded_from_disk": loaded,
        "ttft_ratio": t2["ttft_s"] / t1["ttft_s"],
        "disk_bytes_after_turn1": written,
        "mlx_lm_cache_prompt_bytes": mlx_bytes,
        "disk_ratio": written / mlx_bytes,
    }
    print(json.dumps(res, indent=2))
    write_results(args.out, res)
    write_table(args.out, res)


def write_table(out, res: dict) -> None:
    from results_markdown import table, write_beside

    t1, t2, r = res["turn1"], res["turn2_after_restart"], res["retry"]
    rows = [
        ["turn 1, fresh server", f"{t1['ttft_s']:.2f}", t1["cached_tokens"], "1.00"],
        [
            "the same request again (retry)",
            f"{r['ttft_s']:.2f}",
            r["cached_tokens"],
            f"{res['retry_ttft_ratio']:.3f} (same text: {res['retry_same_text']})",
        ],
        [
            "turn 2 after a restart",
            f"{t2['ttft_s']:.2f}",
            t2["cached_tokens"],
            f"{res['ttft_ratio']:.3f} (loaded from disk: {res['loaded_from_disk']})",
        ],
    ]
    body = table(["request", "TTFT s", "cached tokens", "vs turn 1"], rows)
    body += [
        "",
        f"Disk after turn 1: {res['disk_bytes_after_turn1']:,} bytes; "
        f"mlx_lm.cache_prompt's file for the same prompt: "
        f"{res['mlx_lm_cache_prompt_bytes']:,} bytes ({res['disk_ratio']:.3f}x).",
    ]
    serve = f"serve --algo {res['algo']} --budget {res['budget']}"
    title = f"A retry and a document across a restart: {serve}"
    write_beside(out, res, title, body, "scripts/bench_disk_cache.py")


if __name__ == "__main__":
    main()
