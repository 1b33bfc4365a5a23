"""One writer per --checkpoint-dir: the lock that keeps two runs from mixing and rotating away each
other's checkpoints (a second job, a requeued twin, a rerun while orphans of a killed launch live on).

Asks, before anything is made, removed or read there, whether the directory can be trusted (accelrun/trust.py: by
its owner and the directories above it; one others could rename entries in is refused in one line). Owns what a
crash left: a save of this user's left unfinished is removed only when it carries the marker a save writes first
(layout.SAVING); anything else named like one is left alone with a warning. The lock file itself is
untrusted: whatever is at .lock (a link, a FIFO, garbage) is one message or a takeover, never a hang. In a
shared directory with the sticky bit, another user's .lock (or .lock.takeover) does not hold this user's runs
back and cannot be removed: the run then locks under a name of its own, .lock.<uid>.<random>, and a run
that finds another live lock of its user's stops (owners.py: a run uses only its own user's entries).

Also owns the lock file's schema (lock_fields, read_lock) and whether a process on this host is alive (alive: a
zombie is not; launcher.process_state reads /proc), which the stop command asks too. Its names are layout.py's, and it
reads a lock as any small untrusted file (untrusted.py). Standard library only."""

import atexit
import json
import os
import secrets
import shutil
import socket
import stat
import sys
import threading
import time

from ..launcher import process_state
from ..trust import refusal
from .layout import LOCK, LOCK_MAX_BYTES, SAVING, TAKEOVER, TMP, is_lock_name, own_lock_name
from .owners import Passed, theirs
from .untrusted import Missing, read_small, whole

HEARTBEAT_S, STALE_S = 30, 180  # the holder touches its lock every 30 s; 3 minutes without a touch: dead
PID_MAX = 1 << 22  # Linux's largest pid_max: a holder on another host may have any pid up to it


class NotALock(OSError):
    """What is at .lock is a FIFO, a device or a socket: it cannot be read or safely replaced."""


class OthersLock(OSError):
    """What is at .lock (or .lock.takeover) belongs to another user: it cannot hold this user's runs back, nor be
    removed (a shared directory with the sticky bit)."""


def take(directory):
    """Main process: (lock, None) once this run holds `directory`, its unfinished saves removed; or
    (None, the message saying why not). Whether the directory can be trusted (trust.refusal: its owner, and those
    above it) is asked first, before anything there is made, removed, read or written."""
    try:
        error = refusal(directory, "--checkpoint-dir")
        if error:
            return None, error
        os.makedirs(directory, mode=0o700, exist_ok=True)  # a new one: only this user writes in it
        error = refusal(directory, "--checkpoint-dir")  # what makedirs found or made, judged again
        if error:
            return None, error
        lock = DirectoryLock(directory)
        error = lock.acquire()
    except OSError as exc:
        return None, f"--checkpoint-dir {directory}: cannot be used ({exc})"
    if error:
        return None, error
    clear_unfinished(directory)
    return lock, None


def clear_unfinished(directory):
    """Remove the saves of this user's that a crash left unfinished in `directory` (the lock held: no run of this
    user's is saving there): a .tmp-step-* directory of this user's that still holds the marker a save writes into
    it first and removes just before publishing it (layout.SAVING, a file of this user's). Anything else so named
    is set aside: left where it is, with one warning each (owners.Passed), never removed on the strength of its
    name: a complete checkpoint renamed to a .tmp- name has no marker, nor has another user's entry or a link."""
    passed = Passed("leaving alone")
    for leftover in sorted(n for n in os.listdir(directory) if n.startswith(TMP)):
        path = os.path.join(directory, leftover)
        try:
            st = os.lstat(path)
            if theirs(st):
                continue  # another user's: not this run's to remove, nor can it be
            if stat.S_ISDIR(st.st_mode) and _marked(path):
                print(f"removing {path}: a save that never finished", file=sys.stderr, flush=True)
                shutil.rmtree(path, ignore_errors=True)  # never follows a link inside it
                continue
        except OSError:
            continue
        passed.add(path, f"it is named like a save in progress but is not one this code left unfinished (no "
                         f"{SAVING} of this user's in it): if it is a checkpoint renamed, rename it back to step-N; "
                         f"if not, remove it yourself")
    passed.close(directory)


def _marked(path):
    """Whether the directory at `path` holds the marker of a save in progress (layout.SAVING): a regular file of
    this user's, looked at without following a link."""
    try:
        st = os.lstat(os.path.join(path, SAVING))
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and not theirs(st)


class DirectoryLock:
    """One writer per --checkpoint-dir, on any shared file system: the lock is a file created with O_EXCL
    (atomic on NFS v3+ and Lustre) holding host, pid and Slurm job id, and touched every 30 s while held.

    A lock is stale, and taken over, when its holder is a dead process on this host (alive), an earlier run of
    this very Slurm job (a requeue: Slurm never runs one job id twice at once), or silent for 3 minutes.
    Only one run at a time may replace a stale lock (an O_EXCL .lock.takeover), and a holder whose lock
    was replaced meanwhile (it was suspended for minutes) finds out at its next save and stops."""

    def __init__(self, directory):
        self.path = os.path.join(directory, LOCK)
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID"),
                   "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0), "since": time.time()}
        self.held, self._marker = False, None
        self._stop = threading.Event()

    def acquire(self):
        """None once held, or the message naming the holder."""
        try:
            error = self._acquire_shared()
        except OthersLock as exc:  # a shared directory with the sticky bit: a name of this user's own instead
            directory = os.path.dirname(self.path)
            self.path = os.path.join(directory, own_lock_name(os.geteuid(), secrets.token_hex(4)))
            print(f"warning: {exc}; this run locks {directory} with {self.path} instead", file=sys.stderr, flush=True)
            error = None if self._create() else self._refusal({})
        if error:
            return error
        rival = self._rival()
        if rival:
            self.release()
            return self._refusal(rival)
        return None

    def _acquire_shared(self):
        """None once .lock is held, or the message naming its holder; OthersLock where another user holds it."""
        for _ in range(3):
            if self._create():
                return None
            try:
                holder, why = self._stale()
            except NotALock as exc:
                return str(exc)
            if why is None:
                return self._refusal(holder)
            if not self._take_over(holder, why):
                return self._being_taken_over(why)
        try:
            return self._refusal(self._stale()[0])
        except NotALock as exc:
            return str(exc)

    def _create(self):
        """Whether this run created its lock file (O_EXCL: False if something is there) and holds it now."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.me, f)
            f.flush()
            os.fsync(f.fileno())
        # Held open while the run lives: the mark by which the stop command knows this process is the lock's run
        # (a pid alone may have been reused; a command line proves nothing).
        self._marker = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        self.held = True
        atexit.register(self.release)
        threading.Thread(target=self._heartbeat, daemon=True, name="checkpoint-dir lock").start()
        return True

    def _rival(self):
        """The holder of another live lock of this user's on the directory, or None; this user's stale ones of its
        own names are removed. A run that took a lock of its own name (another user holds .lock) and a run that
        took .lock after that user's left each find the other here: the later one stops (both, if they start in
        the same instant), so that one run writes."""
        directory, mine = os.path.dirname(self.path), os.path.basename(self.path)
        for name in sorted(n for n in os.listdir(directory) if is_lock_name(n) and n != mine):
            path = os.path.join(directory, name)
            try:
                holder, why = self._stale(path)
            except (OthersLock, NotALock, FileNotFoundError):
                continue
            if why is None:
                return holder
            if name != LOCK:
                _remove_own(path)
        return None

    def _take_over(self, holder, why):
        """Remove the stale lock, unless another run is replacing it right now (OthersLock where another user's
        .lock.takeover, which can neither be trusted nor removed, is there)."""
        guard = os.path.join(os.path.dirname(self.path), TAKEOVER)
        try:
            st = os.lstat(guard)
            if theirs(st):
                raise OthersLock(f"{guard} {theirs(st)}")
            if time.time() - st.st_mtime > 60:  # left by a run that died while taking over
                os.unlink(guard)
        except FileNotFoundError:
            pass
        try:
            os.close(os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
        except FileExistsError:
            return False
        try:
            if self._inspect()[2] == holder.get("identity"):  # still the lock judged stale, not a faster run's
                print(f"warning: taking over {self.path}: {why}", file=sys.stderr, flush=True)
                os.unlink(self.path)  # a link itself, never what it points to
        except (FileNotFoundError, NotALock):
            pass
        finally:
            os.unlink(guard)
        return True

    def _inspect(self, path=None):
        """(holder, age in s, identity) of what is at .lock (or `path`): holder the lock's fields when they are a
        lock this code writes, "link" for a symbolic link, else None (an unknown holder); identity tells one lock
        file from its replacement. Raises FileNotFoundError when there is none, OthersLock when it is another
        user's, NotALock for a FIFO, device or socket. Read as any small untrusted file (untrusted.read_small:
        O_NOFOLLOW|O_NONBLOCK, checked with fstat, bounded): nothing here blocks or follows a link."""
        path = path or self.path
        st = os.lstat(path)
        if theirs(st):
            raise OthersLock(f"{path} {theirs(st)}")
        identity, age = (st.st_dev, st.st_ino, st.st_mtime_ns), time.time() - st.st_mtime
        if stat.S_ISLNK(st.st_mode):
            return "link", age, identity
        if not stat.S_ISREG(st.st_mode):
            raise NotALock(f"{path} is not a lock file this code writes (a FIFO, device or socket): another "
                           f"user or program put it there. Remove it (rm {path}) and run again.")
        try:
            data = read_small(path, LOCK_MAX_BYTES)
        except Missing:
            raise FileNotFoundError(f"{path} was just removed") from None
        except OSError:  # replaced by a link or a FIFO, grown past a lock, or made unreadable meanwhile: unknown
            return None, age, identity
        return lock_fields(data), age, identity

    def _stale(self, path=None):
        """(holder, None) for a live holder, or (holder, why it is stale) of the lock at .lock (or `path`); holder:
        {"fields": the lock's fields or {} when unknown, "identity": which lock file was judged}. Raises NotALock,
        OthersLock."""
        try:
            fields, age, identity = self._inspect(path)
        except FileNotFoundError:
            return {}, "it was just released"
        holder = {"fields": fields if isinstance(fields, dict) else {}, "identity": identity}
        if fields == "link":
            return holder, "it is a symbolic link, not a lock this code writes"
        if fields is None:
            return holder, (None if age < STALE_S else f"its content is not a lock this code writes (an unknown "
                                                        f"holder), untouched for {age:.0f} s")
        holder = {**fields, **holder}
        if holder.get("host") == self.me["host"] and not alive(holder["pid"]):
            return holder, f"its holder, pid {holder['pid']} on this host, is gone"
        if self.me["job"] and holder.get("job") == self.me["job"] and (holder.get("restart") or 0) < self.me["restart"]:
            return holder, f"its holder is an earlier run of this job ({self.me['job']}), which Slurm requeued"
        if age > STALE_S:
            return holder, f"its holder has not touched it for {age:.0f} s"
        return holder, None

    def _refusal(self, holder):
        who = "another run"
        if holder and not holder.get("fields") and holder.get("identity"):
            who = "an unknown holder (its content is not a lock this code writes)"
        if holder and holder.get("fields"):
            job = f", Slurm job {holder['job']}" if holder.get("job") else ""
            who = f"pid {holder.get('pid')} on {holder.get('host')}{job}"
        return (f"--checkpoint-dir {os.path.dirname(self.path)} is in use by {who} (its lock: {self.path}). "
                f"Two runs writing one directory would mix and rotate away each other's checkpoints: wait for "
                f"that run to end, or give this one another --checkpoint-dir. If that run is dead, its lock is "
                f"taken over after {STALE_S} s without a heartbeat (or delete the file).")

    def _being_taken_over(self, why):
        """The message when a stale lock cannot be taken over because .lock.takeover exists (a run replacing
        the lock right now, or whatever someone put there: a FIFO, a link; one older than 60 s is removed)."""
        guard = os.path.join(os.path.dirname(self.path), TAKEOVER)
        return (f"--checkpoint-dir {os.path.dirname(self.path)}: its lock {self.path} is stale ({why}), and {guard} "
                f"says another run is taking it over right now. Wait a minute and run again; if no other run is "
                f"starting on this directory, remove {guard} (rm {guard}).")

    def _mine(self):
        try:
            return self._inspect()[0] == self.me
        except OSError:
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
        if self._marker is not None:
            os.close(self._marker)
            self._marker = None


def _remove_own(path):
    """Remove this user's stale lock file at `path` (a link itself, never what it points to)."""
    try:
        os.unlink(path)
        print(f"warning: removed {path}: a stale lock of this user's", file=sys.stderr, flush=True)
    except OSError:
        pass


def read_lock(path):
    """The fields of the lock file at `path` (lock_fields), read as any small untrusted file (untrusted.read_small: a
    regular file of this user's, no link followed, no FIFO blocking, at most LOCK_MAX_BYTES), or None for anything
    else. The stop command's one way to read a lock."""
    try:
        return lock_fields(read_small(path, LOCK_MAX_BYTES))
    except OSError:
        return None


def lock_fields(data):
    """The fields of a lock this code writes, read from its bytes, or None: not JSON, not a dict, or a field of
    the wrong type or out of range (a pid beyond PID_MAX would overflow os.kill). The lock file's one schema, for
    the run taking the lock and the stop command (accelrun/stop.py) alike."""
    try:
        fields = json.loads(data) if len(data) <= LOCK_MAX_BYTES else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(fields, dict):
        return None
    pid, host, job, restart = (fields.get(k) for k in ("pid", "host", "job", "restart"))
    ok = (type(pid) is int and 1 <= pid <= PID_MAX and isinstance(host, str) and 0 < len(host) <= 255
          and (job is None or (isinstance(job, str) and len(job) <= 64))
          and (restart is None or (type(restart) is int and 0 <= restart < 1 << 31)))
    return fields if ok else None


def alive(pid):
    """Whether process `pid` runs on this host: one that does not exist does not, nor does a zombie (it has ended and
    its parent has not reaped it yet: a run killed under a launcher that lives on); another user's does. The one
    answer for the lock's holder and for the stop command (accelrun/stop.py)."""
    if not whole(pid, 1, PID_MAX):  # os.kill(0) or (-1) would ask about process groups, a huge pid overflow
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    return process_state(pid) != "Z"
