"""Sharded models on the ring backend: two processes on loopback run
`sharded_worker.py`, which compares a tensor-sharded (`model.shard()`) and a
pipeline-sharded tiny model with the whole one for every algorithm: greedy
tokens, and per layer and KV head the positions kept (plus bit widths and
quantized rows where quantized). Also: heads that do not divide by the group
size, and a model sharded after `apply`, are clear errors."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from sharded_worker import BATCHED
from tiny import SCORER, tiny_model

import veloxpatch
from veloxpatch.errors import CalibrationError, OptionError, UnsupportedModelError

HERE = Path(__file__).parent
RANKS = 2
TIMEOUT_S = 240  # ~8 s on an idle two-core machine; collectives slow under load


def free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free on loopback (the ring backend listens on
    one port per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n > 65535:
            continue
        try:
            for p in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return first
    raise RuntimeError("no free loopback ports")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Each rank's results (sharded_worker.py writes rank{r}.json). The ranks
    get what `mlx.launch --backend ring` gives them (MLX_RANK, MLX_HOSTFILE),
    without the launcher: its output threads poll without waiting and took a
    core from the ranks (20 s against 7 s here)."""
    out = tmp_path_factory.mktemp("sharded")
    port = free_ports(RANKS)
    hostfile = out / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port + r}"] for r in range(RANKS)]))
    root = str(HERE.parent)
    env = dict(os.environ, MLX_HOSTFILE=str(hostfile))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    # in a session of their own, so a timeout ends both ranks; output to files,
    # so neither blocks on a full pipe while the other waits in a collective
    logs = [out / f"rank{r}.log" for r in range(RANKS)]
    procs = []
    for r in range(RANKS):
        with logs[r].open("w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / "sharded_worker.py"), str(out)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=dict(env, MLX_RANK=str(r)),
                    start_new_session=True,
                )
            )
    try:
        for proc in procs:
            proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        tail = logs[0].read_text()[-3000:]
        pytest.fail(f"the ranks did not finish in {TIMEOUT_S} s:\n{tail}")
    files = [out / f"rank{r}.json" for r in range(RANKS)]
    missing = [f.name for f in files if not f.exists()]
    codes = [proc.returncode for proc in procs]
    assert codes == [0] * RANKS and not missing, (
        f"ranks exited {codes}, missing {missing}:\n"
        + "\n".join(log.read_text()[-1500:] for log in logs)
    )
    return [json.loads(f.read_text()) for f in files]


def test_every_rank_keeps_what_the_whole_model_keeps(ranks):
    expected = set()
    for algo in veloxpatch.algos():
        expected |= {f"tensor/{algo}", f"pipeline/{algo}"}
    # kvzip's and kvzap's one choice over all layers is refused on pipeline
    # stages (per layer it runs)
    expected -= {"pipeline/kvzip", "pipeline/kvzap"}
    for split in ("tensor", "pipeline"):
        expected |= {f"{split}/{v}" for v in ("kvzip-layerwise", "kvzap-layerwise")}
        expected.add(f"{split}/kvzap-threshold")
        expected |= {f"{split}/batch-{name}" for name, _, _ in BATCHED}
    failures = []
    for result in ranks:
        assert result["size"] == RANKS
        assert expected <= set(result["runs"])
        for name, run in result["runs"].items():
            where = f"rank {result['rank']} {name}"
            if "error" in run:
                failures.append(f"{where}: {run['error']}")
            elif not run["tokens_equal"]:
                failures.append(
                    f"{where}: tokens {run['tokens']} != {run['whole_tokens']}"
                )
            elif not run["kept_equal"]:
                failures.append(f"{where}: {json.dumps(run['mismatch'])[:800]}")
    assert not failures, "\n".join(failures)


def test_heads_that_do_not_divide_are_refused_before_the_first_forward(ranks):
    for result in ranks:
        message = result["refusals"]["uneven"]
        assert message is not None, "apply accepted heads split unevenly"
        assert "6 query heads and 3 KV heads do not divide by 2" in message
        assert "\n" not in message


def test_a_kvzap_scorer_for_another_model_is_refused_on_every_rank(ranks):
    for result in ranks:
        message = result["refusals"]["kvzap_other_model"]
        assert message is not None and "calibrated for another model" in message
        assert "\n" not in message


def test_sharding_after_apply_is_refused(ranks):
    for result in ranks:
        message = result["refusals"]["sharded_after_apply"]
        assert message is not None and "sharded after veloxpatch.apply" in message


# ---- in one process: what apply reads off a split model (no mlx.launch needed)
class TwoRanks:
    """Stands in for an mlx.core.distributed.Group of two, as rank `r`."""

    def __init__(self, r: int = 0):
        self.r = r

    def size(self):
        return 2

    def rank(self):
        return self.r


def test_uneven_heads_are_refused_by_apply():
    model = tiny_model("llama", num_attention_heads=6, num_key_value_heads=3)
    for layer in model.layers:  # what model.shard(group) leaves on each attention
        attn = layer.self_attn
        attn.q_proj.group = TwoRanks()
        attn.n_heads //= 2
        attn.n_kv_heads //= 2
    with pytest.raises(UnsupportedModelError, match="3 KV heads do not divide by 2"):
        veloxpatch.apply(model, "tova")
    assert veloxpatch.api.patch_of(model) is None


def test_a_pipeline_stage_numbers_its_layers_in_the_whole_model():
    model = tiny_model("qwen2")  # 3 layers: rank 0 of 2 runs layers 1 and 2
    model.model.pipeline(TwoRanks(0))
    with veloxpatch.patched(model, "pyramidkv", budget=16, window=4) as patch:
        caches = patch.make_cache()
    assert [(c.layer, c.num_layers) for c in caches] == [(1, 3), (2, 3)]


def test_calibration_files_are_refused_on_a_split_model():
    model = tiny_model("qwen2")
    model.model.pipeline(TwoRanks(1))
    with pytest.raises(CalibrationError, match="cannot be used on a sharded model"):
        veloxpatch.apply(model, "qfilters", filters="filters.safetensors")


def test_kvzap_one_choice_over_all_layers_is_refused_on_a_pipeline_stage():
    from tiny import resolve_options

    model = tiny_model("qwen2")
    opts = resolve_options(model, dict(scorer=SCORER, budget=64))
    model.model.pipeline(TwoRanks(0))
    with pytest.raises(OptionError, match="layerwise=True or a threshold"):
        veloxpatch.apply(model, "kvzap", **opts)
    assert veloxpatch.api.patch_of(model) is None
