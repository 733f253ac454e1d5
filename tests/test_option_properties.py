"""Property tests over every algorithm's options: any value of any option is
either refused with one clear line before anything is patched, or accepted, and
then a short generation gives finite log-probabilities."""

import math

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_contract import CONTRACT, HEAD_DIM
from tiny import prompt_tokens, resolve_options, tiny_model

import veloxpatch
from veloxpatch.api import algorithm
from veloxpatch.errors import VeloxpatchError

VALUES = st.one_of(
    st.integers(-(10**12), 10**12),
    st.integers(-(2**64), 2**64),
    st.integers(-4, 70),  # the range where most options are valid
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(0, 1),
    st.sampled_from([None, True, False, "", "max", "avg", "adaptive", "exact", [], {}]),
    st.text(max_size=8),
)
MODEL = tiny_model("llama", head_dim=HEAD_DIM, num_hidden_layers=2)


def fields(algo):
    return algorithm(algo).Options.option_names()


def run_short(model, algo, options):
    """Log-probabilities of 30 prompt tokens in 3 chunks, then 6 decode steps."""
    with veloxpatch.patched(model, algo, **options) as patch:
        caches = patch.make_cache()
        tokens = prompt_tokens(36).tolist()
        out = []
        for start, end in [(0, 12), (12, 24), (24, 30)] + [
            (i, i + 1) for i in range(30, 36)
        ]:
            logits = model(mx.array(tokens[start:end])[None], cache=caches)
            mx.eval(logits, [c.state for c in caches] if end - start > 1 else [])
            out.append(logits[0, -1])
    return mx.stack(out)


@pytest.mark.parametrize("algo", veloxpatch.algos())
@settings(
    max_examples=40,
    derandomize=True,  # the same examples in every run: CI stays reproducible
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_any_option_value_is_refused_clearly_or_gives_finite_output(algo, data):
    if not fields(algo):
        return
    name = data.draw(st.sampled_from(fields(algo)), label="option")
    value = data.draw(VALUES, label="value")
    options = {**resolve_options(MODEL, CONTRACT[algo]), name: value}
    try:
        logits = run_short(MODEL, algo, options)
    except VeloxpatchError as e:
        message = str(e)
        assert message and "\n" not in message
        assert veloxpatch.api.patch_of(MODEL) is None
        return
    assert bool(mx.isfinite(logits).all().item()), (name, value)
    assert not (isinstance(value, float) and not math.isfinite(value)), (name, value)


@pytest.mark.parametrize(
    "algo, name", [("kvzap", "scorer"), ("qfilters", "filters"), ("a2ats", "codebook")]
)
@pytest.mark.parametrize("path", ["\n", "a\tb.safetensors"])
def test_a_file_option_with_control_characters_is_one_line(algo, name, path):
    # the errors that name the file must stay one line (hypothesis found "\n")
    with pytest.raises(VeloxpatchError) as e:
        veloxpatch.apply(MODEL, algo, **{name: path})
    assert "\n" not in str(e.value) and "must be a file path" in str(e.value)
