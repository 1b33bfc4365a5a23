"""The directory lock (src/accelrun/checkpoint/lock.py) without a launch: one writer per --checkpoint-dir, a
live holder named, a dead holder's lock taken over (a zombie's too), a requeued Slurm job taking over its own earlier
run; a lock that is garbage, out of range, a link or a FIFO; a directory others can write refused; the lock and its
names importing without torch. And the directory trusted by its owner (accelrun/trust.py, issue 52): a shared sticky
directory of another user's refused by the lock, choosing, rotation and the stop command before anything is removed
(its owner renamed the victim's checkpoints to .tmp- names, which the requeue deleted); a leftover .tmp-step-* removed
only when it carries the marker of a save in progress; a save's directory swapped for a link refused; planted step-*
names bounded in cost, and filtered by owner before the stop command's bound. "Another user" is a uid this system
does not know, made the owner as root (the suite runs as root).

The launches that prove the same end to end (a second run refused; a dead holder's lock taken over) are
in test_stop_and_crash.py.
"""

import json
import os
import pwd
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from accelrun import stop, trust
from accelrun.checkpoint import lock as dirlock
from accelrun.checkpoint import owners, save
from accelrun.checkpoint.choose import distrust
from accelrun.checkpoint.layout import FORMAT_VERSION, SAVING
from accelrun.checkpoint.rotate import Rotation
from launching import REPO, skip_unless_ci, unknown_uid


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


# ---- a directory trusted by its owner (issue 52) ----------------------------------------------------------------

def needs_root():
    if os.geteuid() != 0:
        skip_unless_ci("needs root, to make a directory another user's")


def theirs_sticky(path):
    """`path` made a shared scratch directory (mode 1777) that another user created: its owner is them."""
    path.mkdir(exist_ok=True)
    os.chown(path, unknown_uid(), unknown_uid())
    path.chmod(0o1777)
    return path


def stopped_state(step):
    """The train_state Run saves for a stop at `step` (train_state.TRAIN_STATE's fields)."""
    return {"step": step, "total_steps": 10, "epoch": 0, "step_in_epoch": step, "epochs_run": 0, "first_loss": 2.5,
            "final_loss": None, "last_eval": None, "train_time": 1.0, "window": None, "output_dir": "out",
            "run_id": "0f" * 16, "stopped": True}


def checkpoint_like(path, step):
    """A directory of this user's holding a checkpoint.json of step `step` that records a stopped run (what the stop
    command reads of it: the format version, the step, the layout's world size and the train_state)."""
    path.mkdir(mode=0o700)
    (path / "checkpoint.json").write_text(json.dumps({"format_version": FORMAT_VERSION, "step": step,
                                                      "layout": {"world_size": 1}, "train_state": stopped_state(step)}))
    return path


def test_a_sticky_directory_of_another_user_is_refused_before_anything_is_removed(tmp_path, monkeypatch, capsys):
    """Attacks 1(a), (c), (d): another user created the shared 1777 --checkpoint-dir; they renamed the victim's step 4
    to a .tmp-step- name (and its newest away, and could swap a save in progress for a link). The lock refuses it in
    one line naming the owner and the opt-in, before anything is made or removed (the requeue deleted both renamed
    checkpoints and trained from step 0); choosing, rotation and the stop command refuse it too. With
    ACCELRUN_TRUST_SHARED_DIRS=1 it is accepted, and still nothing of this user's goes on its name alone: the renamed
    checkpoint is left alone with a warning, and only a leftover carrying the marker of a save in progress goes."""
    needs_root()
    shared = theirs_sticky(tmp_path / "scratch")
    checkpoint_like(shared / "step-00000002", 2)
    renamed = checkpoint_like(shared / ".tmp-step-00000004.aaaaaaaa", 4)
    before = sorted(os.listdir(shared))
    lock, error = dirlock.take(str(shared))
    assert lock is None and f"--checkpoint-dir {shared}: it is owned by uid {unknown_uid()} (mode 1777)" in error
    assert trust.TRUST_ENV in error and "\n" not in error
    assert sorted(os.listdir(shared)) == before and not (shared / ".lock").exists()
    assert "owned by uid" in distrust(str(shared), "auto")
    Rotation(SimpleNamespace(directory=str(shared), passed=owners.Passed()), 2).rotate(6, str(shared / "x"))
    assert sorted(os.listdir(shared)) == before and "nothing rotated" in capsys.readouterr().err
    assert stop.stop_run([str(shared), "--wait", "0"]) == 2
    assert f"accelrun.stop: error: the checkpoint directory {shared}: it is owned by uid" in capsys.readouterr().err

    monkeypatch.setenv(trust.TRUST_ENV, "1")  # the user trusts every writer of it: what that risks is documented
    crashed = shared / ".tmp-step-00000006.bbbbbbbb"
    crashed.mkdir(mode=0o700)
    (crashed / SAVING).touch()
    (crashed / "model.safetensors").write_bytes(b"half")
    lock, error = dirlock.take(str(shared))
    assert error is None
    lock.release()
    err = capsys.readouterr().err
    assert f"removing {crashed}: a save that never finished" in err and not crashed.exists()
    assert f"warning: leaving alone {renamed}: it is named like a save in progress but is not one" in err
    assert (renamed / "checkpoint.json").exists() and (shared / "step-00000002").exists()


def test_a_dir_of_mine_in_another_users_directory_is_refused(tmp_path, monkeypatch):
    """Attack 1(b): the docs said `mkdir -m 700 DIR/$USER` in a shared DIR. The owner of DIR renamed DIR/alice away
    and made a 1777 DIR/alice of their own, which the requeue accepted in silence: refused. And DIR/alice of this
    user's is only as safe as DIR, whose owner may rename it: refused too, naming DIR (this user played by a second
    unknown uid, as the suite's user is root, whose directories end the walk)."""
    needs_root()
    shared = theirs_sticky(tmp_path / "scratch")
    alice = theirs_sticky(shared / "alice")
    lock, error = dirlock.take(str(alice))
    assert lock is None and f"--checkpoint-dir {alice}: it is owned by uid {unknown_uid()} (mode 1777)" in error
    assert not (alice / ".lock").exists()
    os.rmdir(alice)
    alice.mkdir(mode=0o700)
    me = next(uid for uid in range(unknown_uid() + 1, 60000) if uid not in {u.pw_uid for u in pwd.getpwall()})
    os.chown(alice, me, me)
    monkeypatch.setattr(trust.os, "geteuid", lambda: me)
    error = trust.refusal(str(alice), "--checkpoint-dir")
    assert f"--checkpoint-dir {alice}: {shared} is owned by uid {unknown_uid()} (mode 1777)" in error, error
    assert f"every writer of {shared} " in error


def test_a_save_directory_swapped_as_soon_as_it_is_made_is_refused(tmp_path, monkeypatch):
    """Attack 1(d), second try: the .tmp directory swapped for a link between mkdtemp and taking its identity. The
    identity of a link was None, and None == None passed every later check: checkpoint.json landed in the link's
    target. Now the directory is opened without following a link, and must be the new, empty one of this user's; a
    save whose identity is unknown is never published; the marker goes only through the directory it was made in."""
    elsewhere = tmp_path / "precious"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("mine")
    made = []

    def swapped(target):
        def mkdtemp(**kwargs):
            path = real(**kwargs)
            os.rename(path, tmp_path / f"moved-{len(made)}")
            if target == elsewhere:
                os.symlink(target, path)  # a link to someone's directory
            else:
                os.rename(target, path)  # a directory of this user's, not empty
            made.append(path)
            return path
        return mkdtemp

    real = save.tempfile.mkdtemp
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(mode=0o700)
    monkeypatch.setattr(save.tempfile, "mkdtemp", swapped(elsewhere))
    with pytest.raises(OSError, match="was replaced as soon as it was made"):
        save.private_directory(str(ckpt), "step-00000002")
    assert os.listdir(elsewhere) == ["notes.txt"]  # no marker written through the link
    mine = checkpoint_like(tmp_path / "step-00000004", 4)  # a directory of this user's, not empty, swapped in
    monkeypatch.setattr(save.tempfile, "mkdtemp", swapped(mine))
    with pytest.raises(OSError, match="not the new, empty one"):
        save.private_directory(str(ckpt), "step-00000004")
    monkeypatch.setattr(save.tempfile, "mkdtemp", real)
    tmp, identity = save.private_directory(str(ckpt), "step-00000006")
    assert os.listdir(tmp) == [SAVING] and identity == save.identity(tmp)
    saver = save.Saver(SimpleNamespace(directory=str(ckpt)), None, None, {})
    with pytest.raises(RuntimeError, match="was replaced while this run wrote into it"):
        saver._still_ours(tmp, None, str(ckpt / "step-00000006"))  # an unknown identity never matches
    os.rename(tmp, tmp_path / "moved")
    os.symlink(elsewhere, tmp)
    with pytest.raises(OSError):
        save.unmark(tmp, identity)
    save.unmark(str(tmp_path / "moved"), identity)
    assert os.listdir(tmp_path / "moved") == []


def test_planted_step_names_cost_one_lookup_per_owner(tmp_path, monkeypatch, capsys):
    """Attack 4: 100,000 planted step-* links cost 23 s per pass of own_steps (four user database lookups per entry,
    at start-up, in choosing and after every save). Here 5,000 of another user's beside one of this user's: one lookup
    per owner in the pass, ten named and the rest counted in one line."""
    needs_root()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(mode=0o700)
    mine = checkpoint_like(ckpt / "step-00000001", 1)
    for step in range(100, 5100):
        os.symlink("/nowhere", ckpt / f"step-{step:08d}")
        os.lchown(ckpt / f"step-{step:08d}", unknown_uid(), unknown_uid())
    lookups = []
    real = trust.pwd.getpwuid
    monkeypatch.setattr(trust.pwd, "getpwuid", lambda uid: lookups.append(uid) or real(uid))
    trust.who.cache_clear()
    passed = owners.Passed()
    started = time.perf_counter()
    assert owners.own_steps(str(ckpt), passed) == [(1, str(mine))]
    passed.close(str(ckpt))
    elapsed = time.perf_counter() - started
    assert sorted(lookups) == sorted({0, unknown_uid()}), lookups
    err = capsys.readouterr().err
    assert err.count(f"belongs to uid {unknown_uid()}") == owners.SHOWN and f"4990 more entries in {ckpt}" in err
    print(f"own_steps over 5,001 entries: {elapsed * 1000:.0f} ms")


def test_the_stop_command_filters_by_owner_before_its_bound(tmp_path, capsys):
    """Attack 7: with 1,000 planted step-* names newer than the run's own, the stop command looked only at those and
    reported "ended without saving a checkpoint ... none", exit 1, while the run had saved step-00000003 and exited
    75. This user's entries are picked out first: it finds step 3, saved for the stop."""
    needs_root()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(mode=0o700)
    saved = checkpoint_like(ckpt / "step-00000003", 3)
    for step in range(1000, 1000 + owners.INSPECTED):
        os.symlink("/nowhere", ckpt / f"step-{step:08d}")
        os.lchown(ckpt / f"step-{step:08d}", unknown_uid(), unknown_uid())
    assert stop._newest_state(str(ckpt)) == (str(saved), stopped_state(3))
    assert stop._outcome(str(ckpt), 1, None, str(tmp_path), time.time()) == 75
    assert f"stopped after step 3: checkpoint {saved}" in capsys.readouterr().out


def test_the_stop_command_reads_the_lock_and_the_manifest_by_the_runs_own_rules(tmp_path):
    """Issue 54, item 3: the stop command read the lock and the manifest by rules of its own (a pid beyond PID_MAX, an
    empty host name, a manifest of another format version or with a train_state no run writes were taken). It reads
    them through the lock file's schema (lock.read_lock) and the manifest's reader (train_state.training_state)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(mode=0o700)
    for fields in ({"host": socket.gethostname(), "pid": dirlock.PID_MAX + 1}, {"host": "", "pid": os.getpid()},
                   {"host": socket.gethostname(), "pid": os.getpid(), "job": 7}):
        (ckpt / ".lock").write_text(json.dumps(fields))
        assert dirlock.read_lock(str(ckpt / ".lock")) is None and stop._own_locks(str(ckpt)) == [], fields
        assert stop._holder_pid(str(ckpt))[1].startswith(f"no run holds {ckpt}"), fields
    saved = checkpoint_like(ckpt / "step-00000003", 3)
    assert stop._newest_state(str(ckpt)) == (str(saved), stopped_state(3))
    for changed in ({"format_version": FORMAT_VERSION + 1}, {"train_state": {"step": 3, "stopped": True}},
                    {"train_state": {**stopped_state(3), "step": "3"}}):
        manifest = json.loads((saved / "checkpoint.json").read_text())
        (saved / "checkpoint.json").write_text(json.dumps({**manifest, **changed}))
        assert stop._newest_state(str(ckpt)) == (None, {}), changed
        (saved / "checkpoint.json").write_text(json.dumps(manifest))
