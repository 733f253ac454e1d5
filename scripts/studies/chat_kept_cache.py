"""The chat benchmark's conversations in one process, one prompt cache kept
across the turns: what a chat loop over `mlx_lm.stream_generate` does (as
`mlx_lm.chat`), where the cache holds the first answer's generated tokens and
the second turn appends only its own message. The server instead re-sends the
whole history and matches it against its prompt cache (`scripts/bench_chat.py`).

Each document (the chat benchmark's: held-out prose, a five-digit number at a
depth, no intro) is asked in both orders: needle second (turn 1 a one-sentence
summary, turn 2 the number) and needle first. Turn 2 is the chat template's
text after turn 1's reply, fed after the tokens the cache already holds. The
arms are patched with the tokenizer (kvzip reconstructs every prompt, the
second turn's with the answer before it).

    .venv/bin/python scripts/studies/chat_kept_cache.py --arms full,kvzip,snapkv \\
        --out scripts/studies/results/chat_kept_cache.json
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench_chat.py (its documents, server and client) sits one folder up, in scripts/
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_chat as bc  # noqa: E402


def second_turn_text(tokenizer, first: list[dict], reply: str, question: str) -> str:
    """The chat template's text of turn 2 after turn 1's reply: the reply's
    end-of-turn marker, then the new user turn (a reply that ended on the EOS
    token has fed it already: the caller drops it)."""
    text = tokenizer.apply_chat_template(
        bc.second_messages(first, reply, question),
        add_generation_prompt=True,
        tokenize=False,
    )
    said = reply.strip()
    return text[text.rindex(said) + len(said) :]


def main() -> None:
    ap = bc.in_process_parser(__doc__)
    ap.add_argument("--summary-max-tokens", type=int, default=48)
    args = ap.parse_args()
    arms, info, model, tokenizer, docs = bc.in_process_setup(args)
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    import veloxpatch
    from veloxpatch.eval.runinfo import write_results

    greedy = make_sampler(0.0)

    def turn(prompt, cache, n) -> tuple[str, list[int]]:
        kw = dict(max_tokens=n, sampler=greedy, prompt_cache=cache)
        steps = list(stream_generate(model, tokenizer, prompt, **kw))
        return "".join(s.text for s in steps), [s.token for s in steps]

    table, records = [], []
    for arm in arms:
        for order in bc.ORDERS:
            hits = []
            for doc in docs:
                q1, q2 = bc.questions(order)
                m1 = bc.first_messages(doc.text, q1)
                p1 = tokenizer.apply_chat_template(m1, add_generation_prompt=True)
                with veloxpatch.patched(
                    model, arm.algo, tokenizer=tokenizer, **arm.options
                ) as patch:
                    cache = patch.make_cache()
                    r1, toks = turn(p1, cache, bc.max_tokens_for(q1, args))
                    tail = second_turn_text(tokenizer, m1, r1, q2)
                    if toks and toks[-1] == tokenizer.eos_token_id:
                        tail = tail.removeprefix(tokenizer.eos_token)  # fed already
                    p2 = tokenizer.encode(tail, add_special_tokens=False)
                    r2, _ = turn(p2, cache, bc.max_tokens_for(q2, args))
                code = r2 if q2 == bc.CODE_Q else r1
                hits.append(bc.code_correct(doc.key, code))
                records.append(
                    {
                        "arm": arm.label,
                        "order": order,
                        "document": doc.index,
                        "depth": doc.depth,
                        "key": doc.key,
                        "replies": [r1, r2],
                        "correct": hits[-1],
                        "key_in_turn1_reply": q2 == bc.CODE_Q
                        and bc.code_correct(doc.key, r1),
                    }
                )
            bc.add_row(table, arm.label, "order", order, hits)
    write_results(
        args.out,
        {"run": info, "config": vars(args), "table": table, "records": records},
    )


if __name__ == "__main__":
    main()
