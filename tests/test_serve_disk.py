"""`veloxpatch serve --prompt-cache-dir` (serve/disk.py): the prompt cache's
entries on disk, loaded after a restart as an entry kept in memory is used;
damaged, partial and foreign files never loaded. Driven as mlx-lm's server
drives the prompt cache, on tiny models (a "restart" is a new prompt cache on
the same directory), and end to end on the embedded SmolLM2."""

import errno
import json
import logging
import os
import shutil
import time

import mlx.core as mx
import numpy as np
import pytest
from conftest import smollm
from serving import running_server
from test_serve_policy import ASK_A, ASK_B, DOC, REPLAY_ARMS, serve
from tiny import resolve_options, tiny_model

import veloxpatch
from veloxpatch.loading.safetensors_header import check_safetensors
from veloxpatch.serve.disk import DiskEntries
from veloxpatch.serve.prompt_cache import BoundedPromptCache

ME = {"model": "tiny", "fingerprint": "f", "algo": "kvzip", "options": "{}"}


def store_on(directory, identity=ME, cap=1 << 40):
    store = BoundedPromptCache()
    store.disk = DiskEntries(directory, cap, identity)
    return store


def entries(directory):
    return sorted(p for p in os.listdir(directory) if p.startswith("entry-"))


def stored_tokens(path) -> list[int]:
    """The token ids a stored entry's safetensors metadata holds."""
    info = check_safetensors(path)["__metadata__"]["veloxpatch"]
    return json.loads(info)["metadata"]["tokens"]


def lines(caplog, text):
    return [r for r in caplog.records if text in r.getMessage()]


@pytest.mark.parametrize("algo,opts", REPLAY_ARMS)
def test_after_a_restart_a_prompt_continues_from_the_entry_on_disk(
    algo, opts, tmp_path
):
    """The entry a request left, loaded by a new prompt cache on the same
    directory: the same prompt (a retry) reuses all but its last token and the
    next turn reuses the whole first prompt, with the tokens and logprobs of
    the server that never stopped."""
    from test_kvzip import TOK

    model = tiny_model("llama")
    opts = resolve_options(model, opts)
    with veloxpatch.patched(model, algo, tokenizer=TOK, **opts) as patch:
        patch.keep_snapshots = True
        memory = BoundedPromptCache()  # the server that never stopped
        first = serve(model, memory, DOC + ASK_A)
        second = DOC + ASK_A + first[0] + ASK_B
        follow = serve(model, memory, second)
        assert serve(model, store_on(tmp_path), DOC + ASK_A)[2] == 0
        assert len(entries(tmp_path)) == 1
        # restarts: memory empty, the same directory
        retry = serve(model, store_on(tmp_path), DOC + ASK_A)
        turn = serve(model, store_on(tmp_path), second)
    assert retry[2] == len(DOC + ASK_A) - 1
    assert retry[0] == first[0]
    np.testing.assert_allclose(np.array(retry[1]), np.array(first[1]), atol=1e-5)
    assert turn[2] >= len(DOC + ASK_A) and turn[2] == follow[2]
    assert turn[0] == follow[0]
    np.testing.assert_allclose(np.array(turn[1]), np.array(follow[1]), atol=1e-5)


def kvzip_entry(tmp_path, identity=ME):
    """A kvzip entry of DOC + ASK_A written to tmp_path; (tokens, logprobs)."""
    from test_kvzip import TOK

    model = tiny_model("llama")
    with veloxpatch.patched(model, "kvzip", tokenizer=TOK, budget=24) as patch:
        patch.keep_snapshots = True
        first = serve(model, store_on(tmp_path, identity), DOC + ASK_A)
    return model, first


def serve_kvzip(model, store, prompt):
    from test_kvzip import TOK

    with veloxpatch.patched(model, "kvzip", tokenizer=TOK, budget=24) as patch:
        patch.keep_snapshots = True
        return serve(model, store, prompt)


def test_a_flipped_byte_is_skipped_removed_and_the_request_served(tmp_path, caplog):
    model, first = kvzip_entry(tmp_path)
    (name,) = entries(tmp_path)
    path = tmp_path / name
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # in an array's bytes: only the checksum sees it
    path.write_bytes(bytes(data))
    store = store_on(tmp_path)
    assert len(store.disk.index) == 1  # the header is intact
    with caplog.at_level(logging.INFO, logger="veloxpatch.serve"):
        again = serve_kvzip(model, store, DOC + ASK_A)
    assert again[2] == 0 and again[0] == first[0]  # from scratch
    bad = lines(caplog, f"removed {name}")
    assert len(bad) == 1 and "checksum mismatch" in bad[0].getMessage()
    assert not lines(caplog, "on disk: loaded")
    # the request's own entry was written again, whole
    assert entries(tmp_path) == [name]
    assert store_on(tmp_path).disk.load(name) is not None


def test_a_damaged_header_is_removed_at_start(tmp_path, caplog):
    kvzip_entry(tmp_path)
    (name,) = entries(tmp_path)
    (tmp_path / name).write_bytes((tmp_path / name).read_bytes()[:20])
    with caplog.at_level(logging.INFO, logger="veloxpatch.serve"):
        store = store_on(tmp_path)
    assert store.disk.index == {} and entries(tmp_path) == []
    assert len(lines(caplog, f"removed {name}: damaged")) == 1


def test_an_entry_of_another_algorithm_is_removed_unread(tmp_path, caplog):
    other = {**ME, "algo": "snapkv"}
    model, first = kvzip_entry(tmp_path, identity=other)
    (name,) = entries(tmp_path)
    with caplog.at_level(logging.INFO, logger="veloxpatch.serve"):
        store = store_on(tmp_path)
        again = serve_kvzip(model, store, DOC + ASK_A)
    assert len(lines(caplog, f"removed {name}: written by another model")) == 1
    assert again[2] == 0 and again[0] == first[0]
    assert name not in entries(tmp_path)  # out of the index: it escapes the bound
    assert len(entries(tmp_path)) == 1  # this server's own entry


def test_a_write_cut_short_is_removed_at_start(tmp_path, caplog):
    kvzip_entry(tmp_path)
    (name,) = entries(tmp_path)
    torn = tmp_path / f"{name}.4242-0badf00d.tmp.safetensors"
    torn.write_bytes((tmp_path / name).read_bytes()[:1000])  # kill -9 mid-write
    with caplog.at_level(logging.INFO, logger="veloxpatch.serve"):
        store = store_on(tmp_path)
    assert not torn.exists()
    assert len(lines(caplog, f"removed {torn.name}: a partial write")) == 1
    assert list(store.disk.index) == [name]


def test_the_disk_cap_evicts_the_least_recently_used(tmp_path):
    model, _ = kvzip_entry(tmp_path)
    (name,) = entries(tmp_path)
    size = (tmp_path / name).stat().st_size
    cap = int(size * 2.5)  # two entries (their sizes differ by a few bytes)
    store = store_on(tmp_path, cap=cap)
    asks = [[7, 8, 9, 10 + k] for k in range(3)]
    serve_kvzip(model, store, DOC + asks[0])
    os.utime(tmp_path / name, (1, 1))  # the oldest use
    serve_kvzip(model, store, DOC + asks[1])
    total = sum((tmp_path / n).stat().st_size for n in entries(tmp_path))
    assert total <= cap and len(entries(tmp_path)) == 2
    assert name not in entries(tmp_path)
    serve_kvzip(model, store, DOC + asks[2])
    assert sum((tmp_path / n).stat().st_size for n in entries(tmp_path)) <= cap
    assert store.disk.nbytes <= cap
    # a restart sees what is there and no more
    assert store_on(tmp_path, cap=cap).disk.nbytes <= cap


def test_a_directory_that_cannot_be_made_is_one_line_and_serving_goes_on(
    tmp_path, caplog
):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    model = tiny_model("llama")
    with caplog.at_level(logging.INFO, logger="veloxpatch.serve"):
        store = store_on(blocker / "cache")
        first = serve_kvzip(model, store, DOC + ASK_A)
        again = serve_kvzip(model, store, DOC + ASK_A)
    assert len(lines(caplog, "prompt cache on disk: cannot use")) == 1
    assert not lines(caplog, "not written")
    assert again[2] == len(DOC + ASK_A) - 1 and again[0] == first[0]  # memory


def test_a_full_disk_is_one_line_per_entry_and_serving_goes_on(
    tmp_path, caplog, monkeypatch
):
    def full(path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"x" * 10)  # a partial temporary file, then the device fills
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    model = tiny_model("llama")
    store = store_on(tmp_path)
    monkeypatch.setattr(mx, "save_safetensors", full)
    with caplog.at_level(logging.INFO, logger="veloxpatch.serve"):
        first = serve_kvzip(model, store, DOC + ASK_A)
    failed = lines(caplog, "entry not written")
    assert len(failed) == 1 and "No space left" in failed[0].getMessage()
    assert os.listdir(tmp_path) == []  # the temporary file did not stay
    assert first[0] and len(store) == 1  # kept in memory all the same


# ---- end to end, embedded SmolLM2 ------------------------------------------------
FACTS = (
    "Notes for the trip. The museum opens at nine and closes at six. Tickets "
    "cost twelve euros. The capital of France is Paris, and the train from the "
    "airport takes thirty minutes. Lunch is served between noon and two. "
) * 3
ARGS = ["--algo", "kvzip", "--budget", "64", "--max-tokens", "12"]


def ask(srv, messages):
    status, body = srv.post({"messages": messages, "temperature": 0.0})
    assert status == 200, body
    r = json.loads(body)
    return r, r["usage"]["prompt_tokens_details"]["cached_tokens"]


def written(srv, n=1):
    """Wait for the server's n-th disk write: the generation thread keeps a
    request's entry after its answer has gone out."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        log = srv.log.read_text()
        if log.count("prompt cache on disk: wrote") >= n:
            return
        time.sleep(0.1)
    pytest.fail(f"no entry written:\n{log}")


@smollm
def test_a_restarted_server_continues_from_its_entries_on_disk(tmp_path):
    d = str(tmp_path / "entries")
    first = [{"role": "user", "content": FACTS + "How much do tickets cost?"}]
    with running_server(*ARGS, "--prompt-cache-dir", d, limit_s=240) as srv:
        r1, cached = ask(srv, first)
        assert cached == 0
        written(srv)
    n = r1["usage"]["prompt_tokens"]
    text = r1["choices"][0]["message"]["content"]
    second = first + [
        {"role": "assistant", "content": text},
        {"role": "user", "content": "When is lunch served?"},
    ]
    with running_server(*ARGS, "--prompt-cache-dir", d, limit_s=240) as srv:
        again, cached_again = ask(srv, first)
        _, cached_turn = ask(srv, second)
        log = srv.log.read_text()
    assert cached_again == n - 1
    assert again["choices"][0]["message"]["content"] == text
    assert cached_turn >= n
    assert "prompt cache on disk: loaded" in log
    assert "--prompt-cache-disk-bytes 10,000,000,000" in log


@smollm
def test_a_restarted_server_skips_damaged_partial_and_foreign_entries(tmp_path):
    d = tmp_path / "entries"
    first = [{"role": "user", "content": FACTS + "How much do tickets cost?"}]
    with running_server(*ARGS, "--prompt-cache-dir", str(d), limit_s=240) as srv:
        r1, _ = ask(srv, first)
        written(srv)
    # the prompt's entry: batched, mlx-lm also keeps its segments' (as they race)
    name = max(entries(d), key=lambda n: len(stored_tokens(d / n)))
    shutil.copy(d / name, d / f"{name}.99-0badf00d.tmp.safetensors")
    data = bytearray((d / name).read_bytes())
    data[-64] ^= 0x10
    (d / name).write_bytes(bytes(data))
    with running_server(*ARGS, "--prompt-cache-dir", str(d), limit_s=240) as srv:
        r2, cached = ask(srv, first)
        written(srv)  # served from scratch, its entry written anew
        log = srv.log.read_text()
    assert cached == 0
    assert log.count("a partial write") == 1
    assert log.count(f"removed {name}: not loaded") == 1
    assert "checksum mismatch" in log
    other = ["--algo", "snapkv", "--budget", "64", "--max-tokens", "12"]
    with running_server(*other, "--prompt-cache-dir", str(d), limit_s=240) as srv:
        _, cached_other = ask(srv, first)
        log_other = srv.log.read_text()
    assert cached_other == 0
    assert log_other.count(f"removed {name}: written by another model") == 1
    assert (
        r2["choices"][0]["message"]["content"] == r1["choices"][0]["message"]["content"]
    )
