"""Stopping on a signal: every rank finishes the same step, saves, and exits 75 ("run me again").

Owns the signal handlers (the flags are flags.py's), the agreement between ranks, the marker file that
launch/ reads, the exit code, the line that tells the user how to stop a run, the command that stops a
run from outside (this file run as a script, below), and the tie between a worker and its launcher (a
worker whose launcher dies is killed, so no orphan trains on). Slurm sends SIGUSR1 (the templates' timer)
or SIGTERM (preemption) to every process of the job step, DataLoader workers included.

    python3 recipes/runkit/stopping.py CHECKPOINT_DIR

stops the run that holds CHECKPOINT_DIR (its lock names the main process) with a checkpoint, waits until
it has saved and ended, and exits 75 as the run itself does, which accelerate launch cannot pass on: it
turns any exit of its workers that is not 0 into 1. It imports only the standard library.
"""

import ctypes
import errno
import json
import os
import re
import shlex
import signal
import socket
import stat
import sys
import time

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on a signal after saving a checkpoint; run the same command again


def signal_numbers(names):
    return [getattr(signal, n if n.startswith("SIG") else "SIG" + n)
            for n in filter(None, (n.strip().upper() for n in names.split(",")))]


def ignore_stop_signals(names, worker_id=None):
    """DataLoader worker_init_fn: Slurm signals every process of a step, DataLoader workers included;
    only the training process acts on a stop signal, and a worker must not die of one."""
    for number in signal_numbers(names):
        signal.signal(number, signal.SIG_IGN)


def _parent_of(pid):
    """The parent's pid, from /proc/<pid>/stat (the field after the command name, which may hold spaces)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _runs_torch(pid):
    """Whether the process has torch's libraries loaded, as the elastic agent (a torch program) has."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("libtorch" in line for line in f)
    except OSError:
        return False  # gone, or another user's process: the agent runs as the user of the workers it starts


def elastic_agent():
    """The pid of the torch elastic agent that started this process, or None if it is gone (or there is none).

    Under torchrun and accelerate launch (more than one process) the agent is torch's LocalElasticAgent: it
    gives every worker TORCHELASTIC_RUN_ID (and RANK, LOCAL_RANK, ...) and starts it as its own child
    (torch.distributed.elastic.multiprocessing: SubprocessHandler, Popen with start_new_session=True), or
    starts a program that starts the recipe (torchrun --no-python). So the agent is the nearest ancestor that
    runs torch. Once the agent is dead, the worker belongs to init or a subreaper (systemd, tini,
    slurmstepd), none of which runs torch; torchrun as a container's pid 1 is still found."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    pid, seen = os.getppid(), set()
    while pid > 0 and pid not in seen:  # 0: the parent is outside this pid namespace
        if _runs_torch(pid):
            return pid
        seen.add(pid)
        try:
            pid = _parent_of(pid) if pid != 1 else 0
        except OSError:
            return None
    return None


def _argv_of(pid):
    """The command line of a process, each word's base name; None where Linux's /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [os.path.basename(a) for a in f.read().decode(errors="replace").split("\0")]
    except OSError:
        return None


def launcher_in_between():
    """Whether a launcher that turns this process's exit code into its own stands between it and the user: torchrun
    (accelerate launch with several processes) reports any exit that is not 0 as 1, accelerate launch with one
    process raises CalledProcessError and exits 1."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return True
    argv = _argv_of(os.getppid()) or []
    return "accelerate" in argv and "launch" in argv


def die_with_launcher():
    """Under accelerate launch / torchrun (Linux): SIGKILL this worker when its launcher dies. The launcher
    starts its workers in sessions of their own, so a kill -9 or an OOM kill of the launcher would leave
    them training as orphans, writing the same checkpoints and logs as the rerun the user starts next.

    Call it first thing (Run(...) does). A launcher killed while this worker was still importing torch is
    already gone: its worker belongs to init or a subreaper now, and exits at once."""
    parent = os.getppid()
    argv = _argv_of(parent)
    if argv is None:
        return  # not Linux
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's workers (several processes)
        if elastic_agent() is None:
            _exit_orphaned()
    elif not ("accelerate" in argv and "launch" in argv):  # accelerate launch's single child
        return  # a shell, srun, or no launcher at all
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: sent when the parent dies
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the line above: act now (a launcher may itself be pid 1)
        _exit_orphaned()


def _exit_orphaned():
    try:
        print(f"error: rank {os.environ.get('RANK', '?')} (pid {os.getpid()}): its launcher is gone (killed while "
              "this process started); exiting instead of training on alone", file=sys.stderr, flush=True)
    except OSError:
        pass  # the launcher held the other end of stderr
    os.kill(os.getpid(), signal.SIGKILL)


def _shown_path(path):
    """A path as the user would type it from where the run was started: relative below it, absolute elsewhere."""
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else os.path.abspath(path)


def how_to_stop(checkpoint_dir):
    """The end of the run's first line: how to stop this run, naming a command the user can run.

    Under Slurm: scancel, which signals every process of the job (the templates' batch script traps SIGTERM
    and stays alive to requeue). Under accelerate launch (launcher_in_between), which reports the workers' 75
    as 1: this file as a command, which signals this process (the main one), waits until the run has saved
    and ended, and exits 75 itself. A signal to the launcher would stop the run too, but torchrun answers it
    with a SignalException traceback and exit 1 and kills workers that take more than 30 s; SIGUSR1 kills it
    outright (exit 138: no checkpoint, a stale lock). Otherwise SIGTERM to this process, which exits 75 itself."""
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        command = f"scancel --signal=TERM --full {job}"
        after = ", then the job requeues itself" if os.environ.get("RECIPE_STOP_MARKER") else ""
    elif checkpoint_dir and launcher_in_between():
        command, after = f"python3 {shlex.quote(_shown_path(__file__))} {shlex.quote(_shown_path(checkpoint_dir))}", ""
    else:
        command, after = f"kill -TERM {os.getpid()}", ""
    if checkpoint_dir:
        return f"stop with a checkpoint: {command}{after}"
    return f"{command} stops it without a checkpoint (no --checkpoint-dir: its progress is lost)"


class GracefulStop:
    """Remember that a stop signal arrived; all ranks then agree on the step to stop after."""

    def __init__(self, names):
        self.received = None
        numbers = signal_numbers(names)
        self.enabled = bool(numbers)  # --stop-signals '': nothing to agree on, no collective per step
        self.numbers = numbers
        for number in numbers:
            signal.signal(number, self._handler)

    def ignore_from_now(self):
        """The training is over: a stop signal now (a time-limit timer firing late) must not kill the
        process while it writes its results. Python resets its own handlers to the default action at
        exit, which for SIGUSR1 is death, but it leaves SIG_IGN alone."""
        for number in self.numbers:
            signal.signal(number, signal.SIG_IGN)

    def _handler(self, signum, frame):
        # Only set a flag: the step in flight finishes, and no collective is left half-done.
        self.received = signal.Signals(signum).name

    def agreed(self, accelerator):
        """True on every rank once any rank got a signal. Collective: call it on all ranks at the same step
        (run.py decides where: the progress lines, --stop-check-every, each epoch's end)."""
        # Every rank has the same flags, so all skip or all check.
        if not self.enabled:
            return False
        import torch  # here: the command below runs without torch

        flag = torch.tensor([1.0 if self.received else 0.0], device=accelerator.device)
        return accelerator.reduce(flag, "sum").item() > 0


def report_stopped(accelerator):
    """Leave the marker launch/ asks for: torchrun turns a worker's exit code 75 into 1, and srun may report
    another task's exit status."""
    marker = os.environ.get("RECIPE_STOP_MARKER")
    if marker and accelerator.is_local_main_process:
        # The templates put it in a directory of their own (mktemp -d); never follow a link planted there.
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            if exc.errno != errno.EEXIST:
                raise
            return  # already reported (another process of this node's step)
        with os.fdopen(fd, "w") as f:
            f.write(f"{EXIT_STOPPED}\n")


def stopped(accelerator, stopper, step, checkpoint_dir):
    """Report a stop on a signal and return the exit code: 75 ("requeue me") only when there is a checkpoint.
    Under accelerate launch the line says that the launcher reports 1, and it becomes the root cause in torchrun's
    failure report (its error file) instead of a pointer to torch's docs."""
    from .exits import report

    who = stopper.received or "a signal to another rank"
    if not checkpoint_dir:
        line = f"stopped by {who} after step {step}: no --checkpoint-dir was given, so this progress is lost"
    else:
        hidden = launcher_in_between() and not os.environ.get("RECIPE_STOP_MARKER")  # slurm_launch restores it
        reported = "; accelerate launch reports it as 1" if hidden else ""
        line = (f"stopped by {who} after step {step}: checkpoint saved in {checkpoint_dir}, run the same command "
                f"again to resume (exit code {EXIT_STOPPED}{reported})")
        report_stopped(accelerator)
    report(line, accelerator.is_main_process, prefix="", stream=sys.stdout)
    return EXIT_STOPPED if checkpoint_dir else 1


# ---- python3 recipes/runkit/stopping.py CHECKPOINT_DIR: stop a run from outside ---------------------------------

LOCK_FILE, LOCK_MAX_BYTES, MANIFEST_MAX_BYTES = ".lock", 4096, 64 << 20  # as dirlock.py and integrity.py write them
CHECKPOINT_NAME = re.compile(r"step-\d{8}")


def _read_regular(path, limit):
    """The bytes of a regular file of at most `limit` bytes, opened without following a link or blocking on a FIFO
    (the directory is shared storage: untrusted); None for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, 1 << 20)):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks) if size <= limit else None


def _json_of(path, limit):
    data = _read_regular(path, limit)
    try:
        value = json.loads(data) if data else None
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _alive(pid):
    """Whether the process runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _run_on(pid, directory):
    """The working directory of process `pid` if its command line gives `directory` as --checkpoint-dir (relative
    paths read from that working directory), else None. The lock is untrusted, and its pid may be another process
    by now: only a run on this directory is signalled."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None
    given = [b for a, b in zip(argv, argv[1:]) if a == "--checkpoint-dir"]
    given += [a.split("=", 1)[1] for a in argv if a.startswith("--checkpoint-dir=")]
    target = os.path.realpath(directory)
    return cwd if any(os.path.realpath(os.path.join(cwd, g)) == target for g in given) else None


def _newest_state(directory):
    """(path, training state) of the newest checkpoint whose manifest reads, or (None, {})."""
    try:
        names = sorted(n for n in os.listdir(directory) if CHECKPOINT_NAME.fullmatch(n))
    except OSError:
        names = []
    for name in reversed(names):
        manifest = _json_of(os.path.join(directory, name, "checkpoint.json"), MANIFEST_MAX_BYTES)
        if manifest and isinstance(manifest.get("train_state"), dict):
            return os.path.join(directory, name), manifest["train_state"]
    return None, {}


def _holder_pid(directory):
    """The main process of the run holding `directory` on this host, or the message saying why there is none."""
    lock = _json_of(os.path.join(directory, LOCK_FILE), LOCK_MAX_BYTES) or {}
    pid, host, job = lock.get("pid"), lock.get("host"), lock.get("job")
    if type(pid) is not int or pid < 1 or not isinstance(host, str):
        return None, (f"no run holds {directory} ({os.path.join(directory, LOCK_FILE)} is missing or not a lock a "
                      f"run writes): it has ended, or it never started there")
    if host != socket.gethostname():
        return None, f"the run holding {directory} runs on {host} (pid {pid}): run this command there"
    if isinstance(job, str):
        return None, (f"the run holding {directory} is Slurm job {job}: stop it with scancel --signal=TERM --full "
                      f"{job} (the job's templates then requeue it)")
    if not _alive(pid) or _run_on(pid, directory) is None:
        return None, (f"{os.path.join(directory, LOCK_FILE)} names pid {pid}, which is no run on {directory} any "
                      f"more: that run ended without releasing its lock (the next run takes it over)")
    return pid, None


def stop_run(argv=None):
    """The command: stop the run holding a checkpoint directory, wait until it has ended, return its exit code."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="stopping.py", description="Stop the run that holds CHECKPOINT_DIR with a checkpoint, as its first line "
        "says: it finishes its step, every rank saves, and it exits. Exits 75 once that checkpoint is saved (run "
        "the run's command again to resume), 0 if the run finished first, 1 if it ended without saving, 2 if no "
        "run on this host holds the directory.")
    parser.add_argument("checkpoint_dir", help="the run's --checkpoint-dir")
    directory = parser.parse_args(argv).checkpoint_dir
    pid, problem = _holder_pid(directory)
    if problem:
        print(f"stopping.py: error: {problem}", file=sys.stderr, flush=True)
        return 2
    cwd, (before, _) = _run_on(pid, directory) or ".", _newest_state(directory)
    signalled = time.time()
    os.kill(pid, signal.SIGTERM)
    print(f"stopping the run on {directory} (pid {pid}): it finishes its step, saves a checkpoint and exits",
          flush=True)
    while _alive(pid):
        time.sleep(0.2)
    path, state = _newest_state(directory)
    if state.get("stopped") is True and path != before:  # saved for this stop, not an earlier one
        print(f"stopped after step {state.get('step')}: checkpoint {path}; run the training command again to resume "
              f"(exit code {EXIT_STOPPED})", flush=True)
        return EXIT_STOPPED
    summary = os.path.join(cwd, str(state.get("output_dir") or ""), "summary.json")
    if state and os.path.isfile(summary) and os.path.getmtime(summary) >= signalled:
        print(f"the run had finished before it could stop: its results are in {os.path.dirname(summary)}", flush=True)
        return 0
    print(f"stopping.py: error: pid {pid} ended without saving a checkpoint for the stop (its own output says why); "
          f"the newest checkpoint in {directory} is {path or 'none'}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(stop_run())
