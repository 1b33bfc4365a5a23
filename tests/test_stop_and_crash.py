"""Stop signals, a dead rank, a kill during a save and Ctrl-C: real 2-process launches on CPU.

Each test starts a run in the background, waits for a state it can see (a metrics line, a
message), acts on the processes, and checks how the whole launch ends. The waits have deadlines
only to turn a hang into a failure; nothing here asserts a duration except the 60 s limit the
issue sets for a dead rank.
"""

import os
import signal
import subprocess
import time

import pytest

from conftest import FP32, REPO, TRAINING, Run, launch_command, recipe_processes
from test_checkpoint_resume import assert_identical_params, assert_same_steps

pytestmark = pytest.mark.slow


class Background:
    """A launch running in its own session, its output in a file."""

    def __init__(self, cmd, env, log_path):
        self.log_path = log_path
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.marker = str(log_path.parent)  # the output dir is on every process's command line

    @property
    def output(self):
        return self.log_path.read_text()

    def workers(self):
        """PIDs of the recipe processes (not the launcher) of this run."""
        return recipe_processes(self.marker)

    def leftovers(self):
        """Every live process of this run, launcher included (zombies do not count)."""
        alive = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().decode(errors="replace")
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if self.marker in argv and state != "Z":
                alive.append(int(entry))
        return alive

    def wait_until(self, condition, what, deadline=300):
        end = time.monotonic() + deadline
        while not condition():
            if self.proc.poll() is not None:
                pytest.fail(f"the run ended ({self.proc.returncode}) before {what}:\n{self.output[-4000:]}")
            if time.monotonic() > end:
                pytest.fail(f"no {what} after {deadline}s:\n{self.output[-4000:]}")
            time.sleep(0.05)

    def steps_logged(self):
        path = self.log_path.parent / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def finish(self, deadline=300):
        """Wait for the launcher; note which processes outlived it (self.left), then kill those."""
        try:
            return self.proc.wait(timeout=deadline)
        finally:
            self.left = self.leftovers()
            for pid in self.left:
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def start(data_dir, tmp_path):
    runs = []

    def _start(config, *recipe_args, env=None, name="run"):
        out_dir = tmp_path / name
        out_dir.mkdir()
        cmd, route_env = launch_command(config, data_dir, out_dir, *recipe_args, launch_args=FP32)
        run = Background(cmd, {**route_env, **(env or {})}, out_dir / "launch.log")
        runs.append(run)
        return run

    yield _start
    for run in runs:  # never leave a process behind, whatever the test did
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
        run.finish(deadline=60)


def frozen(pids):
    """Stop the processes so a signal sent now is handled at a known step, not after training ended."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)


def thawed(pids):
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


def test_signal_to_one_rank_stops_all_and_resume_is_exact(start, launch, reference, tmp_path):
    """SIGUSR1 reaches only rank 1: both ranks agree to stop after the same step, save, and a
    second launch with the same command ends exactly where the uninterrupted run ends."""
    ref, _ = reference("2gpu.yaml")
    ckpt = tmp_path / "ckpt"
    run = start("2gpu.yaml", *TRAINING, "--checkpoint-dir", str(ckpt))
    run.wait_until(lambda: run.steps_logged() >= 6 and len(run.workers()) == 2, "step 6")
    workers = run.workers()
    frozen(workers)
    stop_step = run.steps_logged()
    os.kill(max(workers), signal.SIGUSR1)  # one rank only; the other learns it from the agreement
    thawed(workers)
    assert run.finish() != 0
    assert "stopped by" in run.output and "run the same command again to resume" in run.output
    stopped = sorted(p.name for p in ckpt.iterdir())[-1]
    assert stop_step <= int(stopped.split("-")[1]) <= stop_step + 1, (stop_step, stopped)
    assert run.left == []

    # The same command again (same output directory: its log is cut back to the checkpoint's step).
    out_dir = run.log_path.parent
    again = launch("2gpu.yaml", *TRAINING, "--checkpoint-dir", str(ckpt), "--output-dir", str(out_dir),
                   launch_args=FP32)
    assert f"resumed from {ckpt / stopped}" in again.output
    resumed = Run(again.returncode, again.output, out_dir)
    assert_identical_params(ref.params(), resumed.params())
    assert_same_steps(ref.metrics, resumed.metrics, after_step=0)


def test_single_process_exit_code_on_stop(data_dir, tmp_path):
    """Without a launcher in between, the recipe's own exit code says 'stopped, resumable'."""
    out = tmp_path / "out"
    cmd = ["python3", "recipes/mnist.py", "--data-dir", str(data_dir), "--output-dir", str(out),
           "--synthetic-train-size", "2000", "--synthetic-test-size", "501", "--epochs", "50",
           "--checkpoint-dir", str(tmp_path / "ckpt")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    end = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1) and time.monotonic() < end:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, output[-3000:]
    assert "stopped by SIGTERM" in output
    assert any(p.name.startswith("step-") for p in (tmp_path / "ckpt").iterdir())


def test_dead_rank_ends_the_launch_within_60s(start):
    run = start("2gpu.yaml", "--epochs", "50", "--log-every", "1")
    run.wait_until(lambda: run.steps_logged() >= 2 and len(run.workers()) == 2, "step 2")
    victim = max(run.workers())
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    returncode = run.finish(deadline=120)
    took = time.monotonic() - killed_at
    assert returncode != 0
    assert took < 60, f"the launch took {took:.0f}s to end after a rank died"
    assert run.left == []


def test_kill_during_save_keeps_previous_checkpoint(start, launch, reference, tmp_path):
    ref, _ = reference("2gpu.yaml")
    ckpt = tmp_path / "ckpt"
    run = start("2gpu.yaml", *TRAINING, "--checkpoint-dir", str(ckpt),
                env={"TEST_SLOW_SAVE_SECONDS": "600", "TEST_SLOW_SAVE_MATCH": "step-00000008"})
    run.wait_until(lambda: "TEST-SHIM: slow save" in run.output, "save of step 8 in progress")
    for pid in run.leftovers():  # the whole run at once, as a node failure would
        os.kill(pid, signal.SIGKILL)
    run.finish(deadline=60)
    assert sorted(p.name for p in ckpt.iterdir()) == [".tmp-step-00000008", "step-00000004"]

    resumed = launch("2gpu.yaml", *TRAINING, "--checkpoint-dir", str(ckpt), launch_args=FP32)
    assert f"ignoring {ckpt / '.tmp-step-00000008'}: a save that never finished" in resumed.output
    assert f"resumed from {ckpt / 'step-00000004'}" in resumed.output
    assert_identical_params(ref.params(), resumed.params())
    assert not (ckpt / ".tmp-step-00000008").exists()  # replaced by the complete step 8


def test_ctrl_c_stops_everything(start):
    run = start("2gpu.yaml", "--epochs", "50", "--log-every", "1")
    run.wait_until(lambda: run.steps_logged() >= 2 and len(run.workers()) == 2, "step 2")
    os.killpg(run.proc.pid, signal.SIGINT)  # what a terminal sends to the foreground job
    returncode = run.finish(deadline=120)
    assert returncode != 0
    assert run.left == []
