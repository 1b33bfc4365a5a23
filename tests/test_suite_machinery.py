"""The suite's own machinery, asserted (issue 53, build item 6): DeepSpeed's CPU ops are built before the first slow
test and never for a quick one (conftest.py's autouse fixture), and the launches per file that the terminal summary
reports are counted where they start, once each, and added up from the pytest-xdist workers."""

import collections
import subprocess
import sys
import types

import pytest

from launching import REPO, on_a_terminal, run_command

conftest = sys.modules["conftest"]  # tests/conftest.py, as pytest imported it (its counters are the live ones)


def test_conftest_is_the_suites():
    assert conftest.__file__ == str(REPO / "tests" / "conftest.py")


def test_a_quick_test_does_not_build_deepspeeds_ops(request):
    """The quick subset never waits for DeepSpeed's compilers (minutes in a fresh environment)."""
    assert "deepspeed_ops" not in request.fixturenames


@pytest.mark.slow
def test_a_slow_test_finds_deepspeeds_ops_built(request):
    """Every slow test has them built before it starts, whichever is first (a GPU test, a Slurm test, a launch of
    any engine), so no launch compiles them inside its own time limit."""
    assert "deepspeed_ops" in request.fixturenames
    seconds, built = request.config.stash[conftest.DEEPSPEED_OPS]
    assert seconds >= 0 and all(line.startswith("cpu_route: compiled ") for line in built), built


def test_each_launch_counts_once_for_the_file_it_runs_in(request):
    """A Python interpreter started through run_command, and one on a terminal of its own, each add one to this
    file's count; a program that is no launcher (`true`) adds nothing."""
    here = request.node.nodeid.split("::")[0]
    before = conftest.LAUNCHES[here]
    assert run_command([sys.executable, "-c", "pass"])[0] == 0
    assert conftest.LAUNCHES[here] == before + 1
    assert on_a_terminal([sys.executable, "-c", "pass"], timeout=60)[0] == 0
    assert conftest.LAUNCHES[here] == before + 2
    subprocess.run(["true"], check=True)
    assert conftest.LAUNCHES[here] == before + 2


def test_the_summary_adds_up_every_workers_counts(monkeypatch):
    """A worker hands its counts and its DeepSpeed build to the controller (pytest_sessionfinish), which adds the
    workers' counts up (pytest_testnodedown) and prints them with the longest build (pytest_terminal_summary)."""
    worker = types.SimpleNamespace(config=types.SimpleNamespace(workeroutput={}, stash=pytest.Stash()))
    monkeypatch.setattr(conftest, "LAUNCHES", collections.Counter({"tests/test_a.py": 3}))
    worker.config.stash[conftest.DEEPSPEED_OPS] = (41.0, ["cpu_route: compiled deepspeed_shm_comm in 40 s"])
    conftest.pytest_sessionfinish(worker)
    handed = worker.config.workeroutput
    assert handed == {"launches": {"tests/test_a.py": 3},
                      "deepspeed_ops": [41.0, ["cpu_route: compiled deepspeed_shm_comm in 40 s"]]}

    monkeypatch.setattr(conftest, "LAUNCHES", collections.Counter())
    controller = types.SimpleNamespace(stash=pytest.Stash())
    conftest.pytest_testnodedown(types.SimpleNamespace(workeroutput=handed, config=controller), None)
    other = {"launches": {"tests/test_a.py": 1, "tests/test_b.py": 5}, "deepspeed_ops": [2.0, []]}
    conftest.pytest_testnodedown(types.SimpleNamespace(workeroutput=other, config=controller), None)
    lines = []
    conftest.pytest_terminal_summary(types.SimpleNamespace(write_line=lines.append), controller)
    assert lines == ["DeepSpeed's CPU ops, before the first slow test: 41 s (compiled deepspeed_shm_comm in 40 s)",
                     "launches: 9 (Python, accelerate launch, torchrun, sbatch); per file: test_b.py 5, test_a.py 4"]
