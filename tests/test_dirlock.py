"""The directory lock (recipes/runkit/dirlock.py) without a launch: one writer per --checkpoint-dir, a
live holder named, a dead holder's lock taken over, a requeued Slurm job taking over its own earlier run.

The launches that prove the same end to end (a second run refused; a dead holder's lock taken over) are
in test_stop_and_crash.py.
"""

import json
import os
import subprocess
import sys

from launching import REPO

sys.path.insert(0, str(REPO / "recipes"))
from runkit import dirlock  # noqa: E402


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
