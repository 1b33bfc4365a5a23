"""A checkpoint read only through what was verified (docs/checkpoints.md, "Others who can write into
--checkpoint-dir").

Owns HeldCheckpoint: every rank opens each file its manifest lists once, walking the checkpoint without following a
link (files.open_in), holds the descriptors, hashes and parses its share through them (the checksum its manifest
recorded, the files of the share hashed in parallel, each read once; and that each pickle loads as weights only:
safe_loading.py's rules, parsed with the tensors memory-mapped, not read), and loads through a private directory of
links to those descriptors (view): the load reads the verified files through them once more, from the page cache
the verification has just filled, and whatever replaces a file at its path afterwards is never read (replaced()
names it). The ranks compare what they hold (collectives.checked_by_every_rank).
"""

import os
import shutil
import tempfile

from .files import allow_open_files, entry_identity, in_parallel, matches, my_share, open_in
from .owners import theirs
from .safe_loading import (
    UnsafeCheckpointFile,
    file_format,
    numpy_problem,
    safe_metadata_load,
    storage_problem,
    torch_file_problem,
    weights_only_loading,
)
from .untrusted import RefusedFile


class HeldCheckpoint:
    """A checkpoint's listed files, each opened once and held while it is verified and loaded. Every rank holds
    every file; each hashes and parses its share (share_problems) through the descriptors it holds, and loads
    through view(), a private directory of links to them. Close it (or use `with`) when the load is over."""

    def __init__(self, path, files, follow=True):
        """files: the manifest's table ({rel: {size, <checksum>}}); follow: whether `path` itself may be a link (a path
        the user gave), or must be the directory (a step-* entry found in --checkpoint-dir)."""
        self.path, self.files, self.follow = path, files, follow
        self.held, self.root, self._view = {}, None, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def hold(self):
        """Open the checkpoint and every listed file (RefusedFile: not a directory, or a link, FIFO, missing file or
        wrong size)."""
        if self.root is None:
            try:
                self.root = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | (0 if self.follow else os.O_NOFOLLOW))
            except OSError as exc:
                raise RefusedFile(f"it cannot be opened as a directory ({exc.strerror})") from None
            if theirs(os.fstat(self.root)):
                raise RefusedFile(f"it {theirs(os.fstat(self.root))}")
        allow_open_files(len(self.files))
        for rel in sorted(self.files):
            self.held[rel] = open_in(self.root, rel, self.files[rel]["size"])

    def fd_path(self, rel):
        """A path that reads the held file itself, whatever is at `rel` now."""
        return f"/proc/{os.getpid()}/fd/{self.held[rel].fileno()}"

    def identities(self):
        """{rel: (inode, size, mtime)} of the held files: the same on every rank of a shared file system."""
        found = {}
        for rel, f in self.held.items():
            st = os.fstat(f.fileno())
            found[rel] = (st.st_ino, st.st_size, st.st_mtime_ns)
        return found

    def share_problems(self, rank, world):
        """(damage, unsafe) of this rank's share: damage, the first file that is not what was saved (or cannot be
        held); unsafe, the first that cannot be loaded without running code or reaches outside the table."""
        try:
            if not self.held:
                self.hold()
            mine = my_share(list(self.files), rank, world)
            # Every file of the share hashed at once, each read once through its held descriptor; the first that
            # differs, in the share's order, is the one named (as a loop over them would name it).
            verdicts = in_parallel(lambda rel: matches(self.held[rel].fileno(), self.files[rel]), mine)
            bad = next((rel for rel, ok in zip(mine, verdicts) if not ok), None)
            if bad:
                return f"{bad} does not match its recorded size and checksum (truncated or overwritten)", None
            return None, self.loadable(mine)
        except RefusedFile as exc:
            return str(exc), None
        except OSError as exc:
            return f"it cannot be read ({exc})", None

    def loadable(self, rels):
        """None, or why one of `rels` cannot be read without running code or beyond what the manifest lists: the
        pickles are parsed here, with the tensors memory-mapped rather than read, so that every rank can refuse
        before any rank loads."""
        with weights_only_loading():
            for rel in rels:
                try:
                    problem = self._content_problem(rel)
                except UnsafeCheckpointFile as exc:
                    problem = str(exc).replace(self.fd_path(rel), rel)
                except Exception as exc:  # noqa: BLE001 - any unreadable file is a refused checkpoint
                    problem = f"{rel} cannot be read ({type(exc).__name__}: {str(exc)[:200]})"
                if problem:
                    return problem
        return None

    def _content_problem(self, rel):
        kind, f = file_format(rel), self.held[rel]
        if kind == "metadata":
            f.seek(0)
            return storage_problem(rel, safe_metadata_load(f, name=rel), self.files,
                                   {r: h.fileno() for r, h in self.held.items()})
        if kind != "torch":
            return None
        problem = torch_file_problem(rel, f.fileno())
        if problem:
            return problem
        import torch
        try:
            loaded = torch.load(self.fd_path(rel), map_location="cpu", mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            loaded = torch.load(self.fd_path(rel), map_location="cpu")  # a file in torch's legacy format
        return numpy_problem(rel, loaded)

    def view(self):
        """A private directory (mode 0700, made by this process) mirroring the checkpoint, each file a link to the
        descriptor held for it: accelerate, DeepSpeed and torch.distributed.checkpoint load from it by path and read
        exactly the verified files."""
        if self._view is None:
            self._view = tempfile.mkdtemp(prefix="accelrun-checkpoint-")
            for rel in self.held:
                link = os.path.join(self._view, rel)
                os.makedirs(os.path.dirname(link), mode=0o700, exist_ok=True)
                os.symlink(self.fd_path(rel), link)
        return self._view

    def replaced(self):
        """The held files whose path no longer leads to them (replaced, removed or linked away since)."""
        gone = []
        for rel, f in sorted(self.held.items()):
            st = os.fstat(f.fileno())
            if entry_identity(self.root, rel) != (st.st_dev, st.st_ino):
                gone.append(rel)
        return gone

    def close(self):
        for f in self.held.values():
            f.close()
        self.held = {}
        if self._view:
            shutil.rmtree(self._view, ignore_errors=True)
            self._view = None
        if self.root is not None:
            os.close(self.root)
            self.root = None
