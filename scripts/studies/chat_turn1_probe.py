"""Turn 1 of the chat benchmark (the number asked in the first message) outside
the server: does a prompt that announces the number change what an arm keeps?

`scripts/bench_chat.py` sends each document without the passkey cases' intro
("There is a secret number hidden inside a long text..."): told that, SmolLM2
answers a summary request with the number. This runs the same first messages
through `mlx_lm.stream_generate` in one process, with and without that intro,
for each arm: a failure that also happens here is not the server's.

    .venv/bin/python scripts/studies/chat_turn1_probe.py --arms full,kvzap:scorer=F \\
        --out scripts/studies/results/chat_turn1_probe.json
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench_chat.py (its documents, server and client) sits one folder up, in scripts/
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_chat as bc  # noqa: E402


def main() -> None:
    args = bc.in_process_parser(__doc__).parse_args()
    arms, info, model, tokenizer, docs = bc.in_process_setup(args)
    from mlx_lm import stream_generate

    import veloxpatch
    from veloxpatch.eval.passkey import INTRO
    from veloxpatch.eval.runinfo import write_results

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
            bc.add_row(table, arm.label, "intro", intro, hits)
    write_results(
        args.out,
        {"run": info, "config": vars(args), "table": table, "records": records},
    )


if __name__ == "__main__":
    main()
