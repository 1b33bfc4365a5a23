"""recipes/runkit/stopping.py without a training run: the stop agreement between ranks, the line that says how to
stop a run, and a worker whose launcher is gone before it starts. Quick: no launch."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from launching import REPO

sys.path.insert(0, str(REPO / "recipes"))
from runkit.stopping import GracefulStop, how_to_stop  # noqa: E402


class OneRank:
    """What agreed() uses of an Accelerator; counts the collectives."""
    device, reductions = torch.device("cpu"), 0

    def reduce(self, tensor, op):
        self.reductions += 1
        return tensor


def test_stop_agreement_at_every_call_and_never_without_signals():
    """agreed() checks whenever it is called (run.py decides where: the ranks make the same calls, so all check
    together); with --stop-signals '' there is nothing to agree on, so no collective at all."""
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        rank = OneRank()
        stopper = GracefulStop("USR2")
        assert [stopper.agreed(rank) for _ in range(3)] == [False, False, False] and rank.reductions == 3
        os.kill(os.getpid(), signal.SIGUSR2)  # the handler only remembers it
        assert stopper.received == "SIGUSR2"
        assert [stopper.agreed(rank) for _ in range(2)] == [True, True] and rank.reductions == 5
        silent, rank = GracefulStop(""), OneRank()
        assert not any(silent.agreed(rank) for _ in range(5)) and rank.reductions == 0
    finally:
        signal.signal(signal.SIGUSR2, previous)


@pytest.fixture
def outside_any_launcher(monkeypatch):
    for name in ("SLURM_JOB_ID", "RECIPE_STOP_MARKER", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_how_to_stop_names_this_process_outside_a_launcher(outside_any_launcher):
    assert how_to_stop(True) == f"stop with a checkpoint: kill -TERM {os.getpid()}"
    assert how_to_stop(False) == (f"kill -TERM {os.getpid()} stops it without a checkpoint (no --checkpoint-dir: its "
                                  "progress is lost)")


def test_how_to_stop_under_slurm_names_the_job(outside_any_launcher):
    outside_any_launcher.setenv("SLURM_JOB_ID", "4242")
    outside_any_launcher.setenv("TORCHELASTIC_RUN_ID", "none")  # per-node mode: torchrun inside the job
    assert how_to_stop(True) == "stop with a checkpoint: scancel --signal=TERM --full 4242"
    # The templates (launch/*.sbatch) set the marker, and requeue the job once it stopped with a checkpoint.
    outside_any_launcher.setenv("RECIPE_STOP_MARKER", "/shared/.slurm-recipe-4242.abc/stopped")
    assert how_to_stop(True) == ("stop with a checkpoint: scancel --signal=TERM --full 4242, then the job requeues "
                                 "itself")
    assert how_to_stop(False).startswith("scancel --signal=TERM --full 4242 stops it without a checkpoint")


CHILD = """
import sys
sys.path.insert(0, "recipes")
from runkit.stopping import die_with_launcher, how_to_stop
die_with_launcher()
print(how_to_stop(True), flush=True)
print("trained on", flush=True)
"""


def test_how_to_stop_under_torchrun_names_the_launcher(outside_any_launcher):
    """A worker of an elastic agent (TORCHELASTIC_RUN_ID): the pid to signal is its launcher's, the process that
    runs torch and started it (here this test's process plays the agent), not the worker's own."""
    env = dict(os.environ, TORCHELASTIC_RUN_ID="test", RANK="1")
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [f"stop with a checkpoint: kill -TERM {os.getpid()}", "trained on"]


def alive(pid):
    """Whether the process runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_worker_whose_launcher_is_gone_at_start_exits_at_once(outside_any_launcher, tmp_path):
    """A launcher killed while its worker still imports torch: by the time the worker checks, its parent is init
    or a subreaper. Here the worker's parent (a shell standing in for the launcher) exits at once, leaving the
    worker orphaned before it imports anything; it must say so and exit instead of training on."""
    log = tmp_path / "worker.log"
    env = dict(os.environ, TORCHELASTIC_RUN_ID="test", RANK="1", CHILD=CHILD, LOG=str(log))
    subprocess.run(["sh", "-c", f'"{sys.executable}" -c "$CHILD" > "$LOG" 2>&1 &'], cwd=REPO, env=env, check=True,
                   timeout=60)
    end = time.monotonic() + 120
    while not ("launcher is gone" in log.read_text() or "trained on" in log.read_text()):
        assert time.monotonic() < end, f"the orphaned worker said nothing in 120 s:\n{log.read_text()}"
        time.sleep(0.1)
    match = re.search(r"error: rank 1 \(pid (\d+)\): its launcher is gone", log.read_text())
    assert match, log.read_text()
    pid = int(match.group(1))
    while alive(pid):
        assert time.monotonic() < end, f"pid {pid} said its launcher is gone but lives on"
        time.sleep(0.05)
    assert "trained on" not in log.read_text(), log.read_text()
