"""`veloxpatch serve` under many connections and clients that stop sending: a
real server on 127.0.0.1 (the embedded SmolLM2, `full` cache).

Every connection gets an HTTP status: 64 at once are queued (a listen backlog
and a thread each) and answered 200, or 503 with Retry-After past
--max-requests; a request whose headers or body stop arriving gets 408 after
--read-timeout (2 s here, to keep the tests short).
"""

import http.client
import json
import socket
import threading

import pytest
from conftest import smollm
from serving import running_server

USER = [{"role": "user", "content": "Say hello."}]
TIMEOUT_S = 2


@pytest.fixture(scope="module")
def server():
    args = ["--algo", "full", "--max-tokens", "2", "--read-timeout", str(TIMEOUT_S)]
    with running_server(*args, limit_s=400) as srv:
        yield srv


def port_of(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def exchange(server, data: bytes) -> bytes:
    """Send `data` on a fresh connection and read until the server closes."""
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=60) as s:
        s.sendall(data)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return reply


def status_of(reply: bytes) -> int:
    return int(reply.split(b"\r\n", 1)[0].split()[1])


def still_serving(server):
    status, body = server.post({"messages": USER, "max_tokens": 1})
    assert status == 200, body


@smollm
def test_64_simultaneous_connections_each_get_a_status(server):
    n = 64
    start = threading.Barrier(n)
    answers = [None] * n  # (status, Retry-After) or the exception

    def client(i):
        conn = http.client.HTTPConnection("127.0.0.1", port_of(server), timeout=300)
        body = json.dumps({"messages": USER, "max_tokens": 1})
        try:
            start.wait()
            conn.request(
                "POST",
                "/v1/chat/completions",
                body,
                {"Content-Type": "application/json"},
            )
            r = conn.getresponse()
            r.read()
            answers[i] = (r.status, r.getheader("Retry-After"))
        except Exception as e:  # a reset: what this test exists to catch
            answers[i] = e
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [a for a in answers if not isinstance(a, tuple)]
    assert failed == [], failed
    statuses = sorted(status for status, _ in answers)
    print(f"64 connections: {statuses.count(200)} x 200, {statuses.count(503)} x 503")
    assert set(statuses) <= {200, 503}, statuses
    assert all(after for status, after in answers if status == 503)
    still_serving(server)


@smollm
def test_a_body_shorter_than_its_content_length_gets_408(server):
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Length: 500\r\n\r\n"
    )
    reply = exchange(server, head + b'{"messages": [')  # and then nothing
    assert status_of(reply) == 408, reply[:300]
    message = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert "14 of the 500 bytes" in message
    still_serving(server)


@smollm
def test_headers_that_stop_arriving_get_408(server):
    reply = exchange(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127")
    assert status_of(reply) == 408, reply[:300]
    still_serving(server)


@smollm
def test_a_body_past_the_limit_is_413_before_it_is_read(server):
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Length: {10**12}\r\n\r\n"
    ).encode()
    reply = exchange(server, head)
    assert status_of(reply) == 413, reply[:300]
    still_serving(server)


@smollm
def test_past_max_requests_a_request_gets_503_with_retry_after():
    args = ["--algo", "full", "--max-tokens", "2000", "--max-requests", "1"]
    with running_server(*args) as srv:
        headers_in = threading.Event()
        story = {"messages": [{"role": "user", "content": "Tell a long story."}]}

        def long_request():  # a stream: its headers come once it is admitted
            try:
                srv.post({**story, "stream": True}, headers_in=headers_in)
            except OSError:  # the server is killed under it at the end
                pass

        long = threading.Thread(target=long_request, daemon=True)
        long.start()
        assert headers_in.wait(60)
        conn = http.client.HTTPConnection("127.0.0.1", port_of(srv), timeout=60)
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps({"messages": USER, "max_tokens": 1}),
            {"Content-Type": "application/json"},
        )
        r = conn.getresponse()
        body = json.loads(r.read())
        conn.close()
        assert r.status == 503 and r.getheader("Retry-After") == "1"
        assert "--max-requests 1" in body["error"]
    long.join()


@smollm
def test_without_kv_cap_the_cap_is_a_quarter_of_memory_and_logged(server):
    import os
    import re

    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    line = re.search(
        r"KV cap ([\d,]+) bytes, a quarter of this machine's "
        r"([\d,]+) bytes",
        server.log.read_text(),
    )
    assert line, server.log.read_text()[-2000:]
    cap, logged = (int(g.replace(",", "")) for g in line.groups())
    assert (cap, logged) == (memory // 4, memory)
