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
    """Remember that a stop signal arrived; all ranks then agree on the step to stop after. Before training begins
    (begin()) there is nothing to save: a stop signal then ends the process at once, with one line, instead of
    waiting out minutes of loading (a data set, a model)."""

    def __init__(self, names, checkpoint_dir=None):
        self.received, self.training, self.checkpoint_dir = None, False, checkpoint_dir
        numbers = signal_numbers(names)
        self.enabled = bool(numbers)  # --stop-signals '': nothing to agree on, no collective per step
        self.numbers = numbers
        for number in numbers:
            signal.signal(number, self._handler)

    def begin(self):
        """Training begins: from here on a stop signal is remembered, and the ranks stop after the same step."""
        self.training = True

    def on_interrupt(self, newest):
        """Ctrl-C (SIGINT, not a stop signal: nothing is saved) ends the process with one line instead of a
        traceback per process: newest() gives (step, the newest checkpoint's path or None) for it. A second Ctrl-C
        kills at once. Under torchrun the workers run in sessions of their own: only the launcher gets it, and
        sends them SIGTERM, a stop signal."""
        def interrupted(signum, frame):
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            step, path = newest()
            if os.environ.get("RANK", "0") == "0":
                kept = (f"the newest checkpoint is {path}: run the same command again to resume from it" if path
                        else "no checkpoint was saved" + ("" if self.checkpoint_dir else " (no --checkpoint-dir)"))
                print(f"\ninterrupted (Ctrl-C) at step {step}: nothing more is saved; {kept} (SIGTERM or SIGUSR1 "
                      f"stop with a checkpoint)", file=sys.stderr, flush=True)
            raise SystemExit(130)
        signal.signal(signal.SIGINT, interrupted)

    def ignore_from_now(self):
        """The training is over: a stop signal now (a time-limit timer firing late) must not kill the
        process while it writes its results. Python resets its own handlers to the default action at
        exit, which for SIGUSR1 is death, but it leaves SIG_IGN alone."""
        for number in self.numbers:
            signal.signal(number, signal.SIG_IGN)

    def _handler(self, signum, frame):
        # Only set a flag: the step in flight finishes, and no collective is left half-done.
        self.received = signal.Signals(signum).name
        if not self.training:
            raise SystemExit(self._before_training())

    def _before_training(self):
        """The line and exit code of a stop before the first step: 75 ("run me again", and the marker launch/ reads)
        with a --checkpoint-dir, whose checkpoints are as they were; 1 without one."""
        code = EXIT_STOPPED if self.checkpoint_dir else 1
        if os.environ.get("RANK", "0") == "0":
            print(f"stopped by {self.received} before training began: nothing was trained, nothing to save; run the "
                  f"same command again (exit code {code})", file=sys.stderr, flush=True)
        if self.checkpoint_dir and os.environ.get("LOCAL_RANK", "0") == "0":
            _leave_marker()
        return code

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
    if accelerator.is_local_main_process:
        _leave_marker()


def _leave_marker():
    """RECIPE_STOP_MARKER, if the templates set it, holding 75 (once per node)."""
    marker = os.environ.get("RECIPE_STOP_MARKER")
    if not marker:
        return
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

# As dirlock.py, integrity.py and checkpoints.py write them (this command runs without torch, so without them).
LOCK_MAX_BYTES, MANIFEST_MAX_BYTES = 4096, 4 << 20
LOCK_NAMES = re.compile(r"\.lock(?:\.\d+\.[0-9a-f]{8})?")
CHECKPOINT_NAME = re.compile(r"step-(\d{8})(?:\.[0-9a-z]{8})?")
WAIT_S = 900  # how long the command waits for the run to save and end, by default


def _read_regular(path, limit):
    """The bytes of a regular file of this user's, of at most `limit` bytes, opened without following a link or
    blocking on a FIFO (the directory is shared storage: untrusted); None for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > limit:
            return None
        return os.read(fd, limit + 1)
    finally:
        os.close(fd)


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


def _holds(pid, lock):
    """Whether process `pid` holds the lock file `lock` open: the mark a run leaves (dirlock.py keeps its lock open
    while it lives), which no other process has, whatever its command line says. None when /proc does not let this
    user look (another user's process, or one that made itself unreadable)."""
    try:
        st = os.stat(lock, follow_symlinks=False)
        fds = os.listdir(f"/proc/{pid}/fd")
    except PermissionError:
        return None
    except OSError:
        return False
    for fd in fds:
        try:
            held = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (held.st_dev, held.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def _own_locks(directory):
    """[(path, fields)] of this user's locks in `directory` that read as a lock (.lock first)."""
    try:
        names = sorted(n for n in os.listdir(directory) if LOCK_NAMES.fullmatch(n))
    except OSError:
        return []
    found = [(os.path.join(directory, n), _json_of(os.path.join(directory, n), LOCK_MAX_BYTES)) for n in names]
    return [(path, fields) for path, fields in found if fields]


def _newest_state(directory):
    """(path, training state) of this user's newest checkpoint whose manifest reads, or (None, {})."""
    try:
        found = sorted((int(m.group(1)), n) for n in os.listdir(directory) if (m := CHECKPOINT_NAME.fullmatch(n)))
    except OSError:
        found = []
    for _, name in reversed(found[-1000:]):
        manifest = _json_of(os.path.join(directory, name, "checkpoint.json"), MANIFEST_MAX_BYTES)
        if manifest and isinstance(manifest.get("train_state"), dict):
            return os.path.join(directory, name), manifest["train_state"]
    return None, {}


def _holder_pid(directory):
    """The main process of this user's run holding `directory` on this host, or the message saying why there is
    none. Only a process that holds the directory's lock open is a run on it (_holds)."""
    locks = _own_locks(directory)
    if not locks:
        return None, (f"no run holds {directory} ({os.path.join(directory, '.lock')} is missing or not a lock a run of "
                      f"this user's writes): it has ended, or it never started there")
    seen = []
    for lock, fields in locks:
        pid, host, job = fields.get("pid"), fields.get("host"), fields.get("job")
        if type(pid) is not int or pid < 1 or not isinstance(host, str):
            seen.append(f"{lock} is not a lock a run writes")
        elif host != socket.gethostname():
            return None, f"the run holding {directory} runs on {host} (pid {pid}): run this command there"
        elif isinstance(job, str):
            return None, (f"the run holding {directory} is Slurm job {job}: stop it with scancel --signal=TERM --full "
                          f"{job} (the job's templates then requeue it)")
        elif not _alive(pid):
            seen.append(f"{lock} names pid {pid}, which has ended: that run ended without releasing its lock (the "
                        f"next run takes it over)")
        elif (holds := _holds(pid, lock)) is None:
            seen.append(f"{lock} names pid {pid}, which is alive but that this user cannot look into (permission "
                        f"denied in /proc/{pid}): not signalled; if it is your run, stop it with kill -TERM {pid}")
        elif not holds:
            seen.append(f"{lock} names pid {pid}, which is alive but does not hold that lock: it is no run on "
                        f"{directory} (the run ended and another process has its number)")
        else:
            return pid, None
    return None, "; ".join(seen)


def _wait(pid, seconds):
    """Whether process `pid` ended within `seconds`."""
    end = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.2)
    return True


def stop_run(argv=None):
    """The command: stop the run holding a checkpoint directory, wait until it has ended, return its exit code."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="stopping.py", description="Stop the run that holds CHECKPOINT_DIR with a checkpoint, as its first line "
        "says: it finishes its step, every rank saves, and it exits. Exits 75 once that checkpoint is saved (run "
        "the run's command again to resume), 0 if the run finished first, 1 if it ended without saving or is still "
        "running after --wait, 2 if no run of this user's on this host holds the directory.")
    parser.add_argument("checkpoint_dir", help="the run's --checkpoint-dir")
    parser.add_argument("--wait", type=float, default=WAIT_S, help="seconds to wait for the run to save and end")
    args = parser.parse_args(argv)
    directory = args.checkpoint_dir
    pid, problem = _holder_pid(directory)
    if problem:
        print(f"stopping.py: error: {problem}", file=sys.stderr, flush=True)
        return 2
    cwd, (before, _) = os.readlink(f"/proc/{pid}/cwd"), _newest_state(directory)
    signalled = time.time()
    os.kill(pid, signal.SIGTERM)
    print(f"stopping the run on {directory} (pid {pid}): it finishes its step, saves a checkpoint and exits",
          flush=True)
    if not _wait(pid, args.wait):
        print(f"stopping.py: error: pid {pid} is still running {args.wait:g} s after SIGTERM (a long step or save, or "
              f"it does not act on the signal): wait longer (--wait), or look at its output", file=sys.stderr,
              flush=True)
        return 1
    return _outcome(directory, pid, before, cwd, signalled)


def _outcome(directory, pid, before, cwd, signalled):
    """The exit code and line once the run has ended: 75 for a checkpoint saved for this stop (newer than `before`,
    the newest when it was signalled), 0 for a run that finished first, 1 otherwise."""
    path, state = _newest_state(directory)
    if state.get("stopped") is True and path != before:  # saved for this stop, not an earlier one
        print(f"stopped after step {state.get('step')}: checkpoint {path}; run the training command again to resume "
              f"(exit code {EXIT_STOPPED})", flush=True)
        return EXIT_STOPPED
    summary = os.path.join(cwd, str(state.get("output_dir") or ""), "summary.json")
    if state and os.path.isfile(summary) and os.path.getmtime(summary) >= signalled:
        print(f"the run had finished before it could stop: its results are in {os.path.dirname(summary)}", flush=True)
        return 0
    print(f"stopping.py: error: pid {pid} ended without saving a checkpoint for the stop (its own output says why; a "
          f"run stopped before its first step has nothing to save); the newest checkpoint in {directory} is "
          f"{path or 'none'}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(stop_run())
