"""One writer per --checkpoint-dir: the lock that keeps two runs from mixing and rotating away each
other's checkpoints (a second job, a requeued twin, a rerun while orphans of a killed launch live on)."""

import atexit
import json
import os
import shutil
import socket
import sys
import threading
import time

LOCK = ".lock"
TAKEOVER = ".lock.takeover"  # held (O_EXCL) by the one run replacing a stale lock, for a moment
HEARTBEAT_S, STALE_S = 30, 180  # the holder touches its lock every 30 s; 3 minutes without a touch: dead


def take(directory):
    """Main process: (lock, None) once this run holds `directory`, its unfinished saves removed; or
    (None, the message saying why not)."""
    try:
        os.makedirs(directory, exist_ok=True)
        lock = DirectoryLock(directory)
        error = lock.acquire()
    except OSError as exc:
        return None, f"--checkpoint-dir {directory}: cannot be used ({exc})"
    if error:
        return None, error
    for leftover in (n for n in os.listdir(directory) if n.startswith(".tmp-")):
        print(f"removing {os.path.join(directory, leftover)}: a save that never finished", file=sys.stderr, flush=True)
        shutil.rmtree(os.path.join(directory, leftover), ignore_errors=True)
    return lock, None


class DirectoryLock:
    """One writer per --checkpoint-dir, on any shared file system: the lock is a file created with O_EXCL
    (atomic on NFS v3+ and Lustre) holding host, pid and Slurm job id, and touched every 30 s while held.

    A lock is stale, and taken over, when its holder is a dead process on this host, an earlier run of
    this very Slurm job (a requeue: Slurm never runs one job id twice at once), or silent for 3 minutes.
    Only one run at a time may replace a stale lock (an O_EXCL .lock.takeover), and a holder whose lock
    was replaced meanwhile (it was suspended for minutes) finds out at its next save and stops."""

    def __init__(self, directory):
        self.path = os.path.join(directory, LOCK)
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID"),
                   "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0), "since": time.time()}
        self.held = False
        self._stop = threading.Event()

    def acquire(self):
        """None once held, or the message naming the holder."""
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                holder, why = self._stale()
                if why is None:
                    return self._refusal(holder)
                if not self._take_over(holder, why):
                    return self._refusal(holder)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            atexit.register(self.release)
            threading.Thread(target=self._heartbeat, daemon=True, name="checkpoint-dir lock").start()
            return None
        return self._refusal(self._stale()[0])

    def _take_over(self, holder, why):
        """Remove the stale lock, unless another run is replacing it right now."""
        guard = os.path.join(os.path.dirname(self.path), TAKEOVER)
        try:
            if time.time() - os.lstat(guard).st_mtime > 60:  # left by a run that died while taking over
                os.unlink(guard)
        except FileNotFoundError:
            pass
        try:
            os.close(os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
        except FileExistsError:
            return False
        try:
            if self._read() == holder:  # still the lock judged stale, not one a faster run just made
                print(f"warning: taking over {self.path}: {why}", file=sys.stderr, flush=True)
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.unlink(guard)
        return True

    def _read(self):
        with open(self.path) as f:
            return json.load(f)

    def _stale(self):
        """(holder, None) for a live holder, or (holder, why it is stale)."""
        try:
            holder = self._read()
            age = time.time() - os.stat(self.path).st_mtime
        except FileNotFoundError:
            return {}, "it was just released"
        except (OSError, ValueError):
            try:
                age = time.time() - os.lstat(self.path).st_mtime
            except FileNotFoundError:
                return {}, "it was just released"
            return {}, (None if age < STALE_S else f"an unreadable lock, untouched for {age:.0f} s")
        if not isinstance(holder, dict):
            holder = {}
        if holder.get("host") == self.me["host"] and isinstance(holder.get("pid"), int) and not _alive(holder["pid"]):
            return holder, f"its holder, pid {holder['pid']} on this host, is gone"
        if self.me["job"] and holder.get("job") == self.me["job"] and holder.get("restart", 0) < self.me["restart"]:
            return holder, f"its holder is an earlier run of this job ({self.me['job']}), which Slurm requeued"
        if age > STALE_S:
            return holder, f"its holder has not touched it for {age:.0f} s"
        return holder, None

    def _refusal(self, holder):
        who = "another run"
        if holder:
            job = f", Slurm job {holder['job']}" if holder.get("job") else ""
            who = f"pid {holder.get('pid')} on {holder.get('host')}{job}"
        return (f"--checkpoint-dir {os.path.dirname(self.path)} is in use by {who} (its lock: {self.path}). "
                f"Two runs writing one directory would mix and rotate away each other's checkpoints: wait for "
                f"that run to end, or give this one another --checkpoint-dir. If that run is dead, its lock is "
                f"taken over after {STALE_S} s without a heartbeat (or delete the file).")

    def _mine(self):
        try:
            return self._read() == self.me
        except (OSError, ValueError):
            return False

    def lost(self):
        """None while this run holds the lock, or the message saying that another run took it over."""
        if not self.held or self._mine():
            return None
        return (f"another run took over --checkpoint-dir {os.path.dirname(self.path)} while this one was not "
                f"heard from for {STALE_S} s (suspended?); this run stops so that only one writes there")

    def _heartbeat(self):
        while not self._stop.wait(HEARTBEAT_S):
            if self._mine():  # never touch a lock another run has taken over
                try:
                    os.utime(self.path)
                except OSError:
                    pass

    def release(self):
        if not self.held or os.getpid() != self.me["pid"]:  # never from a forked child
            return
        self.held = False
        self._stop.set()
        if self._mine():
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
