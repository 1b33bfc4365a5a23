"""The directory lock (src/accelrun/checkpoint/lock.py) without a launch: one writer per --checkpoint-dir, a
live holder named, a dead holder's lock taken over (a zombie's too), a requeued Slurm job taking over its own earlier
run; a lock that is garbage, out of range, a link or a FIFO; a directory others can write refused; the lock and its
names importing without torch.

The launches that prove the same end to end (a second run refused; a dead holder's lock taken over) are
in test_stop_and_crash.py.
"""

import json
import os
import socket
import subprocess
import sys

from accelrun.checkpoint import lock as dirlock
from launching import REPO


def test_directory_lock(tmp_path, capsys):
    first = dirlock.DirectoryLock(tmp_path)
    assert first.acquire() is None
    second = dirlock.DirectoryLock(tmp_path)  # this process is alive: refused, naming it
    assert f"is in use by pid {os.getpid()} on " in second.acquire()
    # Taken over while the holder was suspended: the holder learns it at its next save, and leaves it alone.
    record = json.loads((tmp_path / ".lock").read_text())
    (tmp_path / ".lock").write_text(json.dumps({**record, "pid": 1, "since": 0}))
    assert "another run took over" in first.lost()
    first.release()
    assert (tmp_path / ".lock").exists()

    # A dead holder on this host: taken over at once, with a warning.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / ".lock").write_text(json.dumps({**record, "pid": int(dead.stdout)}))
    third = dirlock.DirectoryLock(tmp_path)
    assert third.acquire() is None and third.lost() is None
    assert f"taking over {tmp_path / '.lock'}: its holder, pid {int(dead.stdout)} on this host, is gone" in \
        capsys.readouterr().err
    third.release()
    assert not (tmp_path / ".lock").exists()


def test_requeued_job_takes_over_its_earlier_run(tmp_path, monkeypatch):
    (tmp_path / ".lock").write_text(json.dumps({"host": "another-node", "pid": 4242, "job": "77", "restart": 0}))
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    assert "Slurm job 77" in dirlock.DirectoryLock(tmp_path).acquire()  # another job, alive as far as we know
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    requeued = dirlock.DirectoryLock(tmp_path)
    assert requeued.acquire() is None
    requeued.release()


def test_a_lock_that_is_not_one_is_a_message_or_a_takeover(tmp_path, capsys):
    lock = tmp_path / ".lock"
    # Garbage, a pid past any pid_max, wrong types: an unknown holder, refused while fresh, taken over once stale.
    for content in ("not json {", json.dumps({"host": "x", "pid": 2 ** 70}), json.dumps([1, 2]),
                    json.dumps({"host": 5, "pid": "1"})):
        lock.write_text(content)
        assert "in use by an unknown holder" in dirlock.DirectoryLock(tmp_path).acquire()
        os.utime(lock, (0, 0))
        taker = dirlock.DirectoryLock(tmp_path)
        assert taker.acquire() is None
        assert "its content is not a lock this code writes (an unknown holder)" in capsys.readouterr().err
        taker.release()
    # A dangling link: unlinked (never followed) and taken over at once.
    os.symlink(tmp_path / "nowhere", lock)
    taker = dirlock.DirectoryLock(tmp_path)
    assert taker.acquire() is None and "it is a symbolic link" in capsys.readouterr().err
    taker.release()
    assert not (tmp_path / "nowhere").exists()
    # A stale lock, and a FIFO at .lock.takeover (fresh; an old one is removed): the message names the FIFO.
    lock.write_text("not json {")
    os.utime(lock, (0, 0))
    os.mkfifo(tmp_path / ".lock.takeover")
    refused = dirlock.DirectoryLock(tmp_path).acquire()
    assert f"{tmp_path / '.lock.takeover'} says another run is taking it over" in refused
    assert f"rm {tmp_path / '.lock.takeover'}" in refused and lock.exists()
    os.unlink(tmp_path / ".lock.takeover")
    lock.unlink()
    # A FIFO: one message naming it, no blocking open.
    os.mkfifo(lock)
    assert f"{lock} is not a lock file this code writes (a FIFO" in dirlock.DirectoryLock(tmp_path).acquire()


def test_a_directory_others_can_write_is_refused_unless_sticky(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    lock, error = dirlock.take(str(shared))
    assert lock is None and f"chmod go-w {shared}" in error and "chmod +t" in error
    assert not (shared / ".lock").exists()
    shared.chmod(0o1777)
    lock, error = dirlock.take(str(shared))
    assert error is None
    lock.release()
    lock, error = dirlock.take(str(tmp_path / "new"))  # created for the run: only its user writes there
    assert error is None and (tmp_path / "new").stat().st_mode & 0o077 == 0
    lock.release()


def test_a_zombie_holds_no_lock(tmp_path, capsys):
    """One answer to "is the holder alive" (lock.alive), for the lock and the stop command: a process that has exited
    and is not reaped yet (a zombie: a run killed while its parent lives on) is not, though os.kill(pid, 0) still
    finds it. Its lock is taken over at once, as a dead holder's is (it was counted alive, and the run refused)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it has exited, and stays unreaped
        os.kill(child.pid, 0)  # no ProcessLookupError: to kill() it is still there
        assert not dirlock.alive(child.pid)
        (tmp_path / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": child.pid, "job": None}))
        taker = dirlock.DirectoryLock(tmp_path)
        assert taker.acquire() is None
        assert f"its holder, pid {child.pid} on this host, is gone" in capsys.readouterr().err
        taker.release()
    finally:
        child.wait()
    assert dirlock.alive(os.getpid())
    assert not any(dirlock.alive(pid) for pid in (0, -1, True, dirlock.PID_MAX + 1, 2 ** 70))  # never a group


def test_the_lock_and_its_names_import_without_torch():
    """layout, owners, untrusted and lock are the standard library only: the stop command (accelrun/stop.py) runs
    without torch or accelerate."""
    probe = ("import sys; sys.path.insert(0, 'src')\n"
             "import accelrun.checkpoint.layout, accelrun.checkpoint.owners, accelrun.checkpoint.untrusted\n"
             "import accelrun.checkpoint.lock, accelrun.stop\n"
             "assert not {'torch', 'accelerate', 'numpy'} & set(sys.modules), sorted(sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
