"""A checkpoint's files on disk, reached without following a link: opened, hashed, listed, synced and removed.

Owns (docs/checkpoints.md, "What a checkpoint can and cannot do"):
* opening a file inside a checkpoint by walking it from the checkpoint's directory, every component a real
  directory and the file itself regular (open_in; untrusted.py opens the file), and telling what is at a path now
  (entry_identity);
* the checksums a manifest records (CHECKSUMS: xxh3_128 in the saves of format 3, sha256 in the checkpoints of
  formats 1 and 2, each verified by its own: recorded, matches), their table (file_table), files hashed in
  parallel (in_parallel), and which rank hashes which file: a file whose name carries a rank (DeepSpeed's
  zero_pp_rank_N, torch.distributed.checkpoint's __N_0.distcp, accelerate's random_states_N) is hashed by that rank,
  which wrote it and reads it back; the others are dealt out in turn (my_share);
* what a checkpoint holds on disk against what its manifest lists (entries, listing, coverage), each entry seen
  with lstat, a link listed and never followed, a planted tree walked no further than the manifest makes sense of;
* removing an entry as itself, never through a link (remove_entry), and fsync.
Standard library and xxhash.
"""

import errno
import hashlib
import os
import re
import resource
import shutil
import stat
from concurrent.futures import ThreadPoolExecutor

import xxhash

from .layout import DERIVED, DERIVING, MANIFEST, SAVING
from .untrusted import RefusedFile, kind, open_regular

# A rank number in a file name: DeepSpeed, torch.distributed.checkpoint, accelerate, ours.
_RANK_IN_NAME = re.compile(r"(?:zero_pp_rank_|^__|random_states_|^rank-)(\d+)")


def owner(rel, world):
    """The rank that hashes `rel` (a path inside the checkpoint), or None: dealt out in turn."""
    m = _RANK_IN_NAME.search(os.path.basename(rel))
    return int(m.group(1)) % world if m else None


def my_share(rels, rank, world):
    """The files of `rels` that `rank` hashes: the ones named for it, and every world-th of the rest."""
    shared = sorted(r for r in rels if owner(r, world) is None)
    return sorted(r for r in rels if owner(r, world) == rank) + shared[rank::world]


# ---- opening a file without following a link ----------------------------------------------------------------

def _walk_to(root_fd, rel):
    """(descriptor of rel's directory under root_fd, opened without following a link, or root_fd; its last name)."""
    *folders, last = rel.split("/")
    fd = root_fd
    try:
        for folder in folders:
            try:
                nxt = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise RefusedFile(f"{rel}: {folder} is not a directory a save writes (a link or a file)") from None
                if isinstance(exc, FileNotFoundError):
                    raise RefusedFile(f"{rel} is missing") from None
                raise
            if fd != root_fd:
                os.close(fd)
            fd = nxt
    except BaseException:
        if fd != root_fd:
            os.close(fd)
        raise
    return fd, last


def open_in(root_fd, rel, size=None):
    """The file `rel` under the directory open at root_fd, every component a real directory (no link followed) and
    the file itself regular, of `size` bytes when given; else RefusedFile naming rel."""
    fd, last = _walk_to(root_fd, rel)
    try:
        return open_regular(last, size, rel, dir_fd=fd)
    finally:
        if fd != root_fd:
            os.close(fd)


def entry_identity(root_fd, rel):
    """(device, inode) of whatever is at `rel` under root_fd now (a link itself, not followed), or None."""
    try:
        fd, last = _walk_to(root_fd, rel)
    except OSError:
        return None
    try:
        st = os.stat(last, dir_fd=fd, follow_symlinks=False)
        return st.st_dev, st.st_ino
    except OSError:
        return None
    finally:
        if fd != root_fd:
            os.close(fd)


def allow_open_files(count):
    """Let this process hold `count` more descriptors (a universal checkpoint holds four files per parameter)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = count + 1024  # what the process holds besides: libraries, sockets, DataLoader pipes
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(hard, need), hard))
    if hard != resource.RLIM_INFINITY and hard < need:
        raise RefusedFile(f"it holds {count} files, more than this process may open (ulimit -n {hard}); raise "
                          f"the limit and run again")


# ---- checksums -----------------------------------------------------------------------------------------------

# The checksums a manifest may record for a file, by the name of its field beside "size": a save writes SAVED
# (format 3 on); a checkpoint of formats 1 and 2 recorded sha256, which still verifies. They protect against torn
# writes and bit rot, not against a forger (docs/checkpoints.md, "Checksums"): xxh3_128 hashes at the speed of
# memory, SHA-256 at 1-2 GB/s a core.
CHECKSUMS = {"xxh3_128": (xxhash.xxh3_128, 32), "sha256": (hashlib.sha256, 64)}  # constructor, hex digits
SAVED = "xxh3_128"
BLOCK = 1 << 23  # 8 MB a read: large enough that hashing releases the GIL, small enough to stay in the cache
WORKERS = 8  # files hashed at once by one process (threads: the hashing and the reads release the GIL)


def recorded(want):
    """(algorithm, hex digest) a manifest entry ({size, <algorithm>}) records, or None when it records no known one."""
    names = [k for k in want if k in CHECKSUMS] if isinstance(want, dict) else []
    if len(names) != 1 or set(want) != {"size", names[0]} or not isinstance(want[names[0]], str):
        return None
    algorithm = names[0]
    return (algorithm, want[algorithm]) if re.fullmatch(f"[0-9a-f]{{{CHECKSUMS[algorithm][1]}}}",
                                                        want[algorithm]) else None


def digest(fd, size, algorithm=SAVED):
    """(bytes read, hex digest by `algorithm`) of the first `size` bytes of the file open at fd, read without moving
    its offset, into one reused buffer (no allocation per block)."""
    checksum, done = CHECKSUMS[algorithm][0](), 0
    buf = memoryview(bytearray(min(BLOCK, max(size, 1))))
    try:
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_SEQUENTIAL)  # a cold read: the kernel reads further ahead
    except OSError:
        pass
    while done < size:
        got = os.preadv(fd, [buf[:min(size - done, len(buf))]], done)
        if not got:
            break
        checksum.update(buf[:got])
        done += got
    return done, checksum.hexdigest()


def matches(fd, want):
    """Whether the file open at fd is what the manifest entry `want` records: its size, and its checksum by the
    entry's own algorithm (sha256 for a checkpoint of formats 1 and 2)."""
    algorithm, hexdigest = recorded(want) or ("sha256", None)
    return hexdigest is not None and os.fstat(fd).st_size == want["size"] and \
        digest(fd, want["size"], algorithm) == (want["size"], hexdigest)


def in_parallel(function, items, workers=WORKERS):
    """[function(item) for item in items], up to `workers` at once in threads (hashing and reading release the
    GIL: the files of one rank's share are hashed on as many cores as there are); an exception is raised as the
    loop would raise it, the first item's first."""
    items = list(items)
    if len(items) < 2 or workers < 2:
        return [function(item) for item in items]
    with ThreadPoolExecutor(min(workers, len(items))) as pool:
        futures = [pool.submit(function, item) for item in items]
        return [f.result() for f in futures]


def checksum(path, size=None, name=None, algorithm=SAVED):
    """(size, hex digest by `algorithm`) of the regular file at `path`, reading at most `size` bytes (its size when
    not given)."""
    with open_regular(path, size, name) as f:
        return digest(f.fileno(), os.fstat(f.fileno()).st_size if size is None else size, algorithm)


def file_table(root, rels):
    """{rel: {size, xxh3_128}} of the given files under root (each a regular file, or RefusedFile), hashed in
    parallel."""
    def entry(rel):
        size, hexdigest = checksum(os.path.join(root, rel), name=rel)
        return rel, {"size": size, SAVED: hexdigest}
    return dict(in_parallel(entry, rels))


# ---- what is on disk, against what the manifest lists --------------------------------------------------------

def listing(root):
    """Every entry of a checkpoint but its manifest and the marker of a save in progress, as paths relative to it (a
    link is listed, never followed)."""
    return [rel for rel, _ in entries(root) if rel not in (MANIFEST, SAVING)]


def entries(root, limit=None, prune=()):
    """Every entry under root, as (path relative to it, its lstat result), directories walked but not listed;
    a link is listed, never followed. limit: stop once more than this many are found (a planted tree of millions of
    entries costs no more than the checkpoint it pretends to be); prune: top-level directories left out."""
    found, folders = [], [""]
    while folders:
        folder = folders.pop()
        with os.scandir(os.path.join(root, folder)) as it:
            for entry in it:
                rel = os.path.join(folder, entry.name)
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    if rel not in prune:
                        folders.append(rel)
                else:
                    found.append((rel, st))
                if limit is not None and len(found) + len(folders) > limit:
                    return sorted(found)
    return sorted(found)


def coverage(root, files):
    """None, or what makes the checkpoint under root more or less than `files` (its manifest's table) plus
    the manifest: an extra file, a missing one, a link, FIFO, device or socket anywhere, a size that differs."""
    try:
        # Bounded by what the manifest lists: a planted tree of millions of entries is not walked to its end.
        found = dict(entries(root, limit=len(files) + 8, prune=(DERIVED, DERIVING)))
    except OSError as exc:
        return f"it cannot be listed ({exc})"
    for rel, st in found.items():
        if not stat.S_ISREG(st.st_mode):
            return f"{rel} is {kind(st.st_mode)}, not a file a save writes"
    extra = sorted(set(found) - set(files) - {MANIFEST})
    if extra:
        return f"{extra[0]} is not listed in its {MANIFEST} (a file this code did not write there)"
    for rel, want in sorted(files.items()):
        if rel not in found:
            return f"{rel} is missing"
        if found[rel].st_size != want["size"]:
            return f"{rel} does not match its recorded size and checksum (truncated or overwritten)"
    return None


# ---- removing and syncing -----------------------------------------------------------------------------------

def remove_entry(path):
    """Remove whatever is at `path`: a directory tree, or a link or file itself (never what a link points to)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
