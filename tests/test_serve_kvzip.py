"""`veloxpatch serve --algo kvzip` end to end on the embedded SmolLM2: each
prompt is reconstructed from the ids the server has (batched, each prompt
from its own), the budget holds, and a second turn reuses what the first left."""

import json

from conftest import smollm
from serving import running_server

FACTS = (
    "Notes for the trip. The museum opens at nine and closes at six. Tickets "
    "cost twelve euros. The capital of France is Paris, and the train from the "
    "airport takes thirty minutes. Lunch is served between noon and two. "
) * 3


def ask(srv, messages, max_tokens=12):
    status, body = srv.post(
        {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    )
    assert status == 200, body
    return json.loads(body)


@smollm
def test_kvzip_serves_turns_from_its_reconstruction():
    args = ["--algo", "kvzip", "--budget", "48", "--max-tokens", "16"]
    with running_server(*args, limit_s=240) as srv:
        first = [{"role": "user", "content": FACTS + "What is the capital of France?"}]
        r1 = ask(srv, first)
        assert "Paris" in r1["choices"][0]["message"]["content"]
        second = first + [
            {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
            {"role": "user", "content": "How much do tickets cost?"},
        ]
        r2 = ask(srv, second)
        cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= r1["usage"]["prompt_tokens"]  # turn 1's prompt, reused
        again = ask(srv, first)  # the very same prompt: an exact prompt-cache hit
        assert "Paris" in again["choices"][0]["message"]["content"]
        log = srv.log.read_text()
    assert "kvzip caches batch" in log
    assert "prompt cache keeps the" in log
    held = [int(x.replace(",", "")) for x in _held(log)]
    full = [int(x.replace(",", "")) for x in _full(log)]
    assert held and all(h < f for h, f in zip(held, full))


def _held(log: str) -> list[str]:
    return [
        ln.split("KV held ")[1].split(" ")[0]
        for ln in log.splitlines()
        if "KV held" in ln
    ]


def _full(log: str) -> list[str]:
    return [
        ln.split("would hold ")[1].split(")")[0]
        for ln in log.splitlines()
        if "would hold" in ln
    ]


@smollm
def test_users_sharing_a_system_prompt_read_it_once():
    """mlx-lm's batches keep the system prompt's own entry as they read it
    (a request's end is compressed past it), so the next user starts from it.
    Its usage counts it as cached only for the users who did not read it."""
    args = ["--algo", "kvzip", "--budget", "48", "--max-tokens", "16"]
    system = {"role": "system", "content": "Answer from these notes. " + FACTS}
    with running_server(*args, limit_s=240) as srv:
        asks = ["What is the capital of France?", "When is lunch served?"]
        replies = [ask(srv, [system, {"role": "user", "content": q}]) for q in asks]
        log = srv.log.read_text()
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
    assert cached[0] == 0 and 100 < cached[1] < replies[1]["usage"]["prompt_tokens"]
    assert "kvzip caches batch" in log
    assert "Paris" in replies[0]["choices"][0]["message"]["content"]
    assert "noon" in replies[1]["choices"][0]["message"]["content"]


@smollm
def test_a_system_prompt_compressed_alone_serves_later_users_without_a_pass():
    """`--compress-system-prompt`: the first user's request reads and compresses
    the system prompt alone (question-agnostic); the next user's question is
    read on that entry."""
    args = ["--algo", "kvzip", "--budget", "128", "--max-tokens", "16"]
    system = {"role": "system", "content": "Answer from these notes. " + FACTS}
    with running_server(*args, "--compress-system-prompt", limit_s=240) as srv:
        asks = ["What is the capital of France?", "Which city is the capital?"]
        replies = [ask(srv, [system, {"role": "user", "content": q}]) for q in asks]
        log = srv.log.read_text()
    kept = [ln for ln in log.splitlines() if "the system prompt's" in ln]
    assert len(kept) == 1 and kept[0].endswith("kept, compressed"), kept
    n = int(kept[0].split("the system prompt's ")[1].split(" ")[0])
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
    assert cached == [0, n]
    for r in replies:
        assert "Paris" in r["choices"][0]["message"]["content"]


@smollm
def test_a_retry_continues_from_the_entry_and_gives_the_same_text():
    """The same request twice (a client's retry): the second reads only the
    prompt's last token (its logits kept with kvzip's compressed entry) and
    gives the same text at temperature 0."""
    args = ["--algo", "kvzip", "--budget", "64", "--max-tokens", "16"]
    system = {"role": "system", "content": "Answer from these notes. " + FACTS}
    messages = [system, {"role": "user", "content": "How much do tickets cost?"}]
    with running_server(*args, limit_s=240) as srv:
        first, again = ask(srv, messages), ask(srv, messages)
        log = srv.log.read_text()
    n = first["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    text = first["choices"][0]["message"]["content"]
    assert again["choices"][0]["message"]["content"] == text
    assert f"the same {n}-token prompt again" in log
