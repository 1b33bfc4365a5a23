"""Stop signals, a dead rank, a kill during a save and Ctrl-C: real 2-process launches on CPU.

Each test starts a run in the background, waits for a state it can see (a metrics line, a
message), acts on the processes, and checks how the whole launch ends. The waits have deadlines
only to turn a hang into a failure; the durations asserted are the 60 s limit the issue sets for a
dead rank, and the 60 s in which a run must end once stopped (launching.STOP_SECONDS: a rank that
ignored the stop agreement would otherwise hang until the 300 s collective timeout).
"""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from launching import FP32, REPO, TRAINING, Run, frozen, rank_of, skip_unless_ci, thawed
from run_checks import assert_identical_params, assert_same_steps

pytestmark = pytest.mark.slow


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
    os.kill(next(pid for pid in workers if rank_of(pid) == 1), signal.SIGUSR1)  # the other learns it by agreement
    thawed(workers)
    assert run.stops_within() == 1  # torchrun reports the workers' 75 as 1 (launch/ reads the stop marker instead)
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


@pytest.mark.parametrize("checkpoints, code", [(True, 75), (False, 1)])
def test_single_process_exit_code_on_stop(data_dir, tmp_path, checkpoints, code):
    """Without a launcher in between, the recipe's own exit code says 'stopped, resumable' (75), or, without
    --checkpoint-dir, that the progress is lost (1)."""
    out = tmp_path / "out"
    cmd = ["python3", "recipes/mnist.py", "--data-dir", str(data_dir), "--output-dir", str(out),
           "--synthetic-train-size", "2000", "--synthetic-test-size", "501", "--epochs", "50", "--log-every", "100",
           "--stop-check-every", "3", *(["--checkpoint-dir", str(tmp_path / "ckpt")] if checkpoints else [])]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    end = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        if time.monotonic() > end or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"no first metrics line after 120 s:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == code, output[-3000:]
    assert "stopped by SIGTERM" in output
    # Progress lines every 100 steps and --stop-check-every 3: the stop comes at a multiple of 3 (epochs
    # end every 15 steps, a multiple of 3 too), not only at the next progress line.
    step = int(re.search(r"stopped by SIGTERM after step (\d+)", output).group(1))
    assert step % 3 == 0 and step < 100, step
    if checkpoints:
        assert any(p.name.startswith("step-") for p in (tmp_path / "ckpt").iterdir())
    else:
        assert "no --checkpoint-dir was given, so this progress is lost" in output


def assert_intact(ckpt, names):
    """Each checkpoint complete and unchanged: every file its manifest lists has the recorded SHA-256."""
    for name in names:
        manifest = json.loads((ckpt / name / "checkpoint.json").read_text())
        for rel, want in manifest["files"].items():
            assert hashlib.sha256((ckpt / name / rel).read_bytes()).hexdigest() == want["sha256"], (name, rel)


@pytest.mark.parametrize("phase", ["training", "save", "resume", "stop agreement"])
def test_dead_rank_ends_the_launch_within_60s(start, reference, tmp_path, phase):
    """kill -9 of rank 1 while training, while saving a checkpoint, while loading one, and while the other
    rank, told to stop, waits for it: the launch ends non-zero within 60 s, no process is left, and the
    checkpoints saved before stay complete and loadable."""
    ckpt = tmp_path / "ckpt"
    args, env = ["--epochs", "50", "--log-every", "1"], {}
    if phase != "training":
        args = [*TRAINING, "--checkpoint-dir", str(ckpt)]
    if phase == "save":
        env = {"TEST_SLOW_SAVE_SECONDS": "600", "TEST_SLOW_SAVE_MATCH": "step-00000010"}
    if phase == "resume":
        _, saved = reference("2gpu.yaml")
        shutil.copytree(saved, ckpt)
        shutil.rmtree(ckpt / "step-00000020")  # a run still to finish: with its last step saved it is complete
        env = {"TEST_SLOW_LOAD_SECONDS": "600"}
    run = start("2gpu.yaml", *args, env=env)
    ready = {"training": lambda: run.steps_logged() >= 2, "save": lambda: "TEST-SHIM: slow save" in run.output,
             "resume": lambda: "TEST-SHIM: slow load" in run.output, "stop agreement": lambda: run.steps_logged() >= 2}
    run.wait_until(lambda: ready[phase]() and len(run.workers()) == 2, phase)
    victim = next(pid for pid in run.workers() if rank_of(pid) == 1)
    if phase == "stop agreement":
        # Rank 1 frozen, then rank 0 gets a stop signal: rank 0 must now hear from rank 1 before it can stop
        # (in the stop agreement at its next progress line, or in the gradient reduction just before it),
        # and rank 1 dies instead of answering.
        frozen([victim])
        os.kill(next(pid for pid in run.workers() if rank_of(pid) == 0), signal.SIGUSR1)
    saved_before = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) if ckpt.exists() else []
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    returncode = run.finish(deadline=120)
    took = time.monotonic() - killed_at
    assert returncode == 1
    assert took < 60, f"the launch took {took:.0f}s to end after a rank died"
    assert run.left == []
    assert_intact(ckpt, saved_before)
    if phase in ("save", "resume"):
        assert saved_before


def test_kill_during_save_keeps_previous_checkpoint(start, launch, reference, tmp_path):
    ref, _ = reference("2gpu.yaml")
    ckpt = tmp_path / "ckpt"
    run = start("2gpu.yaml", *TRAINING, "--checkpoint-dir", str(ckpt),
                env={"TEST_SLOW_SAVE_SECONDS": "600", "TEST_SLOW_SAVE_MATCH": "step-00000010"})
    run.wait_until(lambda: "TEST-SHIM: slow save" in run.output, "save of step 10 in progress")
    for pid in run.leftovers():  # the whole run at once, as a node failure would
        os.kill(pid, signal.SIGKILL)
    run.finish(deadline=60)
    # The lock of the killed run stays behind; its holder is dead, so the next run takes it over.
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock", ".tmp-step-00000010", "step-00000005"]

    resumed = launch("2gpu.yaml", *TRAINING, "--checkpoint-dir", str(ckpt), launch_args=FP32)
    assert f"removing {ckpt / '.tmp-step-00000010'}: a save that never finished" in resumed.output
    assert f"taking over {ckpt / '.lock'}: its holder, pid" in resumed.output
    assert f"resumed from {ckpt / 'step-00000005'}" in resumed.output
    assert_identical_params(ref.params(), resumed.params())
    assert not (ckpt / ".tmp-step-00000010").exists()  # replaced by the complete step 10
    assert not (ckpt / ".lock").exists()  # released at the end


def test_one_writer_per_directory_and_workers_die_with_their_launcher(start, launch, reference, tmp_path):
    """A run holds --checkpoint-dir's lock: a second run there is refused at once, naming the holder. Its
    launcher killed alone with SIGKILL (an OOM kill, a kill -9), the workers follow within seconds instead of
    training on as orphans; the next run takes over the dead holder's lock and ends like the uninterrupted run."""
    ref, _ = reference("2gpu.yaml")
    ckpt = tmp_path / "ckpt"
    run = start("2gpu.yaml", *TRAINING, "--checkpoint-dir", str(ckpt),
                env={"TEST_SLOW_SAVE_SECONDS": "600", "TEST_SLOW_SAVE_MATCH": "step-00000010"})
    run.wait_until(lambda: "TEST-SHIM: slow save" in run.output and len(run.workers()) == 2, "save of step 10")
    holder = json.loads((ckpt / ".lock").read_text())
    assert holder["pid"] in run.workers()

    second = launch("2gpu.yaml", *TRAINING, "--checkpoint-dir", str(ckpt), launch_args=FP32, check=False)
    assert second.returncode == 1, second.output[-3000:]
    assert f"--checkpoint-dir {ckpt} is in use by pid {holder['pid']} on {holder['host']}" in second.output
    assert run.proc.poll() is None  # the holder trains on, its directory untouched
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock", ".tmp-step-00000010", "step-00000005"]

    os.kill(run.proc.pid, signal.SIGKILL)  # the launcher alone
    end = time.monotonic() + 30
    while run.leftovers() and time.monotonic() < end:  # its workers, for as long as they outlive it
        time.sleep(0.1)
    run.finish(deadline=60)
    assert run.left == [], "workers outlived their launcher"

    rerun = launch("2gpu.yaml", *TRAINING, "--checkpoint-dir", str(ckpt), launch_args=FP32, env={"TEST_RERUN": "1"})
    assert f"taking over {ckpt / '.lock'}: its holder, pid {holder['pid']} on this host, is gone" in rerun.output
    assert f"resumed from {ckpt / 'step-00000005'}" in rerun.output
    assert_identical_params(ref.params(), rerun.params())
    assert not (ckpt / ".lock").exists()


def test_first_line_names_the_launcher_and_its_stop_works(start, tmp_path):
    """Under accelerate launch the pid a user sees is the launcher's (SIGUSR1 would kill it: exit 138, no
    checkpoint, a stale lock). The run's first line names that pid with SIGTERM, which the launcher passes on
    to its workers: doing what it says stops every rank after the same step, with a checkpoint and the lock
    released."""
    ckpt = tmp_path / "ckpt"
    run = start("2gpu.yaml", "--epochs", "50", "--log-every", "1", "--checkpoint-dir", str(ckpt))
    run.wait_until(lambda: "stop with a checkpoint: " in run.output and run.steps_logged() >= 2, "step 2")
    said = re.search(r"stop with a checkpoint: kill -TERM (\d+)", run.output)
    assert said and int(said.group(1)) == run.proc.pid, run.output[-3000:]  # the launcher, not a worker
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.stops_within() == 1  # torchrun reports the workers' 75 as 1
    assert re.search(r"stopped by SIGTERM after step \d+: checkpoint saved in", run.output), run.output[-3000:]
    assert run.left == [] and any(p.name.startswith("step-") for p in ckpt.iterdir())
    assert not (ckpt / ".lock").exists()


def test_launcher_killed_while_its_workers_import(start):
    """accelerate launch SIGKILLed about 0.3 s after its 2 workers appeared, while they still import torch (seconds
    on a GPU node, with deepspeed and transformers): by the time a worker reaches Run(...), its parent is init or a
    subreaper, and no parent death is left to catch. Each worker must see that its launcher is gone and exit
    at once, instead of training on as an orphan (before the fix, both were still alive 200 s later)."""
    run = start("2gpu.yaml", "--epochs", "50", "--log-every", "1")
    run.wait_until(lambda: len(run.workers()) == 2, "2 workers started", deadline=120)
    time.sleep(0.3)  # inside the import window; a worker that got further would die of PR_SET_PDEATHSIG, silently
    os.kill(run.proc.pid, signal.SIGKILL)  # the launcher alone
    end = time.monotonic() + 60  # importing takes a few seconds here; 60 s only turns a survivor into a failure
    while run.workers() and time.monotonic() < end:
        time.sleep(0.1)
    assert run.workers() == [], f"workers outlived their launcher by 60 s:\n{run.output[-3000:]}"
    # Each left through the start-up check (not killed by some other way), before any training step.
    assert run.output.count("its launcher is gone (killed while this process started)") == 2, run.output[-3000:]
    assert run.steps_logged() == 0


def test_full_disk_during_a_save(launch, tmp_path):
    """A checkpoint directory on a 1 MB tmpfs: the first two checkpoints (about 400 kB each) fit, the third
    fills the disk. The run ends with one message saying so, and the earlier checkpoints stay complete."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        skip_unless_ci("mounting a small tmpfs needs root")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ckpt)], check=True)
    try:
        run = launch("2gpu.yaml", *TRAINING, "--checkpoint-dir", str(ckpt), launch_args=FP32, check=False)
        assert run.returncode == 1, run.output[-3000:]
        # torch.save reports a full disk as a RuntimeError about its zip records; the message adds the free space.
        assert re.search(r"error: saving checkpoint \S+ failed (on rank \d )?\(.*(No space left on device|"
                         r"[0-9.]+ MB left on its file system)\); the earlier checkpoints are untouched", run.output), \
            run.output[-3000:]
        saved = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-"))
        assert saved and saved[0] == "step-00000005"
        assert_intact(ckpt, saved)
    finally:
        subprocess.run(["umount", "-l", str(ckpt)], check=False)


def test_ctrl_c_stops_everything(start):
    run = start("2gpu.yaml", "--epochs", "50", "--log-every", "1")
    run.wait_until(lambda: run.steps_logged() >= 2 and len(run.workers()) == 2, "step 2")
    os.killpg(run.proc.pid, signal.SIGINT)  # what a terminal sends to the foreground job
    returncode = run.finish(deadline=120)
    # torch's launcher turns the SIGINT into its SignalException and exits 1 (not a stop: no checkpoint, no 75).
    assert returncode == 1, run.output[-3000:]
    assert "got signal: 2" in run.output and not (run.log_path.parent / "summary.json").exists()
    assert run.left == []
