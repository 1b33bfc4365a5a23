"""Saving a checkpoint: written by every rank, verified, and published by one atomic rename.

Owns the save (docs/checkpoints.md, "How a checkpoint is written"): every rank calls it, as accelerate's save_state
is collective under DeepSpeed and FSDP (each rank writes its own shards). The main process makes a new directory
.tmp-step-N.XXXXXXXX (mode 0700, a name no one can plant beforehand), takes its identity and writes the marker of a
save in progress into it through a descriptor (private_directory); every rank writes its part and its done marker,
then hashes its share of the files (files.my_share; xxh3_128, the files at once, from the page cache) and flushes
them to disk; the main process gathers the tables, checks every done marker (a missing one: the directory is not
shared between nodes), writes the manifest last, removes the marker of a save in progress and renames the directory
to step-N, the moment the checkpoint becomes visible, but only if the .tmp directory is still the one it made
(before the manifest, the marker and the rename: in a directory trust.py accepts no one else can rename it, but a
writer trusted with ACCELRUN_TRUST_SHARED_DIRS=1 could swap it for a link). A kill at any moment leaves the earlier
checkpoints and at most a .tmp directory with the marker, which the next run removes (lock.clear_unfinished); a save
that fails removes its .tmp directory and leaves the earlier checkpoints untouched. Where another user's entry holds
step-N (a shared directory with the sticky bit), the save is published as step-N.XXXXXXXX (owners.py).
"""

import os
import secrets
import shutil
import stat
import sys
import tempfile
import time

from accelerate.utils import gather_object
from torch.distributed.checkpoint.api import CheckpointException  # FSDP's sharded saves raise it

from ..collectives import main_process_result
from .files import file_table, fsync, in_parallel, listing, my_share, remove_entry
from .layout import SAVING, done_marker, step_name, tmp_prefix
from .manifest import write_manifest
from .owners import theirs
from .resharding import save_rank_buffers


def identity(path):
    """(device, inode) of the directory at `path` itself (not followed), or None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _opened(path):
    """A descriptor of the directory at `path` itself: a link there is refused (ELOOP/ENOTDIR), never followed."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def private_directory(directory, name):
    """Main process: a new directory .tmp-<name>.XXXXXXXX in `directory` (mode 0700: only this user reaches into
    it), and its (device, inode), taken through a descriptor: what mkdtemp made must still be a directory of this
    user's, of mode 0700 and empty, when it is opened (a link swapped in is refused, never followed: its identity
    was None, and None == None passed every later check). The marker of a save in progress (layout.SAVING) is
    written into it through that descriptor, first, so that the next run knows a crash's leftover from a
    checkpoint renamed to look like one (lock.clear_unfinished). Raises OSError."""
    tmp = tempfile.mkdtemp(prefix=tmp_prefix(name), dir=directory)
    try:
        fd = _opened(tmp)
    except OSError as exc:
        raise OSError(f"{tmp} was replaced as soon as it was made ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077 or os.listdir(fd):
            raise OSError(f"{tmp} was replaced as soon as it was made (by a directory that is not the new, empty "
                          f"one of this user's)")
        os.close(os.open(SAVING, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd))
    finally:
        os.close(fd)
    return tmp, (st.st_dev, st.st_ino)


def unmark(tmp, made):
    """Main process, just before publishing: remove the marker of a save in progress from `tmp`, through a
    descriptor of the directory whose identity is `made` (RuntimeError, as _still_ours, when it is another)."""
    fd = _opened(tmp)
    try:
        st = os.fstat(fd)
        if made is None or (st.st_dev, st.st_ino) != made:
            raise RuntimeError(f"{tmp} was replaced while this run wrote into it; nothing was published")
        os.unlink(SAVING, dir_fd=fd)
    finally:
        os.close(fd)


class Saver:
    def __init__(self, scope, lock, model, save_kwargs):
        """scope: the run's (checkpointer.Scope); lock: lock_directory()'s (main process; None elsewhere);
        model: the prepared model, whose per-rank buffers FSDP needs kept; save_kwargs: save_state's (the
        frozen-weights rule, formats.FrozenRule)."""
        self.scope, self.lock, self.model, self.save_kwargs = scope, lock, model, save_kwargs

    def save(self, step, manifest):
        """Collective: write step-NNNNNNNN with `manifest` (all but its file table), verify and publish it. Returns
        (its path, where its time went: {write, checksums, flush, publish} in seconds, the checksums and the flush
        the slowest rank's) on every rank."""
        acc = self.scope.accelerator
        name = step_name(step)
        final = os.path.join(self.scope.directory, name)
        main_process_result(acc, (None, self.lock.lost() if self.lock else None))  # another run took the directory over
        started = time.perf_counter()
        tmp, made = self._fresh_tmp(name, final)
        self._write_state(tmp, final)
        written = time.perf_counter()
        tables, seen = self._hash_shares(tmp)
        gathered = time.perf_counter()
        final = self._publish(tmp, final, made, (tables, seen), manifest)
        took = [t for _, _, t in tables]
        return final, {"write": written - started, "checksums": max(t[0] for t in took),
                       "flush": max(t[1] for t in took), "publish": time.perf_counter() - gathered}

    def _fresh_tmp(self, name, final):
        """Collective: the main process makes a new directory .tmp-step-N.XXXXXXXX (mode 0700, a name no one can
        plant beforehand); returns (its path, its identity there: None on the other ranks) on every rank."""
        acc, directory = self.scope.accelerator, self.scope.directory
        made, error, tmp = None, None, None
        if acc.is_main_process:
            try:
                tmp, made = private_directory(directory, name)
            except OSError as exc:
                error = f"saving checkpoint {final} failed: cannot create a directory in {directory} ({exc}); " \
                        f"the earlier checkpoints are untouched"
        return main_process_result(acc, (tmp, error)), made

    def _write_state(self, tmp, final):
        """Collective: every rank writes its part (accelerate's save_state, FSDP's per-rank buffers) and its
        done marker. A rank that cannot exits 2, which makes the launcher stop the others."""
        acc = self.scope.accelerator
        try:
            acc.save_state(tmp, **self.save_kwargs)
            save_rank_buffers(acc, self.model, tmp)
            open(os.path.join(tmp, done_marker(acc.process_index)), "w").close()
        except (OSError, RuntimeError, CheckpointException) as exc:  # a full disk (torch.save: RuntimeError)
            free = shutil.disk_usage(tmp).free / 1e6 if os.path.isdir(tmp) else float("nan")
            print(f"error: saving checkpoint {final} failed on rank {acc.process_index} ({type(exc).__name__}: "
                  f"{(str(exc).splitlines() or [''])[0][:200]}; {free:.1f} MB left on its file system); the earlier "
                  f"checkpoints are untouched. Free space and run the same command again to resume from the newest "
                  f"of them.", file=sys.stderr, flush=True)
            sys.exit(2)
        acc.wait_for_everyone()

    def _hash_shares(self, tmp):
        """Collective: every rank hashes its share, the files it wrote and its turn of the others, from the page
        cache the write has just filled (the files of the share at once: files.file_table), then flushes them to
        disk (at once too: the disk takes the writes in parallel). Returns (every rank's (table, problem, (seconds
        hashing, seconds flushing))), the files this rank saw)."""
        acc = self.scope.accelerator
        table, error, seen, took = {}, None, [], (0.0, 0.0)
        try:
            seen = listing(tmp)
            mine = my_share(seen, acc.process_index, acc.num_processes)
            began = time.perf_counter()
            table = file_table(tmp, mine)
            hashed = time.perf_counter()
            in_parallel(lambda rel: fsync(os.path.join(tmp, rel)), mine)
            took = (hashed - began, time.perf_counter() - hashed)
        except OSError as exc:  # RefusedFile too: a link or FIFO where this save wrote a file
            error = f"rank {acc.process_index}: {exc}"
        mine = (table, error, took)
        return (gather_object([mine]) if acc.num_processes > 1 else [mine]), seen

    def _publish(self, tmp, final, made, shares, manifest):
        """Collective: the main process completes the manifest with every file's size and checksum, writes it
        last and renames `tmp` to `final` (or to a name of its own where another user holds `final`), the moment
        the checkpoint becomes visible; returns the checkpoint's path on every rank. On an error every rank fails,
        and the earlier checkpoints are untouched."""
        error = None
        if self.scope.accelerator.is_main_process:
            try:
                files = self._file_table(tmp, *shares)
                self._still_ours(tmp, made, final)
                write_manifest(tmp, {**manifest, "files": files})
                final = self._free_name(final)
                self._still_ours(tmp, made, final)
                unmark(tmp, made)
                os.replace(tmp, final)  # the moment the checkpoint becomes visible
                fsync(self.scope.directory)
            except OSError as exc:
                error = f"saving checkpoint {final} failed ({exc}); the earlier checkpoints are untouched"
                if identity(tmp) == made:
                    shutil.rmtree(tmp, ignore_errors=True)  # a full disk: give back what this save took
            except RuntimeError as exc:
                error = str(exc)
        return main_process_result(self.scope.accelerator, (final, error))

    def _free_name(self, final):
        """Main process: where to publish: `final`, after removing what this user has there (an older save of this
        very step, or a planted link); or, where another user's entry holds that name (a shared directory with the
        sticky bit: it cannot be removed), `final` with a suffix of its own, saying so once."""
        try:
            st = os.lstat(final)
        except FileNotFoundError:
            return final
        if not theirs(st):
            remove_entry(final)
            return final
        other = f"{final}.{secrets.token_hex(4)}"
        self.scope.passed.add(final, f"it {theirs(st)}; this save is published as {other}")
        return other

    def _file_table(self, tmp, tables, seen):
        """Main process: {rel: {size, xxh3_128}} of every file of the save, from the ranks' tables; refuses a
        save whose ranks wrote where the main process cannot see."""
        missing = [r for r in range(self.scope.accelerator.num_processes)
                   if not os.path.exists(os.path.join(tmp, done_marker(r)))]
        if missing:
            raise RuntimeError(f"ranks {missing} wrote their part of the checkpoint somewhere the main "
                               f"process cannot see: --checkpoint-dir {self.scope.directory!r} must be on "
                               f"storage shared by every node")
        files = {}
        for part, problem, _ in tables:
            if problem:
                raise OSError(problem)
            files.update(part)
        unhashed = sorted(set(seen) - set(files))  # seen only by this rank (none on shared storage)
        files.update(file_table(tmp, unhashed))
        return files

    def _still_ours(self, tmp, made, final):
        """Main process: refuse to publish when `tmp` is no longer the directory this save created (someone
        replaced it, e.g. by a link, while the ranks wrote into it)."""
        if made is None or identity(tmp) != made:
            raise RuntimeError(f"saving checkpoint {final} failed: {tmp} was replaced while this run wrote into it "
                               f"(someone else writes into {self.scope.directory}); nothing was published. Use a "
                               f"--checkpoint-dir only you can write to (chmod go-w), and check the files there")
