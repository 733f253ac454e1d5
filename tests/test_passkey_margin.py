"""scripts/studies/passkey_margin.py: an answer teacher-forced one token per call
gives the NLL and margin that one forward over the whole answer gives, and the
summary pairs each arm with full on the same answers."""

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from tiny import prompt_tokens, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "studies"))
import passkey_margin  # noqa: E402
import passkey_recheck  # noqa: E402

# a study's tests: deselected by default, run with `pytest -m study`
pytestmark = pytest.mark.study


def test_one_token_a_call_is_one_forward_over_the_answer():
    model = tiny_model("llama")
    ids = prompt_tokens(40).tolist()
    context, question, target = ids[:30], ids[30:36], ids[36:40]
    caches = make_prompt_cache(model)
    model(mx.array([context]), cache=caches)
    nll, margin = passkey_margin.answer_margin(model, question, target, caches)

    whole = model(mx.array([ids]))[0].astype(mx.float32)  # no cache: the oracle
    rows = whole[len(context) + len(question) - 1 : -1]
    logp = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    want = mx.array(target)
    expect_nll = -mx.take_along_axis(logp, want[:, None], -1).sum().item()
    right = mx.take_along_axis(rows, want[:, None], -1)[:, 0]
    others = mx.where(mx.arange(rows.shape[-1]) == want[:, None], -mx.inf, rows)
    expect_margin = (right - others.max(-1)).min().item()
    assert nll == pytest.approx(expect_nll, rel=1e-4, abs=1e-4)
    assert margin == pytest.approx(expect_margin, rel=1e-4, abs=1e-4)


def test_summary_pairs_arms_with_full():
    raw = []
    for case in ("0:0", "0:1", "1:0"):
        for q in (0, 1):
            base = {"case": case, "question": q}
            raw.append(base | {"arm": "full", "nll": 1.0 + q, "margin": 2.0})
            worse = {"nll": 1.25 + q, "margin": -0.5 if case == "1:0" else 1.5}
            raw.append(base | {"arm": "kivi", **worse})
    table = {r["arm"]: r for r in passkey_margin.summary(raw)}
    assert table["full"]["misses"] == 0 and table["kivi"]["misses"] == 2
    assert table["kivi"]["nll_minus_full"] == pytest.approx(0.25)
    assert table["kivi"]["nll_minus_full_ci"] == pytest.approx([0.25, 0.25])
    assert table["kivi"]["margin_minus_full"] == pytest.approx(
        (4 * -0.5 + 2 * -2.5) / 6
    )
    lo, hi = table["kivi"]["margin_minus_full_ci"]
    assert -2.5 <= lo < hi <= -0.5
    assert passkey_recheck.seed_range("42-46") == [42, 43, 44, 45, 46]
    assert passkey_recheck.seed_range("7") == [7]


def test_cases_are_named_or_a_seed_range_and_checked_before_loading(capsys):
    ap = argparse.ArgumentParser()
    passkey_margin.add_case_arguments(ap, "42-51")
    assert ap.parse_args(["--cases", "59:2,63:5"]).cases == "59:2,63:5"
    assert passkey_recheck.picked_cases("59:2,63:5") == [(59, 2), (63, 5)]
    for bad in (["--cases", "59:10"], ["--cases", "59"], ["--cases", "x:1"], []):
        with pytest.raises(SystemExit):
            ap.parse_args(bad)
    assert "index 0 to 9" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ap.parse_args(["--cases", "59:2", "--seeds", "42-43"])
