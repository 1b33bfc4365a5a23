"""Stopping on a signal: every rank finishes the same step, saves, and exits 75 ("run me again").

Owns the signal handlers (the flags are flags.py's), the agreement between ranks, the marker file that
launch/ reads, the exit code, the line that tells the user how to stop a run, and the tie between a
worker and its launcher (a worker whose launcher dies is killed, so no orphan trains on). Slurm sends
SIGUSR1 (the templates' timer) or SIGTERM (preemption) to every process of the job step, DataLoader
workers included.
"""

import ctypes
import errno
import os
import signal
import sys

import torch

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


def die_with_launcher():
    """Under accelerate launch / torchrun (Linux): SIGKILL this worker when its launcher dies. The launcher
    starts its workers in sessions of their own, so a kill -9 or an OOM kill of the launcher would leave
    them training as orphans, writing the same checkpoints and logs as the rerun the user starts next.

    Call it first thing (Run(...) does). A launcher killed while this worker was still importing torch is
    already gone: its worker belongs to init or a subreaper now, and exits at once."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            argv = [os.path.basename(a) for a in f.read().decode(errors="replace").split("\0")]
    except OSError:
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


def how_to_stop(checkpointing):
    """The end of the run's first line: how to stop this run, naming what the user can signal.

    Under Slurm: scancel, which signals every process of the job (the templates' batch script traps SIGTERM
    and stays alive to requeue). Under torchrun / accelerate launch (several processes): the launcher, which
    passes SIGTERM on to its workers; SIGUSR1 would kill it instead (exit 138: no checkpoint, a stale lock).
    Otherwise this process: with accelerate launch's single process, SIGTERM to the launcher kills it, and
    with it this worker (die_with_launcher)."""
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        command = f"scancel --signal=TERM --full {job}"
        after = ", then the job requeues itself" if os.environ.get("RECIPE_STOP_MARKER") else ""
    else:
        command, after = f"kill -TERM {elastic_agent() or os.getpid()}", ""
    if checkpointing:
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
    """Report a stop on a signal and return the exit code: 75 ("requeue me") only when there is a checkpoint."""
    if accelerator.is_main_process:
        print(f"stopped by {stopper.received or 'a signal to another rank'} after step {step}: "
              + (f"checkpoint saved in {checkpoint_dir}, run the same command again to resume (exit code "
                 f"{EXIT_STOPPED})" if checkpoint_dir else "no --checkpoint-dir was given, so this progress is lost"),
              flush=True)
    if checkpoint_dir:
        report_stopped(accelerator)
    return EXIT_STOPPED if checkpoint_dir else 1
