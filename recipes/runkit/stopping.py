"""Stopping on a signal: every rank finishes the same step, saves, and exits 75 ("run me again").

Owns the stop flags, the signal handlers, the agreement between ranks, the marker file that
launch/ reads, the exit code, and the tie between a worker and its launcher (a worker whose
launcher dies is killed, so no orphan trains on). Slurm sends SIGUSR1 (the templates' timer) or SIGTERM
(preemption) to every process of the job step, DataLoader workers included.
"""

import ctypes
import errno
import os
import signal

import torch

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on a signal after saving a checkpoint; run the same command again


def add_stop_args(group):
    group.add_argument("--stop-signals", default="USR1,TERM",
                       help="signals that make every rank finish its step, save a checkpoint and exit "
                            f"with code {EXIT_STOPPED} (comma-separated; '' to disable)")
    group.add_argument("--stop-check-every", type=int, default=0, metavar="N",
                       help="ranks agree on stopping at each progress line (--log-every), where they synchronise "
                            "anyway, and at each epoch's end; N > 0 adds a check every N optimizer steps (one scalar "
                            "all-reduce and a host sync each): for steps so slow that a progress window outlasts "
                            "the grace time before the job is killed")


def signal_numbers(names):
    return [getattr(signal, n if n.startswith("SIG") else "SIG" + n)
            for n in filter(None, (n.strip().upper() for n in names.split(",")))]


def ignore_stop_signals(names, worker_id=None):
    """DataLoader worker_init_fn: Slurm signals every process of a step, DataLoader workers included;
    only the training process acts on a stop signal, and a worker must not die of one."""
    for number in signal_numbers(names):
        signal.signal(number, signal.SIG_IGN)


def die_with_launcher():
    """Under accelerate launch / torchrun (Linux): SIGKILL this worker when its launcher dies. The launcher
    starts its workers in sessions of their own, so a kill -9 or an OOM kill of the launcher would leave
    them training as orphans, writing the same checkpoints and logs as the rerun the user starts next."""
    launcher = os.getppid()
    try:
        with open(f"/proc/{launcher}/cmdline", "rb") as f:
            parent = [os.path.basename(a) for a in f.read().decode(errors="replace").split("\0")]
    except OSError:
        return  # not Linux
    # torchrun's workers (several processes), or accelerate launch's single child; not a shell or srun.
    if "TORCHELASTIC_RUN_ID" not in os.environ and not ("accelerate" in parent and "launch" in parent):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher:  # it died before the line above: act now (a launcher may itself be pid 1)
        os.kill(os.getpid(), signal.SIGKILL)


class GracefulStop:
    """Remember that a stop signal arrived; all ranks then agree on the step to stop after."""

    def __init__(self, names, check_every=1):
        self.received = None
        numbers = signal_numbers(names)
        self.enabled = bool(numbers)  # --stop-signals '': nothing to agree on, no collective per step
        self.check_every, self.calls = max(check_every, 1), 0
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

    def agreed(self, accelerator, force=False):
        """True on every rank once any rank got a signal. Collective: call it on all ranks at the same step.
        force: check now, outside the per-step cadence (an epoch's end, where a checkpoint is saved anyway)."""
        # Every rank has the same flags and makes the same calls, so all skip or all check.
        if not self.enabled:
            return False
        if not force:
            self.calls += 1
            if self.calls % self.check_every:
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
