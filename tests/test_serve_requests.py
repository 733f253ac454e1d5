"""`veloxpatch serve` against bad requests, clients that leave, and signals: a
real server on 127.0.0.1 (the embedded SmolLM2, `full` cache).

Every bad field gets one 400 naming it and the server keeps serving; a client
that disconnects stops its generation and gives back its KV reservation;
SIGTERM/SIGINT answer the requests in flight with an error and exit quickly.
--kv-cap 100MB: a request with max_tokens 2000 reserves ~95 MB (2,048
rows of 46,440 bytes), so while it runs a short one (~11.9 MB) gets 503, and
gets 200 once the long one has given its reservation back.
"""

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import pytest
from conftest import smollm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import group_members, running_server

VOCAB = 49152  # SmolLM2's logits (and tokenizer) size
USER = [{"role": "user", "content": "Say hello."}]
LONG = {"messages": [{"role": "user", "content": "Tell a long story."}]}


@pytest.fixture(scope="module")
def server():
    args = ["--algo", "full", "--kv-cap", "100MB", "--max-tokens", "4"]
    with running_server(*args) as srv:
        yield srv


def error_of(status, body) -> str:
    assert 400 <= status < 500, (status, body)
    message = json.loads(body)["error"]
    assert isinstance(message, str) and message
    return message


def still_serving(server):
    status, body = server.post({"messages": USER, "max_tokens": 2})
    assert status == 200, body
    assert server.proc.poll() is None


@smollm
@pytest.mark.parametrize(
    "bias, says",
    [
        ('{"49152": 100}', "token id 49152 is out of range"),  # == vocab size
        ('{"-1": 5}', "token id -1 is out of range"),  # was: the last token
        ('{"5": NaN}', "logit_bias[5] must be a finite number"),
        ('{"5": Infinity}', "logit_bias[5] must be a finite number"),
        ('{"five": 1}', "logit_bias keys must be token ids"),
    ],
)
def test_logit_bias_outside_the_vocabulary_or_not_finite_is_400(server, bias, says):
    raw = f'{{"messages": {json.dumps(USER)}, "max_tokens": 2, "logit_bias": {bias}}}'
    message = error_of(*server.post(None, raw=raw.encode()))
    assert says in message
    still_serving(server)  # an id == vocab size used to kill the process


@smollm
@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "top_k"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_non_finite_sampling_values_are_400(server, field, value, path):
    head = f'"messages": {json.dumps(USER)}' if "chat" in path else '"prompt": "Hi"'
    raw = f'{{{head}, "max_tokens": 2, "{field}": {value}}}'.encode()
    message = error_of(*server.post(None, raw=raw, path=path))
    assert message.startswith(f"{field} must be") and value in message


@smollm
@pytest.mark.parametrize(
    "messages, says",
    [
        (["Say hello."], "messages[0] must be an object"),
        ("Say hello.", "messages must be a non-empty list"),
        ([], "messages must be a non-empty list"),
        (None, "messages must be a non-empty list"),
        ([{"role": 1, "content": "hi"}], "messages[0].role must be a string"),
        ([{"role": "user", "content": 5}], "messages[0].content must be a string"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
            "messages[0].content[0] must be a text part",
        ),
    ],
)
def test_messages_of_the_wrong_shape_are_400(server, messages, says):
    message = error_of(*server.post({"messages": messages, "max_tokens": 2}))
    assert says in message


@smollm
@pytest.mark.parametrize(
    "extra, says",
    [
        ({"n": 2}, "n must be 1"),
        ({"max_tokens": 0}, "max_tokens must be an integer"),
        ({"max_completion_tokens": 2.5}, "max_completion_tokens must be an integer"),
        ({"stream": "yes"}, "stream must be true or false"),
        ({"stop": [1]}, "stop must be a string or a list of strings"),
        ({"top_k": VOCAB}, "top_k must be an integer in [0, 49151]"),
        ({"xtc_threshold": 0.7}, "xtc_threshold must be"),  # killed generation
        ({"presence_penalty": 3}, "presence_penalty must be"),
        ({"seed": -1}, "seed must be"),
        ({"top_logprobs": 50}, "top_logprobs must be"),
        # fields mlx-lm takes and ignores: refused, never a 200 that ignores them
        ({"temperature": 1e308}, "temperature must be a finite number in [0, 2]"),
        ({"temperature": 2.5}, "temperature must be a finite number in [0, 2]"),
        ({"repetition_penalty": 50}, "repetition_penalty must be"),
        ({"logit_bias": {"5": 1000}}, "logit_bias[5] must be in [-100, 100]"),
        ({"response_format": {"type": "json_object"}}, "response_format: only"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "tools: this model's tokenizer has no tool-call format",
        ),
        ({"tool_choice": "required"}, 'tool_choice: only "auto" is served'),
        ({"functions": [{"name": "f"}]}, "functions: legacy function calling"),
        ({"stop": [str(i) for i in range(10)]}, "stop: at most 4 strings, got 10"),
        ({"logprobs": True, "stream": True}, "logprobs: not served on streams"),
        ({"top_logprobs": 3}, "top_logprobs needs logprobs: true"),
        (
            {"messages": [*USER, {"role": "tool", "content": "42"}]},
            "messages[1].tool_call_id: a tool message must name the call",
        ),
        # a lone surrogate is valid JSON; as a stop word it once stopped the
        # generation thread for every later request
        ({"stop": ["\ud800"]}, '"stop" holds "\\ud800", a lone surrogate'),
        ({"stop": "ab\udfff"}, "a lone surrogate"),
    ],
)
def test_other_bad_fields_are_400_naming_the_field(server, extra, says):
    body = {"messages": USER, "max_tokens": 2, **extra}
    assert says in error_of(*server.post(body))
    still_serving(server)


@smollm
def test_logprobs_are_the_chosen_tokens_and_sorted_alternatives(server, loaded):
    # a direct forward pass of the same model (float32 on the CPU, as served)
    import mlx.core as mx

    model, tokenizer = loaded
    prompt = "The capital of France is"
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
    status, text = server.post(
        {**body, "logprobs": True, "top_logprobs": 5}, path="/v1/completions"
    )
    assert status == 200, text
    reply = json.loads(text)
    content = reply["choices"][0]["logprobs"]["content"]
    ids = tokenizer.encode(prompt)
    assert reply["usage"]["prompt_tokens"] == len(ids)
    chosen = [c["id"] for c in content]
    logits = model(mx.array([ids + chosen])).astype(mx.float32)[0]
    direct = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()
    for k, entry in enumerate(content):
        row = direct[len(ids) - 1 + k]
        best = sorted(range(len(row)), key=lambda i: -row[i])[:5]
        assert entry["id"] == best[0]  # temperature 0: the most likely token
        assert entry["logprob"] == pytest.approx(row[entry["id"]], abs=1e-3)
        top = entry["top_logprobs"]
        assert [t["id"] for t in top] == best
        for t in top:
            assert t["logprob"] == pytest.approx(row[t["id"]], abs=1e-3)
    # logprobs without alternatives: the chosen tokens, the same values
    status, text = server.post({**body, "logprobs": True}, path="/v1/completions")
    plain = json.loads(text)["choices"][0]["logprobs"]["content"]
    assert [c["id"] for c in plain] == chosen
    assert "top_logprobs" not in plain[0]


@smollm
@pytest.mark.parametrize("stream", [False, True])
def test_responses_name_the_served_model_not_default_model(server, stream):
    with urllib.request.urlopen(server.url + "/v1/models", timeout=30) as r:
        served = json.loads(r.read())["data"][0]["id"]
    body = {"messages": USER, "max_tokens": 2, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    status, text = server.post(body)
    assert status == 200, text
    if stream:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        replies = [json.loads(e) for e in events if e != "[DONE]"]
        assert replies[-1]["usage"]["completion_tokens"] >= 1  # the usage event
    else:
        replies = [json.loads(text)]
    assert {r["model"] for r in replies} == {served} != {"default_model"}


@smollm
def test_max_completion_tokens_stands_for_a_null_max_tokens(server):
    # mlx-lm reads max_completion_tokens first and max_tokens only without it
    body = {"messages": USER, "max_tokens": None, "max_completion_tokens": 2}
    status, text = server.post(body)
    assert status == 200, text
    assert json.loads(text)["usage"]["completion_tokens"] <= 2


@smollm
@pytest.mark.parametrize(
    "length, body, says",
    [
        (None, b'{"messages": [{"role": "user", "content": "hi\xff"}]}', "not UTF-8"),
        (-1, b"{}", "Content-Length must not be negative"),
    ],
    ids=["not utf-8", "negative length"],
)
def test_a_body_mlx_lm_cannot_read_is_400_not_silence(server, length, body, says):
    length = len(body) if length is None else length
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    assert b" 400 " in status_line, reply[:200]
    assert says in json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
    still_serving(server)


@smollm
def test_prompt_beyond_the_context_is_refused_before_prefill(server):
    # ~9,400 tokens + max_tokens: past SmolLM2's 8,192 (it used to run for
    # 18 minutes); the bound below is loose, the refusal takes milliseconds
    body = {"messages": [{"role": "user", "content": "word " * 9400}]}
    start = time.monotonic()
    message = error_of(*server.post({**body, "max_tokens": 16}))
    assert time.monotonic() - start < 10
    assert "context length of 8,192" in message
    assert "max_tokens" in message
    still_serving(server)


# JSON values of every kind, NaN and Infinity included (Python's json reads them)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=6)
)
JSONISH = (
    SCALARS
    | st.lists(SCALARS, max_size=2)
    | st.dictionaries(st.text(max_size=4), SCALARS, max_size=2)
)
# never a valid large max_tokens: every request stays a few tokens long
LENGTHS = st.sampled_from([1, 2, 0, -1, 8193, 10**9, 1.5, "2", True, None]) | (
    JSONISH.filter(lambda v: not isinstance(v, int) or isinstance(v, bool))
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]) | JSONISH},
        optional={
            "content": st.sampled_from(["Hi.", "", None])
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.just("text"), "text": st.text(max_size=8)}
                ),
                max_size=2,
            )
            | JSONISH
        },
    )
    | JSONISH,
    max_size=3,
)
FIELDS = {
    "messages": MESSAGES | JSONISH,
    "prompt": st.sampled_from(["Once upon a time", ""]) | JSONISH,
    "max_tokens": LENGTHS,
    "max_completion_tokens": LENGTHS,
    "temperature": st.sampled_from([0, 0.7, 1e-30, 1e30]) | JSONISH,
    "top_p": st.sampled_from([0.5, 1]) | JSONISH,
    "top_k": st.sampled_from([0, 40, VOCAB - 1, VOCAB]) | JSONISH,
    "min_p": st.floats(0, 1) | JSONISH,
    "repetition_penalty": st.floats(0, 3) | JSONISH,
    "presence_penalty": st.floats(-2, 2) | JSONISH,
    "frequency_context_size": st.integers(0, 2**40) | JSONISH,
    "xtc_probability": st.floats(0, 1) | JSONISH,
    "xtc_threshold": st.floats(0, 1) | JSONISH,
    "logit_bias": st.dictionaries(
        st.sampled_from(["0", "2", str(VOCAB - 1), str(VOCAB), "-1", "x"]),
        st.floats() | st.integers(-(10**9), 10**9) | JSONISH,
        max_size=3,
    )
    | JSONISH,
    "seed": st.integers(-1, 2**64) | JSONISH,
    "n": st.sampled_from([1, 2]) | JSONISH,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2) | JSONISH,
    "stream": st.booleans() | JSONISH,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": JSONISH})
    | JSONISH,
    "logprobs": st.booleans() | JSONISH,
    "top_logprobs": st.integers(-1, 12) | JSONISH,
    "model": st.sampled_from(["default_model", "other/model"]) | JSONISH,
    "chat_template_kwargs": st.dictionaries(st.text(max_size=5), JSONISH, max_size=2),
}
BASE = {"messages": USER, "prompt": "Once", "max_tokens": 2}
# a valid request with up to three fields changed: many stay valid and run
BODIES = (
    st.tuples(st.permutations(sorted(FIELDS)), st.integers(1, 3))
    .flatmap(lambda p: st.fixed_dictionaries({k: FIELDS[k] for k in p[0][: p[1]]}))
    .map(lambda changed: {**BASE, **changed})
)


@smollm
@settings(
    derandomize=True,
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(body=BODIES, chat=st.booleans())
def test_fuzzed_bodies_get_2xx_or_4xx_and_the_server_keeps_serving(server, body, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, text = server.post(None, raw=json.dumps(body).encode(), path=path)
    if 400 <= status < 500:
        error_of(status, text)
    else:
        assert status == 200, (status, text)
        if body.get("stream") is not True:
            json.loads(text)
    assert server.proc.poll() is None


@smollm
def test_the_server_serves_after_the_fuzz(server):
    still_serving(server)
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert r.status == 200


def raw_request(port, body) -> socket.socket:
    data = json.dumps(body).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head.encode() + data)
    return sock


def wait_for(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@smollm
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_stops_its_generation_and_frees_its_kv(server, stream):
    port = int(server.url.rsplit(":", 1)[1])
    log = server.log.read_text
    started, cuts = log().count("max_tokens 2000"), log().count("client disconnected")
    sock = raw_request(port, {**LONG, "max_tokens": 2000, "stream": stream})
    wait_for(lambda: log().count("max_tokens 2000") > started)
    # it holds ~95 of the 100 MB: a short request does not fit beside it
    assert server.post({"messages": USER, "max_tokens": 2})[0] == 503
    time.sleep(0.5)  # generating
    sock.close()
    wait_for(lambda: log().count("client disconnected") > cuts)
    line = log().split("client disconnected")[-1].split("\n")[0]
    generated = int(line.split("after ")[1].split(" ")[0])
    assert generated < 2000
    assert "generation stopped, 95,109,120 reserved KV bytes released" in line
    # the reservation is back: a short request fits again
    status, body = server.post({"messages": USER, "max_tokens": 2})
    assert status == 200, body


def in_flight(server, stream, results, headers_in=None):
    body = {**LONG, "max_tokens": 2000, "stream": stream}
    try:
        results[stream] = server.post(body, headers_in=headers_in)
    except OSError as e:  # asserted in the test's thread, not raised in this one
        results[stream] = (None, repr(e))


@smollm
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_signal_cuts_requests_in_flight_and_the_server_exits(signum):
    with running_server("--algo", "full", "--max-tokens", "4") as srv:
        results, streaming = {}, threading.Event()
        threads = [
            threading.Thread(target=in_flight, args=(srv, False, results)),
            threading.Thread(target=in_flight, args=(srv, True, results, streaming)),
        ]
        for t in threads:
            t.start()
        wait_for(lambda: srv.log.read_text().count("max_tokens 2000") == 2)
        # the stream sends its headers once it generates (a fixed sleep raced slow CPUs)
        assert streaming.wait(timeout=60)
        pid = srv.pid
        start = time.monotonic()
        os.kill(pid, signum)  # the server itself, as a service manager would
        try:
            srv.proc.wait(timeout=10)  # timeout ends when its child does
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not stop:\n" + srv.log.read_text()[-3000:])
        took = time.monotonic() - start
        for t in threads:
            t.join(timeout=10)
        print(f"{signal.Signals(signum).name}: server exited {took:.2f} s after")
        assert took < 5  # the design says 2 s; loose for a shared machine
        assert srv.proc.returncode == 0  # a clean exit (timeout passes it on)
        status, body = results[False]
        assert status == 503 and "server shutting down" in json.loads(body)["error"]
        status, body = results[True]
        assert status == 200  # headers went before the cut: an error event ends it
        last = [x for x in body.splitlines() if x.startswith("data: ")][-1]
        assert "server shutting down" in json.loads(last[6:])["error"]["message"]
        assert "[DONE]" not in body
        assert pid not in group_members(srv.proc.pid)
        # a kernel compile (g++) the server started may outlive it by a moment
        wait_for(lambda: group_members(srv.proc.pid) == [])


@smollm
def test_sigterm_during_a_long_prefill_exits_without_waiting_for_it():
    # a ~7,900-token prompt: its prefill takes seconds; the server answers 503
    # and exits without waiting for the generation thread's step to end
    with running_server("--algo", "full", "--max-tokens", "4") as srv:
        results = {}
        body = {"messages": [{"role": "user", "content": "word " * 7900}]}

        def send():
            results["r"] = srv.post({**body, "max_tokens": 16})

        thread = threading.Thread(target=send)
        thread.start()
        wait_for(lambda: "max_tokens 16" in srv.log.read_text())
        time.sleep(1.0)  # prefilling
        start = time.monotonic()
        os.kill(srv.pid, signal.SIGTERM)
        srv.proc.wait(timeout=15)
        took = time.monotonic() - start
        thread.join(timeout=10)
        print(f"SIGTERM mid-prefill: server exited {took:.2f} s after")
        # the prefill alone takes ~20 s; a loaded suite took 5.6 s to exit
        assert took < 10 and srv.proc.returncode == 0
        status, text = results["r"]
        assert status == 503 and "server shutting down" in text


@smollm
def test_health_and_models_report_the_algorithm_the_cap_and_the_bytes_held(server):
    status, text = server.post({"messages": USER, "max_tokens": 2})
    assert status == 200, text
    reports = []
    for path in ("/health", "/v1/models"):
        with urllib.request.urlopen(server.url + path, timeout=10) as r:
            body = json.loads(r.read())
        reports.append(
            body["veloxpatch"] if path == "/health" else body["data"][0]["veloxpatch"]
        )
    for report in reports:
        assert report["algorithm"] == "full"
        assert report["kv_cap_bytes"] == 100_000_000
        assert report["requests_in_flight"] == 0 and report["reserved_bytes"] == 0
        # the finished request's caches, kept for later turns
        assert report["prompt_cache_entries"] >= 1
        assert report["prompt_cache_bytes"] > 0
