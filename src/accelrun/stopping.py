"""Stopping on a signal: every rank finishes the same step, saves, and exits 75 ("run me again").

Owns the signal handlers (the flags are flags.py's), the agreement between ranks, the marker file that
launch/ reads, the exit code (EXIT_STOPPED: the one definition, which flags.py, the stop command and
launch/slurm_launch.py read), and the line that tells the user how to stop a run (how_to_stop), which names
the stop command (stop.py) under a launcher that reports 75 as 1 (launcher.py). Slurm sends SIGUSR1 (the
templates' timer) or SIGTERM (preemption) to every process of the job step, DataLoader workers included.
Standard library only at import (torch where the ranks agree), so that launch/ and the stop command read
EXIT_STOPPED without torch.
"""

import errno
import os
import shlex
import signal
import sys

from .launcher import launcher_in_between

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on a signal after saving a checkpoint; run the same command again
STOP_COMMAND = "python3 -m accelrun.stop"  # stops a run from outside (stop.py): STOP_COMMAND DIR


def signal_numbers(names):
    return [getattr(signal, n if n.startswith("SIG") else "SIG" + n)
            for n in filter(None, (n.strip().upper() for n in names.split(",")))]


def ignore_stop_signals(names, worker_id=None):
    """DataLoader worker_init_fn: Slurm signals every process of a step, DataLoader workers included;
    only the training process acts on a stop signal, and a worker must not die of one."""
    for number in signal_numbers(names):
        signal.signal(number, signal.SIG_IGN)


def _shown_path(path):
    """A path as the user would type it from where the run was started: relative below it, absolute elsewhere."""
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else os.path.abspath(path)


def how_to_stop(checkpoint_dir):
    """The end of the run's first line: how to stop this run, naming a command the user can run.

    Under Slurm: scancel, which signals every process of the job (the templates' batch script traps SIGTERM
    and stays alive to requeue). Under accelerate launch (launcher_in_between), which reports the workers' 75
    as 1: the stop command (stop.py), which signals this process (the main one), waits until the run has saved
    and ended, and exits 75 itself. A signal to the launcher would stop the run too, but torchrun answers it
    with a SignalException traceback and exit 1 and kills workers that take more than 30 s; SIGUSR1 kills it
    outright (exit 138: no checkpoint, a stale lock). Otherwise SIGTERM to this process, which exits 75 itself."""
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        command = f"scancel --signal=TERM --full {job}"
        after = ", then the job requeues itself" if os.environ.get("RECIPE_STOP_MARKER") else ""
    elif checkpoint_dir and launcher_in_between():
        command = f"{STOP_COMMAND} {shlex.quote(_shown_path(checkpoint_dir))}"
        after = ""
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
        # Ctrl-C's one line names the newest checkpoint (on_interrupt): from here on Python's own handler, which
        # also lets go of the run (the loaders, the model) that the line's closure held.
        signal.signal(signal.SIGINT, signal.default_int_handler)

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
        import torch  # here: launch/ and the stop command import this module without torch

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
