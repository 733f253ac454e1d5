"""The evaluation primitives, on a tiny model (fast) and the SmolLM2 tokenizer."""

import pytest
from conftest import smollm
from test_kvzip import TOK
from tiny import prompt_tokens, tiny_model

from veloxpatch import prose as text
from veloxpatch.errors import OptionError
from veloxpatch.eval.arms import Arm, expand, parse_arm, split_arms
from veloxpatch.eval.metrics import evaluate_continuation
from veloxpatch.eval.passkey import make_case, make_cases, sign_test, wilson
from veloxpatch.prose import LICENSE_SPLITS, LICENSES, prose


def test_prose_halves_do_not_overlap():
    cal, ev = prose("calibration"), prose("evaluation")
    assert len(cal) > 150_000 and len(ev) > 150_000
    cal_paras = set(p for p in cal.split("\n") if len(p) > 80)
    ev_paras = set(p for p in ev.split("\n") if len(p) > 80)
    assert not cal_paras & ev_paras


@pytest.mark.skipif(
    not all(
        (LICENSES / n).is_file() for names in LICENSE_SPLITS.values() for n in names
    ),
    reason="Debian's licence texts are not on this machine",
)
def test_licence_halves_do_not_overlap():
    cal, ev = prose("licenses-calibration"), prose("licenses-evaluation")
    assert len(cal) > 50_000 and len(ev) > 50_000
    cal_paras = set(p for p in cal.split("\n") if len(p) > 80)
    assert not cal_paras & set(p for p in ev.split("\n") if len(p) > 80)


def test_missing_licence_texts_are_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(text, "LICENSES", tmp_path)
    with pytest.raises(OptionError, match="lacks GPL-3"):
        text.check_source("licenses-evaluation")


def test_agnostic_continuation_compresses_before_any_continuation_token():
    # kvzip reconstructs the context (not its own prompt queries), and its
    # kept set, so its result, differs from the aware protocol's
    model = tiny_model("llama")
    ids = prompt_tokens(120).tolist()
    arms = [Arm("full"), Arm("kvzip", {"budget": 24, "sinks": 2})]
    aware = evaluate_continuation(model, arms, ids[:90], ids[90:], 32)
    agnostic = evaluate_continuation(model, arms, ids[:90], ids[90:], 32, TOK)
    assert agnostic[0].perplexity == aware[0].perplexity  # full: one protocol
    assert agnostic[1].kl != aware[1].kl and agnostic[1].kv_bytes < aware[0].kv_bytes


def test_broken_arm_scores_worse_than_full():
    model = tiny_model("llama")
    ids = prompt_tokens(120).tolist()
    context, cont = ids[:90], ids[90:]
    full, good, broken = evaluate_continuation(
        model,
        [
            Arm("full"),
            Arm("knorm", {"budget": 80}),
            Arm("streaming_llm", {"budget": 1, "sinks": 0}),
        ],
        context,
        cont,
        prefill_step_size=32,
    )
    assert full.agreement == 1.0 and abs(full.kl) < 1e-6
    assert broken.perplexity > full.perplexity * 1.05
    assert broken.agreement < 0.9 and broken.kl > 10 * max(good.kl, 1e-4)
    assert broken.kv_bytes < good.kv_bytes < full.kv_bytes
    assert full.prefill_step_size == 32 and broken.options == {"budget": 1, "sinks": 0}
    # the profile's spans cover the 30 positions, and their mean is the KL
    assert list(broken.kl_profile) == ["0-8", "8-30"]
    mean = (8 * broken.kl_profile["0-8"] + 22 * broken.kl_profile["8-30"]) / 30
    assert abs(mean - broken.kl) < 1e-4 * max(1.0, broken.kl)
    assert all(abs(v) < 1e-6 for v in full.kl_profile.values())


def test_arm_syntax():
    arm = parse_arm("knorm:budget=256,recent=8")
    assert arm == Arm("knorm", {"budget": 256, "recent": 8})
    assert arm.label == "knorm:budget=256,recent=8"
    arms = expand(["full", "knorm", "streaming_llm:budget=64"], [128, 256])
    assert [a.label for a in arms] == [
        "full",
        "knorm:budget=128",
        "knorm:budget=256",
        "streaming_llm:budget=64",
    ]


def test_arm_lists_with_several_options():
    text = "full, snapkv:budget=256,window=16,kivi:bits=2,recipe=kivi,h2o"
    assert split_arms(text) == [
        "full",
        "snapkv:budget=256,window=16",
        "kivi:bits=2,recipe=kivi",
        "h2o",
    ]
    assert parse_arm(split_arms(text)[2]).options == dict(bits=2, recipe="kivi")
    with pytest.raises(OptionError):
        split_arms("budget=3,full")


def test_wilson_interval():
    lo, hi = wilson(8, 10)
    assert lo == pytest.approx(0.490, abs=1e-3) and hi == pytest.approx(0.943, abs=1e-3)
    assert wilson(0, 30)[0] == 0.0 and wilson(30, 30)[1] == 1.0


def test_sign_test_is_mcnemars_exact_p():
    assert sign_test(8, 1) == pytest.approx(20 / 512)  # 2 * (1 + 9) / 2**9
    assert sign_test(1, 8) == sign_test(8, 1)
    assert sign_test(3, 3) == 1.0 and sign_test(0, 0) == 1.0
    assert sign_test(6, 0) == pytest.approx(2 / 64)


@smollm
def test_passkey_cases_are_seeded_and_placed(loaded):
    _, tokenizer = loaded
    cases = make_cases(tokenizer, 5, context_tokens=600, seed=3)
    again = make_cases(tokenizer, 5, context_tokens=600, seed=3)
    assert [c.prompt for c in cases] == [c.prompt for c in again]
    assert len({c.key for c in cases}) == 5
    assert [round(c.depth, 3) for c in cases] == [0.05, 0.275, 0.5, 0.725, 0.95]
    for c in cases:
        text = tokenizer.decode(c.prompt)
        assert text.startswith("<|im_start|>") and "secret number" in text[-140:]
        assert text.endswith("<|im_start|>assistant\nThe secret number is")
        where = text.index(c.key) / len(text)
        assert abs(where - c.depth) < 0.15
        assert 550 <= len(c.prompt) <= 700
    shallow = make_case(tokenizer, 600, 0.05, seed=1)
    assert shallow.correct(f" {shallow.key}.")
    assert not shallow.correct("12345")


def test_decoded_lead_in_same_answer_replayed_or_direct(loaded):
    # The lead-in fed as answer tokens: replayed prefill and a direct chunked
    # prefill give the same answers; lookahead compresses before the digits.
    from veloxpatch.eval.runner import run_case

    model, tokenizer = loaded
    case = make_case(tokenizer, 400, 0.5, seed=4)
    assert case.lead_in == 4
    arms = [Arm("full"), Arm("snapkv", dict(budget=96, window=8, lookahead=3))]
    replayed = run_case(model, tokenizer, case, arms, decode_lead_in=True)
    direct = run_case(model, tokenizer, case, arms, 128, decode_lead_in=True)
    assert [r["answer"] for r in replayed] == [r["answer"] for r in direct]
    assert replayed[0]["correct"] and replayed[0]["lead_in"] == "decoded"
    full_kv, snap_kv = (r["kv_bytes"] for r in replayed)
    assert snap_kv < full_kv / 3  # compressed during the lead-in


def test_task_names_map_to_tasks_in_registry_order():
    from veloxpatch.eval.harness import make_tasks, parse_tasks
    from veloxpatch.eval.tasks import ContinuationTask, PasskeyTask

    params = dict(context=300, cases=2, segments=1, continuation=12, out="x.json")
    tasks = make_tasks(parse_tasks("agreement, passkey,ppl"), params)
    assert [type(t) for t in tasks] == [PasskeyTask, ContinuationTask]  # ppl once
    assert tasks[0].cases == 2 and tasks[1].continuation == 12
    assert tasks[1].prefill_step_size == 2048  # not given: the field's default
    with pytest.raises(OptionError, match="unknown task"):
        parse_tasks("passkey,speed")


def test_task_options_are_checked_when_made():
    from veloxpatch.eval.tasks import ContinuationTask, PasskeyTask

    for cls, bad, msg in [
        (PasskeyTask, dict(cases=0), "--cases"),
        (PasskeyTask, dict(context=50), "--context"),
        (ContinuationTask, dict(segments=0), "--segments"),
        (ContinuationTask, dict(text="no/such/file.txt"), "--text"),
    ]:
        with pytest.raises(OptionError, match=msg):
            cls.from_params(bad)
