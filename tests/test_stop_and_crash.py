"""Stopping and crashing, all in one place: stop signals, a dead rank, a kill during a save, a launcher that dies,
a full disk and Ctrl-C; each recipe's own stop; and src/accelrun/stopping.py, stop.py and launcher.py without a run.

The quick tests (no launch) check them: the stop agreement between ranks, the line that says how to stop a run, the
stop command, and a worker whose launcher is gone before it starts. The others are real launches on CPU (slow): each
starts a run in the background, waits for a state it can see (a metrics line, a message), acts on the processes,
and checks how the whole launch ends. The waits have deadlines only to turn a hang into a failure; the durations
asserted are the 60 s limit the issue sets for a dead rank, and the 60 s in which a run must end once stopped
(launching.STOP_SECONDS: a rank that ignored the stop agreement would otherwise hang until the 300 s collective
timeout). Slurm's own stops (preemption, the time limit, scancel) run on the Slurm cluster of test_slurm_launch.py.
"""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from accelrun.checkpoint.layout import FORMAT_VERSION
from accelrun.launcher import process_state
from accelrun.stopping import GracefulStop, how_to_stop
from launching import (
    CPU_SHIM,
    DATA_ARGS,
    FP32,
    LORA,
    LORA_PRECISION,
    REPO,
    TRAINING,
    LaunchResult,
    check_exit,
    finetune_args,
    frozen,
    rank_of,
    recipe_args,
    run_command,
    skip_unless_ci,
    thawed,
)
from run_checks import assert_identical_params, assert_same_steps

# ---- src/accelrun/stopping.py, stop.py and launcher.py, without a run (quick) ------------------------------


class OneRank:
    """What agreed() uses of an Accelerator; counts the collectives."""
    device, reductions = torch.device("cpu"), 0

    def reduce(self, tensor, op):
        self.reductions += 1
        return tensor


def test_stop_agreement_at_every_call_and_never_without_signals(capfd):
    """agreed() checks whenever it is called (run.py decides where: the ranks make the same calls, so all check
    together); with --stop-signals '' there is nothing to agree on, so no collective at all. Before training begins
    a stop signal ends the run at once, with one line (it was remembered while minutes of loading went on)."""
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        rank = OneRank()
        stopper = GracefulStop("USR2", "ckpt")
        with pytest.raises(SystemExit) as stopped:
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(5)  # the handler raises as soon as Python regains control; never waits this out
        assert stopped.value.code == 75 and capfd.readouterr().err == (
            "stopped by SIGUSR2 before training began: nothing was trained, nothing to save; run the same command "
            "again (exit code 75)\n")
        stopper = GracefulStop("USR2")
        stopper.begin()
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
    assert how_to_stop("ckpt") == f"stop with a checkpoint: kill -TERM {os.getpid()}"
    assert how_to_stop(None) == (f"kill -TERM {os.getpid()} stops it without a checkpoint (no --checkpoint-dir: its "
                                 "progress is lost)")


def test_how_to_stop_under_slurm_names_the_job(outside_any_launcher):
    outside_any_launcher.setenv("SLURM_JOB_ID", "4242")
    outside_any_launcher.setenv("TORCHELASTIC_RUN_ID", "none")  # per-node mode: torchrun inside the job
    assert how_to_stop("ckpt") == "stop with a checkpoint: scancel --signal=TERM --full 4242"
    # The templates (launch/*.sbatch) set the marker, and requeue the job once it stopped with a checkpoint.
    outside_any_launcher.setenv("RECIPE_STOP_MARKER", "/shared/.slurm-recipe-4242.abc/stopped")
    assert how_to_stop("ckpt") == ("stop with a checkpoint: scancel --signal=TERM --full 4242, then the job requeues "
                                   "itself")
    assert how_to_stop(None).startswith("scancel --signal=TERM --full 4242 stops it without a checkpoint")


CHILD = """
import sys
sys.path.insert(0, "src")
from accelrun.launcher import die_with_launcher
from accelrun.stopping import how_to_stop
die_with_launcher()
print(how_to_stop("my ckpt"), flush=True)
print(how_to_stop(None), flush=True)
print("trained on", flush=True)
"""


def test_how_to_stop_under_a_launcher_names_the_stop_command(outside_any_launcher):
    """A worker of an elastic agent (TORCHELASTIC_RUN_ID; here this test's process plays the agent), whose launcher
    reports its exit code 75 as 1: the first line names the stop command, which exits 75 itself; without a checkpoint,
    SIGTERM to this worker (a signal to the launcher would make torchrun raise its SignalException)."""
    env = dict(os.environ, TORCHELASTIC_RUN_ID="test", RANK="1")
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    first, without, trained = out.stdout.splitlines()
    assert first == "stop with a checkpoint: python3 -m accelrun.stop 'my ckpt'"
    pid = int(re.match(r"kill -TERM (\d+) stops it without a checkpoint", without).group(1))
    assert pid != os.getpid() and trained == "trained on"  # the worker's own pid, not the launcher's


# A run as the stop command (stop.py) sees one: it holds the directory's lock open (lock.py's mark), and on SIGTERM it
# saves a checkpoint marked as the stop's and exits 75 (FAKE_STOP=crash: it dies without saving; =ignore: it goes on).
FAKE_RUN = """
import json, os, signal, socket, sys, time
directory = sys.argv[sys.argv.index("--checkpoint-dir") + 1]
lock = os.path.join(directory, ".lock")
def stop(signum, frame):
    if os.environ.get("FAKE_STOP") == "crash":
        os._exit(1)
    os.makedirs(os.path.join(directory, "step-00000007"))
    with open(os.path.join(directory, "step-00000007", "checkpoint.json"), "w") as f:
        json.dump(json.loads(os.environ["FAKE_MANIFEST"]), f)
    os.unlink(lock)
    sys.exit(75)
signal.signal(signal.SIGTERM, signal.SIG_IGN if os.environ.get("FAKE_STOP") == "ignore" else stop)
with open(lock, "w") as f:
    json.dump({"host": socket.gethostname(), "pid": os.getpid(), "job": None}, f)
held = open(lock)
print("holding", directory, flush=True)
time.sleep(120)
"""


def stop_command(directory, *extra):
    return subprocess.run([sys.executable, "-m", "accelrun.stop", str(directory), *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def stopped_manifest(step):
    """The manifest of a checkpoint saved for a stop at `step`, as the stop command reads it (the format version, the
    step, the layout's world size, the train_state of train_state.TRAIN_STATE's fields)."""
    state = {"step": step, "total_steps": 10, "epoch": 0, "step_in_epoch": step, "epochs_run": 0, "first_loss": 2.5,
             "final_loss": None, "last_eval": None, "train_time": 1.0, "window": None, "output_dir": "out",
             "run_id": "0f" * 16, "stopped": True}
    return {"format_version": FORMAT_VERSION, "step": step, "layout": {"world_size": 1}, "train_state": state}


def fake_run(directory, crash=False, stop=""):
    directory.mkdir(exist_ok=True)
    env = dict(os.environ, FAKE_STOP="crash" if crash else stop, FAKE_MANIFEST=json.dumps(stopped_manifest(7)))
    proc = subprocess.Popen([sys.executable, "-c", FAKE_RUN, "--checkpoint-dir", str(directory)], env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("holding"), "the fake run did not start"
    return proc


def test_stop_command_stops_the_run_holding_the_directory_and_exits_75(tmp_path):
    run = fake_run(tmp_path / "ckpt")
    out = stop_command(tmp_path / "ckpt")
    assert run.wait(timeout=60) == 75
    assert out.returncode == 75, out.stderr
    assert out.stdout.splitlines() == [
        f"stopping the run on {tmp_path / 'ckpt'} (pid {run.pid}): it finishes its step, saves a checkpoint and exits",
        f"stopped after step 7: checkpoint {tmp_path / 'ckpt' / 'step-00000007'}; run the training command again to "
        f"resume (exit code 75)"]


def test_stop_command_says_when_the_run_ended_without_saving(tmp_path):
    """The directory already holds the checkpoint of an earlier stop (step 5, marked as a stop's), and the run dies
    without saving: that older checkpoint is not this stop's, exit 1 (it was reported as saved, exit 75)."""
    earlier = tmp_path / "ckpt" / "step-00000005"
    earlier.mkdir(parents=True)
    (earlier / "checkpoint.json").write_text(json.dumps(stopped_manifest(5)))
    run = fake_run(tmp_path / "ckpt", crash=True)
    out = stop_command(tmp_path / "ckpt")
    assert run.wait(timeout=60) == 1 and out.returncode == 1, (out.stdout, out.stderr)
    assert f"error: pid {run.pid} ended without saving a checkpoint for the stop" in out.stderr, out.stderr
    assert f"the newest checkpoint in {tmp_path / 'ckpt'} is {earlier}" in out.stderr, out.stderr


def test_stop_command_waits_a_bounded_time_and_says_so(tmp_path):
    """A run that does not act on SIGTERM: the command gives up after --wait seconds with one line, exit 1, and the
    run lives on (it waited forever)."""
    run = fake_run(tmp_path / "ckpt", stop="ignore")
    try:
        out = stop_command(tmp_path / "ckpt", "--wait", "1")
        assert out.returncode == 1 and f"error: pid {run.pid} is still running 1 s after SIGTERM" in out.stderr, \
            (out.stdout, out.stderr)
        assert run.poll() is None
    finally:
        run.kill()
        run.wait()


def test_stop_command_says_what_it_cannot_see(tmp_path, monkeypatch):
    """A user's own run whose /proc entries that user cannot read (permission denied, as for a process that dropped
    its dumpable flag; root reads everything, so /proc's answer is played here): the command says so and signals
    nothing (it said the live pid was "no run any more")."""
    import accelrun.stop as stop
    run = fake_run(tmp_path / "ckpt")
    listdir = os.listdir

    def denied(path):
        if str(path).startswith("/proc/"):
            raise PermissionError(13, "Permission denied")
        return listdir(path)
    try:
        monkeypatch.setattr(stop.os, "listdir", denied)
        pid, problem = stop._holder_pid(str(tmp_path / "ckpt"))
        assert pid is None and f"names pid {run.pid}, which is alive but that this user cannot look into" in problem
        assert run.poll() is None
    finally:
        run.kill()
        run.wait()


@pytest.mark.parametrize("lock", ["none", "not a run on it", "another host", "a Slurm job", "another user's"])
def test_stop_command_signals_no_process_but_a_run_on_the_directory(tmp_path, lock):
    """The lock is a file on shared storage: untrusted. A pid it names is signalled only if that process holds this
    directory's lock open (the run's own mark) on this host, and the lock is this user's: not for a command line
    that merely names the directory (one was killed with 143); otherwise one line says why, exit 2, and the process
    named lives on."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "--checkpoint-dir",
                                  str(directory)])
    try:
        fields = {"host": socket.gethostname(), "pid": bystander.pid, "job": None}
        fields.update({"another host": {"host": "elsewhere"}, "a Slurm job": {"job": "4242"}}.get(lock, {}))
        if lock != "none":
            (directory / ".lock").write_text(json.dumps(fields))
        if lock == "another user's":
            os.chown(directory / ".lock", 12345, 12345)
        out = stop_command(directory)
        assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
        said = {"none": f"no run holds {directory}",
                "another user's": f"no run holds {directory}",
                "not a run on it": f"names pid {bystander.pid}, which is alive but does not hold that lock",
                "another host": f"runs on elsewhere (pid {bystander.pid}): run this command there",
                "a Slurm job": "is Slurm job 4242: stop it with scancel --signal=TERM --full 4242"}[lock]
        assert out.stderr.startswith("accelrun.stop: error: ") and said in out.stderr, out.stderr
        assert bystander.poll() is None  # not signalled
    finally:
        bystander.kill()
        bystander.wait()


def alive(pid):
    """Whether the process runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    return process_state(pid) not in (None, "Z")


def test_worker_whose_launcher_is_gone_at_start_exits_at_once(outside_any_launcher, tmp_path):
    """A launcher killed while its worker still imports torch: by the time the worker checks, its parent is init
    or a subreaper. Here the worker's parent (a shell standing in for the launcher) exits at once, leaving the
    worker orphaned before it imports anything; it must say so and exit instead of training on."""
    log = tmp_path / "worker.log"
    log.touch()  # the backgrounded worker's shell may open it only after sh has returned (seen on a loaded machine)
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


# ---- stop signals and crashes in real launches (slow) --------------------------------------------------------

@pytest.mark.slow
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
    resumed = LaunchResult(again.returncode, again.output, out_dir)
    assert_identical_params(ref.params(), resumed.params())
    assert_same_steps(ref.metrics, resumed.metrics, after_step=0)


@pytest.mark.slow
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


@pytest.mark.slow
def test_ctrl_c_is_one_line_naming_the_checkpoint_to_resume(data_dir, tmp_path):
    """Ctrl-C (SIGINT) in `python recipes/mnist.py` once a checkpoint exists: no traceback, one line naming that
    checkpoint, exit 130 (it printed a KeyboardInterrupt traceback and named nothing)."""
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "recipes/mnist.py", "--data", "synthetic", "--data-dir", str(data_dir), *DATA_ARGS,
           "--output-dir", str(tmp_path / "out"), "--checkpoint-dir", str(ckpt), "--epochs", "50",
           "--checkpoint-every", "2", "--log-every", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("checkpoint saved: "):
                saved = line.split()[2]
                break
        proc.send_signal(signal.SIGINT)
        output = "".join(seen) + proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    line = [x for x in output.splitlines() if x.startswith("interrupted (Ctrl-C) at step ")]
    assert len(line) == 1 and "nothing more is saved; the newest checkpoint is " in line[0], output[-3000:]
    newest = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-"))[-1]
    assert line[0].split("the newest checkpoint is ")[1].startswith(f"{ckpt / newest}: run the same command again")
    assert saved.startswith(str(ckpt))


@pytest.mark.slow
def test_a_stop_while_data_loads_ends_the_run_at_once(data_dir, tmp_path):
    """SIGTERM while the run reads its data, before its first step (the test shim holds MNIST's loading for 300 s):
    nothing to save, so the run ends at once with one line and exit 75, its lock released (it remembered the signal
    and loaded on, then trained until a SIGKILL)."""
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "recipes/mnist.py", "--data", "synthetic", "--data-dir", str(data_dir), *DATA_ARGS,
           "--output-dir", str(tmp_path / "out"), "--checkpoint-dir", str(ckpt)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(CPU_SHIM), TEST_SLOW_DATA_SECONDS="300")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("TEST-SHIM: slow data"):
                break
        proc.send_signal(signal.SIGTERM)
        output = "".join(seen) + proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "TEST-SHIM: slow data" in output and proc.returncode == 75, output[-3000:]
    assert ("stopped by SIGTERM before training began: nothing was trained, nothing to save; run the same command "
            "again (exit code 75)") in output.splitlines() and "Traceback" not in output, output[-3000:]
    assert not (ckpt / ".lock").exists()


def assert_intact(ckpt, names):
    """Each checkpoint complete and unchanged: every file its manifest lists has the recorded size and checksum."""
    from accelrun.checkpoint.files import matches
    for name in names:
        manifest = json.loads((ckpt / name / "checkpoint.json").read_text())
        for rel, want in manifest["files"].items():
            with open(ckpt / name / rel, "rb") as f:
                assert matches(f.fileno(), want), (name, rel)


@pytest.mark.slow
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


@pytest.mark.slow
def test_one_writer_per_directory_and_a_killed_launcher_leaves_the_previous_checkpoint(start, launch, reference,
                                                                                       tmp_path):
    """One run, held in the middle of its save of step 10 (a slow file system: the test shim), serves three stories.
    It holds --checkpoint-dir's lock: a second run there is refused at once, naming the holder, and the holder trains
    on. Its launcher killed alone with SIGKILL (an OOM kill, a kill -9), the workers follow within seconds instead of
    training on as orphans (SIGKILL too: every process of the run ends at once, as a node failure ends it), leaving
    the half-made save under a name of its own beside the complete step 5, and the lock. The next run removes the
    unfinished save, takes over the dead holder's lock, resumes from step 5 and ends like the uninterrupted run."""
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
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock", *[p.name for p in ckpt.glob(".tmp-step-00000010.*")],
                                                      "step-00000005"] and list(ckpt.glob(".tmp-step-00000010.*"))

    os.kill(run.proc.pid, signal.SIGKILL)  # the launcher alone
    end = time.monotonic() + 30
    while run.leftovers() and time.monotonic() < end:  # its workers, for as long as they outlive it
        time.sleep(0.1)
    run.finish(deadline=60)
    assert run.left == [], "workers outlived their launcher"
    # The lock of the killed run stays behind; its holder is dead, so the next run takes it over. The save in
    # progress is .tmp-step-00000010.XXXXXXXX, a name of its own.
    (unfinished,) = [p.name for p in ckpt.glob(".tmp-step-00000010.*")]
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock", unfinished, "step-00000005"]

    rerun = launch("2gpu.yaml", *TRAINING, "--checkpoint-dir", str(ckpt), launch_args=FP32, env={"TEST_RERUN": "1"})
    assert f"removing {ckpt / unfinished}: a save that never finished" in rerun.output
    assert f"taking over {ckpt / '.lock'}: its holder, pid {holder['pid']} on this host, is gone" in rerun.output
    assert f"resumed from {ckpt / 'step-00000005'}" in rerun.output
    assert_identical_params(ref.params(), rerun.params())
    assert not (ckpt / unfinished).exists() and (ckpt / "step-00000010").is_dir()  # the complete step 10
    assert not (ckpt / ".lock").exists()  # released at the end


@pytest.mark.slow
def test_first_line_names_a_stop_command_that_exits_75(start, tmp_path):
    """Under accelerate launch (2 processes) the first line names the stop command (stop.py): run as it says, it stops
    every rank after the same step with a checkpoint, exits 75 once the run has saved and ended, and the lock is
    released. No SignalException (the launcher is not signalled), and the run's own stop line says that accelerate
    launch reports the stop as 1, which it does; torchrun's report gives that line as the root cause."""
    ckpt = tmp_path / "ckpt"
    run = start("2gpu.yaml", "--epochs", "50", "--log-every", "1", "--checkpoint-dir", str(ckpt))
    run.wait_until(lambda: "stop with a checkpoint: " in run.output and run.steps_logged() >= 2, "step 2")
    said = re.search(r"stop with a checkpoint: (python3 -m accelrun\.stop \S+)$", run.output, re.M)
    assert said, run.output[-3000:]
    command = subprocess.run(shlex.split(said.group(1)), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert command.returncode == 75, (command.stdout, command.stderr)
    stopped_at = int(re.search(r"^stopped after step (\d+): checkpoint \S+/step-\d+; run the training command again",
                               command.stdout, re.M).group(1))
    assert run.stops_within() == 1  # accelerate launch: torchrun reports the workers' 75 as 1, as the line says
    line = (f"stopped by SIGTERM after step {stopped_at}: checkpoint saved in {ckpt}, run the same command again to "
            f"resume (exit code 75; accelerate launch reports it as 1)")
    assert line in run.output.splitlines() and f"traceback : {line}" in run.output, run.output[-3000:]
    assert "SignalException" not in run.output and "got signal" not in run.output
    assert run.left == [] and (ckpt / f"step-{stopped_at:08d}" / "checkpoint.json").exists()
    assert not (ckpt / ".lock").exists()


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_ctrl_c_stops_everything(start):
    run = start("2gpu.yaml", "--epochs", "50", "--log-every", "1")
    run.wait_until(lambda: run.steps_logged() >= 2 and len(run.workers()) == 2, "step 2")
    os.killpg(run.proc.pid, signal.SIGINT)  # what a terminal sends to the foreground job
    returncode = run.finish(deadline=120)
    # torch's launcher turns the SIGINT into its SignalException and exits 1 (not a stop: no checkpoint, no 75).
    assert returncode == 1, run.output[-3000:]
    assert "got signal: 2" in run.output and not (run.log_path.parent / "summary.json").exists()
    assert run.left == []


# ---- each recipe's own stop (slow) ----------------------------------------------------------------------------

@pytest.mark.slow
def test_gpt_stop_on_one_rank_and_resume_under_zero3(start, shelf, shelf_data, tmp_path):
    config = "deepspeed_zero3.yaml"
    ref = shelf("gpt", config)
    ckpt = tmp_path / "ckpt"
    args = recipe_args("gpt", config, shelf_data)[:-4] + ["--checkpoint-dir", str(ckpt), "--keep-last", "0"]
    run = start(config, *args, recipe="recipes/gpt.py")
    run.wait_until(lambda: run.steps_logged() >= 3 and len(run.workers()) == 2, "step 3")
    workers = run.workers()
    frozen(workers)
    os.kill(next(pid for pid in workers if rank_of(pid) == 1), signal.SIGUSR1)  # one rank only
    thawed(workers)
    assert run.stops_within() == 1  # torchrun reports the workers' 75 as 1
    assert "stopped by a signal to another rank" in run.output and run.left == []
    stopped_at = int(sorted(p.name for p in ckpt.iterdir())[-1].split("-")[1])
    assert 3 <= stopped_at < 12
    again = shelf("gpt", config, *args[len(recipe_args("gpt", config, shelf_data)) - 4:],
                  "--output-dir", str(run.log_path.parent))
    resumed = LaunchResult(again.returncode, again.output, run.log_path.parent)
    assert resumed.summary["resumed_from_step"] == stopped_at
    assert [m["loss"] for m in resumed.metrics] == [m["loss"] for m in ref.metrics]
    a, b = ref.params(), resumed.params()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_resnet_stop_reaches_workers_too(start, shelf, shelf_data, tmp_path):
    """Slurm signals every process of a step, DataLoader workers included: the workers ignore it, the
    training processes stop together and save, and the same command finishes the run."""
    args = [*recipe_args("resnet", "2gpu.yaml", shelf_data), "--max-steps", "40", "--epochs", "10",
            "--checkpoint-dir", str(tmp_path / "ckpt")]
    run = start("2gpu.yaml", *args, recipe="recipes/resnet.py")
    run.wait_until(lambda: run.steps_logged() >= 2 and len(run.workers()) >= 4, "step 2 with workers")
    everyone = run.workers()
    frozen(everyone)
    for pid in everyone:
        os.kill(pid, signal.SIGUSR1)
    thawed(everyone)
    assert run.stops_within() != 0
    assert "stopped by SIGUSR1" in run.output and "DataLoader worker" not in run.output, run.output[-3000:]
    assert run.left == []
    again = shelf("resnet", "2gpu.yaml", *args[len(recipe_args("resnet", "2gpu.yaml", shelf_data)):],
                  "--output-dir", str(run.log_path.parent))
    s = LaunchResult(again.returncode, again.output, run.log_path.parent).summary
    assert s["steps"] == 40 and 2 <= s["resumed_from_step"] < 40


@pytest.mark.slow
def test_finetune_killed_rank_then_resume_is_exact(lora, start, hf, tmp_path):
    """LoRA under FSDP2 in bf16, sharded checkpoints: one rank killed mid-run, the resumed run ends with the
    uninterrupted run's losses and adapter, bit for bit."""
    config = "fsdp.yaml"
    ref = lora(config)
    args = [*finetune_args(hf), *LORA, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3",
            "--keep-last", "0"]
    run = start(config, *args, recipe="recipes/finetune_lm.py", env={"TEST_STEP_SECONDS": "0.3"},
                launch_args=("--mixed_precision", LORA_PRECISION[config]))
    run.wait_until(lambda: run.steps_logged() >= 4 and len(run.workers()) == 2, "step 4")
    os.kill(next(pid for pid in run.workers() if rank_of(pid) == 1), signal.SIGKILL)
    assert run.finish() != 0 and run.left == []
    code, output = run_command(run.proc.args, env={"PYTHONPATH": str(REPO / "tests" / "helpers" / "cpu_shim")})
    assert code == 0, output[-4000:]
    resumed = LaunchResult(code, output, run.log_path.parent)
    assert resumed.summary["resumed_from_step"] in (3, 6)
    assert [m["loss"] for m in resumed.metrics] == [m["loss"] for m in ref.metrics]  # the killed run's lines too
    adapter = "adapter/adapter_model.safetensors"
    assert (resumed.out_dir / adapter).read_bytes() == (ref.out_dir / adapter).read_bytes()


@pytest.mark.slow
def test_finetune_stop_signal_exits_75_and_resumes(hf, tmp_path):
    """python, one process: SIGTERM stops at the next step with a checkpoint and exit code 75."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    steps = 200  # a few seconds: the signal lands mid-run
    cmd = [sys.executable, "recipes/finetune_lm.py", *finetune_args(hf), "--max-steps", str(steps),
           "--output-dir", str(out), "--checkpoint-dir", str(ckpt), "--eval-every", "100"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.02)
    frozen([proc.pid])  # the signal is then handled at a known point: mid-run
    proc.send_signal(signal.SIGTERM)
    thawed([proc.pid])
    output = proc.communicate(timeout=120)[0]
    check_exit(output)
    assert proc.returncode == 75, output[-3000:]
    stopped_at = max(int(p.name.split("-")[1]) for p in ckpt.iterdir() if p.name.startswith("step-"))
    assert 2 <= stopped_at < steps
    code, output = run_command(cmd)
    assert code == 0, output[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["resumed_from_step"] == stopped_at and s["steps"] == steps
