"""A prompt longer than the model's context through `veloxpatch generate`, as a
user runs it: the peak memory each command prints on its stats line (mlx's peak
above what was in use before the prompt: KV cache and activations, not the
weights), against unpatched mlx-lm measured the same way.

Each arm is its own process. The prompt is `--tokens` tokens of evaluation prose
(pydoc) and a question; SmolLM2 was trained on 8,192 tokens, so at 16k only
memory and speed are claimed, not quality.

    .venv/bin/python scripts/long_prompt.py --tokens 16384 --prefill-step 512 \
        --out scripts/results/long_prompt.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATS = re.compile(
    r"prompt (\d+) tok .*prefill ([\d.]+) tok/s .*KV held ([\d,]+) B .*peak ([\d,]+) B"
)
QUESTION = "\n\nIn one sentence, what is the text above about?"

# mlx-lm's own caches, measured as `veloxpatch generate` measures
UNPATCHED = """
import sys
from veloxpatch import blas
blas.preload()
import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache
import veloxpatch
from veloxpatch.loading.models import chat_prompt
model, tok = veloxpatch.load()
prompt = chat_prompt(tok, open(sys.argv[1]).read())
cache = make_prompt_cache(model)
mx.synchronize(); mx.reset_peak_memory(); before = mx.get_active_memory()
for r in stream_generate(model, tok, prompt, max_tokens=int(sys.argv[3]),
                         prefill_step_size=int(sys.argv[2]), prompt_cache=cache):
    pass
kv = sum(c.nbytes for c in cache)
print(f"[unpatched] prompt {r.prompt_tokens} tok | prefill {r.prompt_tps:.1f} tok/s"
      f" | KV held {kv:,} B | peak {mx.get_peak_memory() - before:,} B",
      file=sys.stderr)
"""


def arms(args) -> dict[str, list[str]]:
    step = ["--prefill-step", str(args.prefill_step)]
    gen = [sys.executable, "-m", "veloxpatch.cli", "generate"]
    bytes_ = ["--max-kv-bytes", args.max_kv_bytes]
    chunks = ["--algo-arg", "compress=chunks", "--algo-arg", f"chunk={args.chunk}"]
    snapkv = [*gen, "--algo", "snapkv", *bytes_, *step]
    kv4 = ["--algo-arg", "kv_bits=4"]
    kv2 = ["--algo-arg", "kv_bits=2"]  # its default recipe: rotated, query-rounded
    return {
        "unpatched": [sys.executable, "-c", UNPATCHED],
        "full": [*gen, "--algo", "full", *step],
        "snapkv_prompt_end": snapkv,
        "snapkv_chunks": [*snapkv, *chunks],
        # the same bytes hold 4- or 2-bit rows: more rows, each cheaper
        "snapkv_chunks_kv4": [*snapkv, *chunks, *kv4],
        "snapkv_chunks_kv2": [*snapkv, *chunks, *kv2],
    }


def run_arm(name, cmd, prompt_file, args) -> dict:
    if name == "unpatched":
        cmd = [*cmd, prompt_file, str(args.prefill_step), str(args.max_tokens)]
        stdin = None
    else:
        cmd = [*cmd, "--max-tokens", str(args.max_tokens)]
        stdin = open(prompt_file, "rb")
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, stdin=stdin, capture_output=True, text=True, cwd=ROOT, timeout=3600
    )
    seconds = time.perf_counter() - start
    m = STATS.search(proc.stderr)
    if proc.returncode != 0 or m is None:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    row = {
        "arm": name,
        "command": " ".join(Path(c).name if c == sys.executable else c for c in cmd),
        "prompt_tokens": int(m.group(1)),
        "prefill_tok_s": float(m.group(2)),
        "kv_held_bytes": int(m.group(3).replace(",", "")),
        "peak_bytes": int(m.group(4).replace(",", "")),
        "seconds": round(seconds, 1),
        "reply": proc.stdout.strip()[:200],
    }
    print(
        f"{name:18} peak {row['peak_bytes'] / 1e6:8.1f} MB  "
        f"KV {row['kv_held_bytes'] / 1e6:7.1f} MB  "
        f"prefill {row['prefill_tok_s']:6.1f} tok/s  ({seconds:.0f} s)",
        flush=True,
    )
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--prefill-step", type=int, default=512)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--max-kv-bytes", default="24MB")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--arms", default="unpatched,full,snapkv_prompt_end,snapkv_chunks")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    from veloxpatch import blas

    blas.preload()
    import veloxpatch
    from veloxpatch.eval.runinfo import run_info
    from veloxpatch.prose import prose_tokens

    _, tok = veloxpatch.load()
    text = tok.decode(prose_tokens(tok, args.tokens - 40)) + QUESTION
    out = {"run": run_info(), "config": vars(args) | {"out": str(args.out)}}
    out["table"] = []
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        every = arms(args)
        for name in args.arms.split(","):
            out["table"].append(run_arm(name, every[name], f.name, args))
            # after every arm: an interrupted run keeps what it measured
            args.out.write_text(json.dumps(out, indent=1) + "\n")
    write_markdown(args.out, out)
    print(f"results: {args.out}")


def write_markdown(out, res: dict):
    """The run's table beside its results file (`.md`)."""
    from results_markdown import mb, table, write_beside

    rows = [
        [
            f"`{r['arm']}`",
            f"{r['prompt_tokens']:,}" if "prompt_tokens" in r else "",
            mb(r.get("peak_bytes")),
            mb(r.get("kv_held_bytes")),
            r.get("prefill_tok_s", r.get("error", "")),
        ]
        for r in res["table"]
    ]
    head = ["arm", "prompt tokens", "peak MB", "KV held MB", "prefill tok/s"]
    title = "A prompt past the model's context through `veloxpatch generate`"
    cmd = ".venv/bin/python scripts/long_prompt.py"
    return write_beside(out, res, title, table(head, rows), cmd)


if __name__ == "__main__":
    main()
