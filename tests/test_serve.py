"""`veloxpatch serve` end to end: a real server process on a free loopback port
(the embedded SmolLM2, snapkv), OpenAI chat requests over HTTP.

The server is started once for the module (`serving.running_server`: under
`timeout` in its own process group, killed whole when the module ends, and
checked gone).
--kv-cap 40MB: a short request reserves ~11.9 MB (its prompt while it is
read, one 256-row step of 46,440 bytes; after it, the decode bound with
snapkv's window of queries plus the prompt-end snapshot of its rows hold
less), so three fit and a fourth waits for room; a 1,500-token prompt (~71 MB
at full precision before SnapKV compresses it) never fits.
"""

import concurrent.futures
import json
import os
import re
import time
import urllib.error
import urllib.request

import pytest
from conftest import smollm
from serving import group_members, running_server

QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def server():
    args = ["--algo", "snapkv", "--budget", "64", "--kv-cap", "40MB"]
    with running_server(*args, "--max-tokens", "16") as srv:
        yield srv.url, srv.log


def post(url, body, raw: bytes | None = None):
    """(HTTP status, body text)."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=data,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def chat(url, messages, max_tokens=12, stream=False, **extra):
    body = {"messages": messages, "max_tokens": max_tokens, "stream": stream}
    return post(url, {**body, **extra})


def streamed_text(body: str) -> str:
    parts = []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            delta = json.loads(line[6:])["choices"][0].get("delta", {})
            parts.append(delta.get("content") or "")
    return "".join(parts)


def ask(url):
    return chat(url, [{"role": "user", "content": QUESTION}])


@smollm
def test_concurrent_requests_streaming_and_not(server):
    url, log = server
    user = [{"role": "user", "content": QUESTION}]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        plain = [pool.submit(chat, url, user) for _ in range(2)]
        streamed = pool.submit(chat, url, user, stream=True)
        results = [f.result() for f in plain]
        s_status, s_body = streamed.result()
    for status, body in results:
        assert status == 200, body
        answer = json.loads(body)["choices"][0]["message"]["content"]
        assert "Paris" in answer
    assert s_status == 200, s_body
    assert "Paris" in streamed_text(s_body)
    text = log.read_text()
    assert "KV held" in text and "a full cache would hold" in text
    # no batch support yet, or batching: either way the log says which
    assert "one at a time" in text or "served together" in text


@smollm
def test_second_turn_reuses_the_prompt_cache(server):
    url, _ = server
    first = [{"role": "user", "content": "Name a large city in Italy."}]
    status, body = chat(url, first)
    assert status == 200, body
    reply = json.loads(body)
    answer = reply["choices"][0]["message"]["content"]
    second = first + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    status, body = chat(url, second)
    assert status == 200, body
    again = json.loads(body)
    assert "Paris" in again["choices"][0]["message"]["content"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= reply["usage"]["prompt_tokens"]  # the whole first turn


@smollm
def test_bad_requests_get_http_errors_and_the_server_keeps_serving(server):
    url, _ = server
    user = [{"role": "user", "content": QUESTION}]
    status, body = chat(url, user, model="some/other-model")
    assert status == 404 and "not served here" in json.loads(body)["error"]
    status, body = post(url, None, raw=b"{not json")
    assert status == 400 and "Invalid JSON" in body
    long_prompt = [{"role": "user", "content": "Paris is lovely. " * 300}]
    status, body = chat(url, long_prompt)
    assert status == 413 and "--kv-cap" in json.loads(body)["error"]
    status, body = ask(url)
    assert status == 200 and "Paris" in body


@smollm
def test_requests_beyond_the_cap_get_503_then_room_comes_back(server):
    url, _ = server
    # four at once: three fit in 40 MB, the fourth is refused with 503
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: ask(url), range(4)))
    statuses = sorted(s for s, _ in results)
    assert statuses == [200, 200, 200, 503], results
    for status, body in results:
        if status == 503:
            assert "KV cache full" in json.loads(body)["error"]
    status, body = ask(url)  # the room was given back
    assert status == 200, body


@smollm
def test_models_lists_only_the_served_model(server):
    url, _ = server
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        data = json.loads(r.read())["data"]
    assert [m["id"] for m in data] == ["SmolLM2-135M-Instruct.Q4_1"]


def test_help_lists_our_options_and_mlx_lm_server_flags():
    from click.testing import CliRunner

    from veloxpatch.cli import main

    res = CliRunner().invoke(main, ["serve", "--help"])
    assert res.exit_code == 0, res.output
    for flag in (
        "--algo-arg",
        "--max-kv-bytes",
        "--kv-cap",
        "--budget",
        "--compress-system-prompt",
    ):  # ours
        assert flag in res.output
    for flag in ("--port", "--host", "--prompt-cache-size", "--decode-concurrency"):
        assert flag in res.output  # mlx-lm's, passed through
    assert "--kv-bits KV_BITS" not in res.output  # refused, listed as such
    assert "Not supported here: --kv-bits" in res.output


def test_max_kv_bytes_is_the_per_sequence_budget_and_kv_cap_the_server_cap(
    monkeypatch,
):
    """One name, one meaning: `serve --max-kv-bytes` is what it is in
    `generate` (an algorithm option); the server-wide cap is `--kv-cap`."""
    from click.testing import CliRunner

    from veloxpatch.cli import main
    from veloxpatch.serve import server

    seen = {}

    def run(cli_args, model, algo, options, **kwargs):
        seen.update(algo=algo, options=options, **kwargs)

    monkeypatch.setattr(server, "run", run)
    args = ["serve", "--algo", "snapkv", "--max-kv-bytes", "48MB", "--kv-cap", "2GB"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert seen["options"] == {"max_kv_bytes": "48MB"}
    assert seen["kv_cap"] == 2_000_000_000
    res = CliRunner().invoke(main, ["serve", "--algo", "snapkv", "--budget", "64"])
    assert res.exit_code == 0, res.output
    # no --kv-cap: a quarter of the machine's memory; "none": no cap
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert seen["options"] == {"budget": 64} and seen["kv_cap"] == memory // 4
    assert "a quarter of this machine's" in seen["kv_cap_note"]
    res = CliRunner().invoke(main, ["serve", "--kv-cap", "none"])
    assert res.exit_code == 0, res.output
    assert seen["kv_cap"] is None


@smollm
def test_no_server_process_outlives_its_test():
    with running_server("--algo", "full") as srv:
        group = srv.proc.pid  # timeout leads the group; the server is its child
        assert srv.pid in group_members(group)
    assert group_members(group) == []


def held_after(log, offset: int) -> int:
    """KV bytes of the first request done after `offset` in the log (the
    generation thread logs it as it keeps the entry, after the answer)."""
    deadline = time.monotonic() + 30  # a bound on waiting, not a measurement
    while True:
        text = open(log).read()[offset:]
        found = re.search(r"request done: \d+ tokens, KV held ([\d,]+) bytes", text)
        if found or time.monotonic() > deadline:
            assert found, text
            return int(found.group(1).replace(",", ""))
        time.sleep(0.1)


@smollm
def test_a_request_with_its_own_max_kv_bytes_holds_at_most_that(server):
    """`"veloxpatch": {"max_kv_bytes": ...}` (the OpenAI client's extra_body)
    prices that request's budget, and it holds at most that; a request
    without it holds the server's budget of 64 rows, more; sizes the server
    cannot take are 400s naming the field, and the server keeps serving."""
    url, log = server
    # buys fewer rows than the server's 64 (its bound counts snapkv's window
    # of queries, which a short request does not fill: it holds less)
    limit = 6_000_000
    prompt = [{"role": "user", "content": "Paris is lovely. " * 20 + QUESTION}]
    offset = os.path.getsize(log)
    status, body = chat(url, prompt, veloxpatch={"max_kv_bytes": "6MB"})
    assert status == 200, body
    ours = held_after(log, offset)
    text = open(log).read()[offset:]
    assert "veloxpatch.max_kv_bytes 6,000,000 (budget" in text
    assert 0 < ours <= limit, ours
    offset = os.path.getsize(log)
    status, body = chat(url, prompt)
    assert status == 200, body
    assert held_after(log, offset) > ours  # the server's 64 rows, as before
    for field, says in [
        ({"max_kv_bytes": "100MB"}, "more than the server's --kv-cap"),
        ({"max_kv_bytes": "10KB"}, "buys"),
        ({"max_kv_bytes": "a lot"}, "or a size like 24MB"),
        ({"budget": 3}, 'unknown key(s) "budget"'),
        ("1MB", "must be an object"),
    ]:
        status, body = chat(url, prompt, veloxpatch=field)
        assert status == 400, (field, body)
        error = json.loads(body)["error"]
        assert error.startswith("veloxpatch") and says in error, error
    status, body = ask(url)
    assert status == 200 and "Paris" in body
