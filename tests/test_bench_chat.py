"""scripts/bench_chat.py's pure parts (no server, no model): the interval, what
counts as a right number, the messages a chat client sends, the cross-user
comparison, the per-arm summary, and its Markdown table; and (a study, marked)
the second turn scripts/studies/chat_kept_cache.py appends to a kept cache."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_chat as bc  # noqa: E402


def test_proportion_has_a_wilson_interval():
    p = bc.proportion([True, True, True, False])
    assert (p["correct"], p["cases"]) == (3, 4)
    lo, hi = p["wilson95"]
    assert lo < 0.75 < hi
    assert bc.proportion([True])["wilson95"][0] == pytest.approx(0.2065, abs=1e-4)
    assert bc.proportion([])["wilson95"] == [0.0, 1.0]


def test_code_extraction_and_correctness():
    assert bc.extract_code("The secret number is 6 0 4 9 4.") == "60494"
    assert bc.extract_code('It is "27611".') == "27611"
    assert bc.extract_code("The number is 10.") is None
    assert bc.extract_code("") is None
    assert bc.code_correct("60494", "The secret number is 60 494.")
    assert bc.code_correct("60494", "x160494x")  # its digits appear
    assert not bc.code_correct("60494", "The secret number is 60485.")
    assert not bc.code_correct("60494", "60,494")  # only spaces are removed


def test_messages_as_a_chat_client_sends_them():
    first = bc.first_messages("DOC", bc.SUMMARY_Q)
    assert first == [{"role": "user", "content": f"DOC\n\n{bc.SUMMARY_Q}"}]
    second = bc.second_messages(first, "A summary.", bc.CODE_Q)
    assert second[0] == first[0]
    assert second[1:] == [
        {"role": "assistant", "content": "A summary."},
        {"role": "user", "content": bc.CODE_Q},
    ]
    assert not any(m["role"] == "system" for m in second)
    assert bc.questions("needle_second") == (bc.SUMMARY_Q, bc.CODE_Q)
    assert bc.questions("needle_first") == (bc.CODE_Q, bc.SUMMARY_Q)
    with pytest.raises(ValueError):
        bc.questions("sideways")


def _pair(code_a, code_b, summary_a="S", summary_b="S"):
    return {
        "code_first": {"code": code_a, "summary": summary_a},
        "summary_first": {"code": code_b, "summary": summary_b},
    }


def test_cross_user_comparison():
    pairs = [
        _pair("It is 12345.", "It is 12345."),
        _pair("It is 12345.", "It is 100."),  # a question-specific cache leaked
        _pair("It is 54321.", "It is 54321.", "one", "another"),
    ]
    assert bc.cross_user_compare(pairs) == {
        "cross_user_same": 2,
        "summary_same": 2,
        "pairs": 3,
    }
    # identical text, not merely the same number
    assert (
        bc.cross_user_compare([_pair("12345", "It is 12345.")])["cross_user_same"] == 0
    )


def _turn(prompt, cached, kv=1000, ttft=1.0):
    return {
        "text": "",
        "ttft_s": ttft,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "kv_held_bytes": kv,
        "full_kv_bytes": 4000,
        "prompt_cache_bytes": None,
        "prompt_cache_gb": 0.01,
    }


def _conversation(depth, correct, leaked=False, cached=110):
    return {
        "depth": depth,
        "correct": correct,
        "key_in_turn1_reply": leaked,
        "turns": [_turn(100, 24, ttft=10.0), _turn(120, cached, kv=2000)],
    }


def _row():
    convs = {
        "needle_second": [
            _conversation(0.1, True),
            _conversation(0.3, False),
            _conversation(0.1, True, leaked=True, cached=24),
        ],
        "needle_first": [_conversation(0.1, True), _conversation(0.3, True)],
    }
    return bc.summarize("snapkv", convs, [_pair("1", "1"), _pair("1", "2")])


def test_summary_of_an_arm():
    row = _row()
    assert row["needle_second_turn2_code"]["correct"] == 2
    assert row["needle_second_turn2_code"]["cases"] == 3
    assert row["needle_first_turn1_code"]["correct"] == 2
    assert row["needle_second_by_depth"]["0.1"]["correct"] == 2
    assert row["needle_second_key_in_summary"] == 1
    assert row["needle_second_turn2_code_key_not_in_summary"]["cases"] == 2
    assert row["kv_bytes_per_conversation"] == 2000
    assert row["turn2_reused_turn1"] == 4  # one turn 2 reused 24 of 100
    assert row["ttft_turn1_s_median"] == 10.0
    assert row["prompt_cache_bytes_max"] is None
    assert row["prompt_cache_gb_max"] == 0.01
    assert (row["cross_user_same"], row["pairs"]) == (1, 2)


def test_server_commands_stay_on_loopback():
    cmd = bc.server_command("snapkv", 256, 9)
    assert cmd[1:4] == ["-m", "veloxpatch.cli", "serve"]
    assert cmd[cmd.index("--budget") + 1] == "256"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert "--budget" not in bc.server_command("full", 256, 9)
    assert "--serve-unpatched" in bc.server_command(bc.UNPATCHED, 256, 9)
    assert bc.server_label("kvzip", 256) == "veloxpatch serve --algo kvzip --budget 256"
    with pytest.raises(SystemExit):
        bc.server_command("h2o_typo", 256, 9)
    # options go to the server; quantized rows take no budget
    cmd = bc.server_command("kivi:bits=2,recipe=kivi", 256, 9)
    assert "--budget" not in cmd and cmd[cmd.index("--algo") + 1] == "kivi"
    args = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--algo-arg"]
    assert args == ["bits=2", "recipe=kivi"]
    assert bc.server_label("snapkv:kv_bits=4", 256) == (
        "veloxpatch serve --algo snapkv --budget 256 --algo-arg kv_bits=4"
    )


def test_never_a_calibration_split():
    for split in ("calibration", "licenses-calibration"):
        with pytest.raises(SystemExit):
            bc.check_text(split)


def test_markdown_table_beside_the_results(tmp_path):
    res = {
        "run": {"git_commit": "abc1234", "time_utc": "2026-01-01T00:00:00Z"},
        "command": ".venv/bin/python scripts/bench_chat.py",
        "config": {"conversations": 3},
        "table": [_row(), {"arm": "kvzip", "error": "RuntimeError: a | b\nmore"}],
    }
    out = tmp_path / "bench_chat.json"
    text = bc.write_markdown(out, res).read_text()
    assert (tmp_path / "bench_chat.md").is_file()
    assert "[`bench_chat.json`](bench_chat.json)" in text and "`abc1234`" in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows[0].startswith("| `snapkv` | 2/3 [0.21, 0.94] | 2/2 [")
    assert rows[0].endswith("| 1/2 |")
    # a failed arm keeps the table: its error is one escaped cell
    assert rows[1].count("|") - rows[1].count("\\|") == rows[0].count("|")


def test_kvzap_is_served_with_its_scorer_and_added_arms_share_the_documents(
    tmp_path,
):
    cmd = bc.server_command("kvzap", 256, 9000, "s.safetensors")
    assert cmd[cmd.index("--algo-arg") + 1] == "scorer=s.safetensors"
    config = {k: 1 for k in bc.SHARED} | {"arms": "kvzap"}
    path = tmp_path / "chat.json"
    old = {"config": {**config, "arms": "full"}, "table": [{"arm": "full"}]}
    path.write_text(json.dumps(old))
    got = bc.added_to(str(path), config, {"command": "c"})
    assert got["table"] == [{"arm": "full"}]
    assert got["added"] == [{"arms": "kvzap", "command": "c"}]
    with pytest.raises(SystemExit, match="seed"):
        bc.added_to(str(path), {**config, "seed": 2}, {})


def test_kvzap_with_another_scorer_is_a_row_of_its_own():
    assert bc.row_label("kvzap") == "kvzap"
    assert bc.row_label("kvzap", bc.SCORER) == "kvzap"
    assert (
        bc.row_label("kvzap", "x/s_39k.safetensors") == "kvzap:scorer=s_39k.safetensors"
    )
    assert bc.row_label("kvzip", "x/s_39k.safetensors") == "kvzip"


class ChatML:
    """A ChatML template, as SmolLM2's (it strips what each message says)."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        text = "".join(
            f"<|im_start|>{m['role']}\n{m['content'].strip()}<|im_end|>\n"
            for m in messages
        )
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@pytest.mark.study
def test_a_kept_cache_second_turn_is_what_the_template_adds_after_the_reply():
    sys.path.insert(0, str(ROOT / "scripts" / "studies"))
    import chat_kept_cache as kc

    tok, reply = ChatML(), " The text is about Python. \n"
    first = bc.first_messages("Some prose.", bc.SUMMARY_Q)
    tail = kc.second_turn_text(tok, first, reply, bc.CODE_Q)
    opened = tok.apply_chat_template(first, add_generation_prompt=True, tokenize=False)
    whole = tok.apply_chat_template(
        bc.second_messages(first, reply, bc.CODE_Q),
        add_generation_prompt=True,
        tokenize=False,
    )
    assert opened + reply.strip() + tail == whole
    assert tail.startswith("<|im_end|>\n<|im_start|>user\n" + bc.CODE_Q)
