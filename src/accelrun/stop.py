"""The stop command: stop the run that holds a --checkpoint-dir with a checkpoint, from outside the run.

    python3 -m accelrun.stop CHECKPOINT_DIR

stops the run that holds CHECKPOINT_DIR (its lock names the main process) with a checkpoint, waits until it has
saved and ended, and exits 75 as the run itself does, which accelerate launch cannot pass on: it turns any exit of
its workers that is not 0 into 1. The run's first line names this command under such a launcher
(stopping.how_to_stop).

The directory is judged first, as the run judged it (accelrun/trust.py: by its owner and those above it); one
that others could rename entries in is refused in one line, exit 2. Its content is untrusted: this command reads it
only through the checkpoint package's modules that need nothing but the standard library, by the very rules the run
reads them with: the names (checkpoint/layout.py), whose entries a run may use and how many it looks at, this user's
picked out before the bound (checkpoint/owners.py), the lock file's schema and whether a process is alive
(checkpoint/lock.py), a manifest's format version and training state (checkpoint/train_state.py); it signals only a
process of this host that holds the lock open.
accelrun/__init__.py imports nothing eagerly, so the command imports no torch.
"""

import os
import signal
import socket
import sys
import time

from accelrun.checkpoint.layout import LOCK, is_lock_name
from accelrun.checkpoint.lock import alive, read_lock
from accelrun.checkpoint.owners import own_steps
from accelrun.checkpoint.train_state import training_state
from accelrun.stopping import EXIT_STOPPED
from accelrun.trust import refusal

WAIT_S = 900  # how long the command waits for the run to save and end, by default


def _holds(pid, lock):
    """Whether process `pid` holds the lock file `lock` open: the mark a run leaves (lock.py keeps its lock open
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
    """[(path, fields)] of this user's locks in `directory` that read as a lock a run writes (lock.read_lock: the
    lock file's one schema), .lock first."""
    try:
        names = sorted(n for n in os.listdir(directory) if is_lock_name(n))
    except OSError:
        return []
    found = [(os.path.join(directory, n), read_lock(os.path.join(directory, n))) for n in names]
    return [(path, fields) for path, fields in found if fields]


def _newest_state(directory):
    """(path, training state) of this user's newest checkpoint whose manifest reads as the checkpoint code reads it
    (train_state.training_state: a format version it reads, each field of the type and range Run writes), or
    (None, {}): this user's step-* entries first, then the newest owners.INSPECTED of them (another user's 1,000
    planted names hid the checkpoint the run saved for the stop)."""
    for _, path in own_steps(directory, None):
        try:
            return path, training_state(path)
        except ValueError:
            continue
    return None, {}


def _holder_pid(directory):
    """The main process of this user's run holding `directory` on this host, or the message saying why there is
    none. Only a process that holds the directory's lock open is a run on it (_holds)."""
    locks = _own_locks(directory)
    if not locks:
        return None, (f"no run holds {directory} ({os.path.join(directory, LOCK)} is missing or not a lock a run of "
                      f"this user's writes): it has ended, or it never started there")
    seen = []
    for lock, fields in locks:
        pid, host, job = fields["pid"], fields["host"], fields.get("job")  # of lock_fields' types and ranges
        if host != socket.gethostname():
            return None, f"the run holding {directory} runs on {host} (pid {pid}): run this command there"
        elif isinstance(job, str):
            return None, (f"the run holding {directory} is Slurm job {job}: stop it with scancel --signal=TERM --full "
                          f"{job} (the job's templates then requeue it)")
        elif not alive(pid):
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
    while alive(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.2)
    return True


def stop_run(argv=None):
    """The command: stop the run holding a checkpoint directory, wait until it has ended, return its exit code."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python3 -m accelrun.stop", description="Stop the run that holds CHECKPOINT_DIR with a checkpoint, as its "
        "first line says: it finishes its step, every rank saves, and it exits. Exits 75 once that checkpoint is saved "
        "(run the run's command again to resume), 0 if the run finished first, 1 if it ended without saving or is "
        "still running after --wait, 2 if no run of this user's on this host holds the directory.")
    parser.add_argument("checkpoint_dir", help="the run's --checkpoint-dir")
    parser.add_argument("--wait", type=float, default=WAIT_S, help="seconds to wait for the run to save and end")
    args = parser.parse_args(argv)
    directory = args.checkpoint_dir
    problem = refusal(directory, "the checkpoint directory")
    pid, problem = (None, problem) if problem else _holder_pid(directory)
    if problem:
        print(f"accelrun.stop: error: {problem}", file=sys.stderr, flush=True)
        return 2
    cwd, (before, _) = os.readlink(f"/proc/{pid}/cwd"), _newest_state(directory)
    signalled = time.time()
    os.kill(pid, signal.SIGTERM)
    print(f"stopping the run on {directory} (pid {pid}): it finishes its step, saves a checkpoint and exits",
          flush=True)
    if not _wait(pid, args.wait):
        print(f"accelrun.stop: error: pid {pid} is still running {args.wait:g} s after SIGTERM (a long step or save, "
              f"or it does not act on the signal): wait longer (--wait), or look at its output", file=sys.stderr,
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
    print(f"accelrun.stop: error: pid {pid} ended without saving a checkpoint for the stop (its own output says why; a "
          f"run stopped before its first step has nothing to save); the newest checkpoint in {directory} is "
          f"{path or 'none'}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(stop_run())
