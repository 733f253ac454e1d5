"""Turn 1 of the chat benchmark (the number asked in the first message) outside
the server: does a prompt that announces the number change what an arm keeps?

`scripts/bench_chat.py` sends each document without the passkey cases' intro
("There is a secret number hidden inside a long text..."): told that, SmolLM2
answers a summary request with the number. This runs the same first messages
through `mlx_lm.stream_generate` in one process, with and without that intro,
for each arm: a failure that also happens here is not the server's.

    .venv/bin/python scripts/chat_turn1_probe.py --arms full,kvzap:scorer=F \\
        --out scripts/results/chat_turn1_probe.json
"""

from __future__ import annotations

import argparse

import bench_chat as bc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", required=True, help="NAME[:key=value,...],...")
    ap.add_argument("--conversations", type=int, default=10, help="documents")
    ap.add_argument("--context-tokens", type=int, default=1500)
    ap.add_argument("--text", default="evaluation")
    ap.add_argument("--budget", type=int, default=256, help="for arms naming none")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    bc.check_text(args.text)

    from veloxpatch import blas

    blas.preload()
    from mlx_lm import stream_generate

    import veloxpatch
    from veloxpatch.eval.arms import expand, split_arms
    from veloxpatch.eval.passkey import INTRO
    from veloxpatch.eval.runinfo import run_info, write_results

    arms = expand(split_arms(args.arms), budgets=[args.budget])
    info = run_info()
    model, tokenizer = veloxpatch.load()
    docs = bc.documents(
        tokenizer, args.conversations, args.context_tokens, args.text, args.seed
    )
    table, records = [], []
    for arm in arms:
        for intro in (False, True):
            hits = []
            for doc in docs:
                text = (INTRO if intro else "") + doc.text
                messages = bc.first_messages(text, bc.CODE_Q)
                prompt = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True
                )
                with veloxpatch.patched(model, arm.algo, **arm.options) as patch:
                    steps = stream_generate(
                        model,
                        tokenizer,
                        prompt,
                        max_tokens=args.max_tokens,
                        prompt_cache=patch.make_cache(),
                    )
                    reply = "".join(s.text for s in steps)
                hits.append(bc.code_correct(doc.key, reply))
                records.append(
                    {
                        "arm": arm.label,
                        "intro": intro,
                        "document": doc.index,
                        "depth": doc.depth,
                        "key": doc.key,
                        "reply": reply,
                        "correct": hits[-1],
                    }
                )
            row = {"arm": arm.label, "intro": intro, **bc.proportion(hits)}
            table.append(row)
            print(
                f"{arm.label:<40} intro {str(intro):<5} "
                f"{row['correct']}/{row['cases']}",
                flush=True,
            )
    write_results(
        args.out,
        {"run": info, "config": vars(args), "table": table, "records": records},
    )


if __name__ == "__main__":
    main()
