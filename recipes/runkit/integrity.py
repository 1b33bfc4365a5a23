"""Whether a checkpoint holds exactly the files that were saved, and reading it only through what was verified.

Owns (docs/checkpoints.md, "What a checkpoint can and cannot do"):
* checkpoint.json, the manifest: every field's type and range (read_manifest), and the files it lists, which
  must be exactly the ones its engine and layout write (files_problem). It is written once, never through a link
  (write_manifest); an entry is removed as itself, never through a link (remove_entry).
* the SHA-256 table in it, computed and checked by all ranks together: a file whose name carries a rank
  (DeepSpeed's zero_pp_rank_N, torch.distributed.checkpoint's __N_0.distcp, accelerate's random_states_N) is
  hashed by that rank, which wrote it and reads it back; the other files are dealt out in turn (my_share).
* HeldCheckpoint: a checkpoint read only through what was verified. Every rank opens each listed file once,
  walking the checkpoint without following a link (open_in), holds the descriptors, hashes and parses its share
  through them, and loads through a private directory of links to those descriptors (view): whatever replaces a
  file at its path afterwards is never read. The ranks compare what they hold (collectives.checked_by_every_rank).
What a file may contain (no code, bounded memory, plain RNG state) is safe_loading.py's.
"""

import copy
import errno
import hashlib
import json
import os
import re
import resource
import shutil
import stat
import tempfile

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

MANIFEST = "checkpoint.json"  # written last, by the main process: the checkpoint exists once it does
# A checkpoint's derived part (resharding.py: DeepSpeed's universal checkpoint, made by a resume on another world
# size), with a manifest of its own, and the conversion in progress; the checkpoint's own manifest lists neither.
DERIVED, DERIVING = "universal", ".tmp-universal"

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

class RefusedFile(OSError):
    """A checkpoint file that is not what a save writes: not a regular file, or not its recorded size."""


# A manifest is a few KB (about 600 bytes per rank of the run that wrote it); this bounds what a planted one costs,
# checked on the open file before a byte is read.
MANIFEST_MAX_BYTES = 4 << 20


def _kind(mode):
    """What a non-regular file is, in words."""
    for test, word in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return word
    return "not a regular file"


def _open_checked(path, size, name, dir_fd=None):
    """The regular file at `path` (relative to dir_fd when given), opened for reading: O_NONBLOCK, so that opening
    a FIFO never blocks; O_NOFOLLOW, so that a link is refused, never followed; its kind, owner (this user: owners.py)
    and size from the descriptor. Else RefusedFile naming it `name`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last component is a symbolic link
            raise RefusedFile(f"{name} is a symbolic link, not a file a save writes") from None
        if isinstance(exc, FileNotFoundError):
            raise RefusedFile(f"{name} is missing") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefusedFile(f"{name} is {_kind(st.st_mode)}, not a file a save writes")
        if theirs(st):
            raise RefusedFile(f"{name} {theirs(st)}")
        if size is not None and st.st_size != size:
            raise RefusedFile(f"{name} does not match its recorded size and checksum (truncated or overwritten)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_regular(path, size=None, name=None):
    """The file at `path` if it is a regular file (not a link, FIFO or device), of `size` bytes when given; else
    RefusedFile naming it (`name`, default the path)."""
    return _open_checked(path, size, name or path)


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
        return _open_checked(last, size, rel, dir_fd=fd)
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


def _allow_open_files(count):
    """Let this process hold `count` more descriptors (a universal checkpoint holds four files per parameter)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = count + 1024  # what the process holds besides: libraries, sockets, DataLoader pipes
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(hard, need), hard))
    if hard != resource.RLIM_INFINITY and hard < need:
        raise RefusedFile(f"it holds {count} files, more than this process may open (ulimit -n {hard}); raise "
                          f"the limit and run again")


def _digest(fd, size):
    """SHA-256 of the first `size` bytes of the file open at fd, read without moving its offset."""
    digest, done = hashlib.sha256(), 0
    while done < size:
        block = os.pread(fd, min(size - done, 1 << 22), done)
        if not block:
            break
        digest.update(block)
        done += len(block)
    return done, digest.hexdigest()


class HeldCheckpoint:
    """A checkpoint's listed files, each opened once and held while it is verified and loaded. Every rank holds
    every file; each hashes and parses its share (share_problems) through the descriptors it holds, and loads
    through view(), a private directory of links to them. Close it (or use `with`) when the load is over."""

    def __init__(self, path, files, follow=True):
        """files: the manifest's table ({rel: {size, sha256}}); follow: whether `path` itself may be a link (a path
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
        _allow_open_files(len(self.files))
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
            for rel in mine:
                want = self.files[rel]
                if _digest(self.held[rel].fileno(), want["size"]) != (want["size"], want["sha256"]):
                    return f"{rel} does not match its recorded size and checksum (truncated or overwritten)", None
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
            self._view = tempfile.mkdtemp(prefix="runkit-checkpoint-")
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


def check_loadable(root, rels, files=None):
    """None, or why one of `rels` under root cannot be loaded as weights only, or reaches beyond `files` (a
    manifest's table; default: rels at whatever size they have). HeldCheckpoint.loadable on a directory."""
    files = files or {rel: {"size": None} for rel in rels}
    with HeldCheckpoint(str(root), files) as held:
        try:
            held.hold()
        except RefusedFile as exc:
            return str(exc)
        if files and any(want.get("size") is None for want in files.values()):  # sizes the storage check needs
            held.files = {rel: {**want, "size": os.fstat(held.held[rel].fileno()).st_size}
                          for rel, want in files.items()}
        return held.loadable(rels)


# ---- hashing and writing ----------------------------------------------------------------------------------

def sha256(path, size=None, name=None):
    """(size, SHA-256) of the regular file at `path`, reading at most `size` bytes (its size when not given)."""
    with open_regular(path, size, name) as f:
        return _digest(f.fileno(), os.fstat(f.fileno()).st_size if size is None else size)


def file_table(root, rels):
    """{rel: {size, sha256}} of the given files under root (each a regular file, or RefusedFile)."""
    table = {}
    for rel in rels:
        size, digest = sha256(os.path.join(root, rel), name=rel)
        table[rel] = {"size": size, "sha256": digest}
    return table


def check_files(root, expected):
    """None, or what is wrong with the first of `expected` ({rel: {size, sha256}}) that does not match."""
    with HeldCheckpoint(str(root), expected) as held:
        try:
            held.hold()
        except RefusedFile as exc:
            return str(exc)
        for rel, want in sorted(expected.items()):
            if _digest(held.held[rel].fileno(), want["size"]) != (want["size"], want["sha256"]):
                return f"{rel} does not match its recorded size and checksum (truncated or overwritten)"
    return None


def write_manifest(directory, manifest):
    """directory/checkpoint.json, written once (never over a file or through a link another wrote) and synced."""
    fd = os.open(os.path.join(directory, MANIFEST), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


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


def listing(root):
    """Every entry of a checkpoint but its manifest, as paths relative to it (a link is listed, never followed)."""
    return [rel for rel, _ in entries(root) if rel != MANIFEST]


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
            return f"{rel} is {_kind(st.st_mode)}, not a file a save writes"
    extra = sorted(set(found) - set(files) - {MANIFEST})
    if extra:
        return f"{extra[0]} is not listed in its {MANIFEST} (a file this code did not write there)"
    for rel, want in sorted(files.items()):
        if rel not in found:
            return f"{rel} is missing"
        if found[rel].st_size != want["size"]:
            return f"{rel} does not match its recorded size and checksum (truncated or overwritten)"
    return None


# ---- the manifest ------------------------------------------------------------------------------------------

def _plain_path(rel):
    """A relative path of plain names: no absolute part, no '..', '.' or empty component."""
    parts = rel.split("/") if isinstance(rel, str) else []
    return bool(parts) and "\0" not in rel and all(p not in ("", ".", "..") for p in parts)


def _is_sha256(value):
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def whole(value, low=0, high=1 << 62):
    """Whether `value` is an int (not a bool) within [low, high]."""
    return type(value) is int and low <= value <= high


FAMILIES = ("full", "deepspeed", "fsdp")  # resume_rules.layout's engine families
MANIFEST_FIELDS = {"step", "layout", "must_match", "train_state", "files"}
OPTIONAL_FIELDS = {"recipe", "derived_from"}  # the recipe that wrote it (since issue 36); a derived part's source


def _shown(value):
    """A value from a manifest, for a message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _layout_problem(layout):
    """None, or why a manifest's layout is not one resume_rules.layout writes."""
    if not (isinstance(layout, dict) and {"family", "zero_stage", "world_size"} <= set(layout)
            <= {"family", "zero_stage", "world_size", "grad_accum", "sequence_parallel"}):
        return "its layout is not one this code writes"
    family, stage = layout["family"], layout["zero_stage"]
    if family not in FAMILIES:
        return f"its layout names an engine this code does not write ({_shown(family)})"
    if not (whole(stage, 0, 3) if family == "deepspeed" else stage is None):
        return f"its layout's zero_stage {_shown(stage)} is not one a {family} run writes"
    if not whole(layout["world_size"], 1, 1 << 20):
        return f"its layout's world_size {_shown(layout['world_size'])} is not a number of processes"
    if "grad_accum" in layout and not whole(layout["grad_accum"], 1, 1 << 20):
        return f"its layout's grad_accum {_shown(layout['grad_accum'])} is not a number of micro-batches"
    if "sequence_parallel" in layout and not whole(layout["sequence_parallel"], 2, layout["world_size"]):
        return f"its layout's sequence_parallel {_shown(layout['sequence_parallel'])} is not a size of process groups"
    return None


_PARSED = {}  # (device, inode, size, mtime) of a manifest file -> its JSON, or why it has none: parsed once per run


def _read_json(path):
    """The manifest's JSON, read through one descriptor (a regular file of this user's, at most MANIFEST_MAX_BYTES, its
    size checked before reading), parsed once per process however often it is asked for (a file hard-linked into
    many planted checkpoints included); ValueError saying why there is none."""
    name = os.path.join(path, MANIFEST)
    try:
        with open_regular(name, name=MANIFEST) as f:
            st = os.fstat(f.fileno())
            if st.st_size > MANIFEST_MAX_BYTES:
                raise ValueError(f"{MANIFEST} is over {MANIFEST_MAX_BYTES >> 20} MB, far more than a manifest holds")
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if key not in _PARSED:
                if len(_PARSED) > 256:
                    _PARSED.clear()
                _PARSED[key] = _parsed(f.read(MANIFEST_MAX_BYTES + 1))
    except RefusedFile as exc:
        if str(exc).endswith("is missing"):
            raise ValueError(f"no {MANIFEST}: the save never finished") from None
        raise ValueError(str(exc)) from None
    except OSError as exc:
        raise ValueError(f"unreadable {MANIFEST} ({exc})") from None
    if isinstance(_PARSED[key], ValueError):
        raise _PARSED[key]
    return copy.deepcopy(_PARSED[key])


def _parsed(data):
    """The JSON in `data`, or the ValueError saying it is none."""
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return ValueError(f"unreadable {MANIFEST} ({exc})")
    except RecursionError:
        return ValueError(f"unreadable {MANIFEST} (nested too deeply to be a manifest this code wrote)")


def read_manifest(path, contents=True):
    """The checkpoint's manifest, or raise ValueError saying why there is none to use (cheap: no hashing). Every
    field is checked for its type and range (a train_state's own fields are the checkpoint code's to check).
    contents: also check that the checkpoint holds exactly the files it lists, each a regular file of its
    recorded size (lstat: nothing is opened or followed)."""
    manifest = _read_json(path)
    if not (isinstance(manifest, dict) and MANIFEST_FIELDS <= set(manifest) <= MANIFEST_FIELDS | OPTIONAL_FIELDS
            and whole(manifest["step"]) and isinstance(manifest["must_match"], dict)
            and isinstance(manifest["train_state"], dict) and isinstance(manifest["files"], dict)
            and isinstance(manifest.get("recipe", ""), str) and _is_sha256(manifest.get("derived_from", "0" * 64))):
        raise ValueError(f"{MANIFEST} is not a manifest this code wrote")
    problem = _layout_problem(manifest["layout"])
    if problem:
        raise ValueError(f"{MANIFEST}: {problem}")
    for rel, want in manifest["files"].items():
        if not _plain_path(rel) or rel == MANIFEST:
            raise ValueError(f"{MANIFEST} names {rel!r}, which is not a file inside the checkpoint")
        if not (isinstance(want, dict) and set(want) == {"size", "sha256"} and whole(want["size"])
                and _is_sha256(want["sha256"])):
            raise ValueError(f"{MANIFEST} records no valid size and checksum for {rel!r}")
    if contents:
        problem = coverage(path, manifest["files"])
        if problem:
            raise ValueError(problem)
    return manifest


def _numbered(name, index, suffix=""):
    """accelerate's names for the index-th model, optimizer or scheduler: name.bin, name_1.bin..."""
    return f"{name}{'' if index == 0 else f'_{index}'}{suffix}"


def expected_files(layout, models=1, optimizers=1, schedulers=1, files=()):
    """(needed, optional) for a checkpoint of this layout and run (how many models, optimizers and schedulers it
    prepared): needed, the patterns of which each must name exactly one listed file; optional, those a listed file
    may also match (DeepSpeed's own extras). files: the listed ones (FSDP's full or sharded state dict)."""
    world, family = layout["world_size"], layout["family"]
    needed = [re.escape(f"random_states_{r}.pkl") for r in range(world)]
    needed += [re.escape(f"rank-{r}.done") for r in range(world)]
    needed += [re.escape(_numbered("scheduler", i, ".bin")) for i in range(schedulers)]
    optional = []
    if family == "full":
        needed += [re.escape(_numbered("model", i, ".safetensors")) for i in range(models)]
        needed += [re.escape(_numbered("optimizer", i, ".bin")) for i in range(optimizers)]
    elif family == "deepspeed":
        optional += ["latest", "zero_to_fp32\\.py", "zero_to_torch\\.py"]  # DeepSpeed's tag file, recovery scripts
        for i in range(models):
            tag = re.escape(_numbered("pytorch_model", i))
            if layout["zero_stage"] == 3:
                needed += [f"{tag}/zero_pp_rank_{r}_mp_rank_00_model_states\\.pt" for r in range(world)]
            else:
                needed.append(f"{tag}/mp_rank_00_model_states\\.pt")
            if layout["zero_stage"]:
                needed += [f"{tag}/(bf16_)?zero_pp_rank_{r}_mp_rank_00_optim_states\\.pt" for r in range(world)]
    elif any(rel.startswith("pytorch_model_fsdp_0/") for rel in files):  # SHARDED_STATE_DICT (the shipped config)
        needed += [re.escape(f"rank-{r}.buffers.safetensors") for r in range(world)]
        folders = [f"pytorch_model_fsdp_{i}" for i in range(models)] + [f"optimizer_{i}" for i in range(optimizers)]
        for folder in folders:
            needed += [f"{folder}/\\.metadata"] + [f"{folder}/__{r}_0\\.distcp" for r in range(world)]
    else:  # FULL_STATE_DICT
        needed += [re.escape(f"rank-{r}.buffers.safetensors") for r in range(world)]
        needed += [re.escape(_numbered("pytorch_model_fsdp", i, ".bin")) for i in range(models)]
        needed += [re.escape(_numbered("optimizer", i, ".bin")) for i in range(optimizers)]
    return needed, optional


def files_problem(manifest, models=1, optimizers=1, schedulers=1):
    """None, or why the manifest's file table is not exactly what a save of its layout writes for a run with this
    many models, optimizers and schedulers: a file it needs to resume left out (the RNG state of a rank included),
    or one no save writes."""
    files, layout = manifest["files"], manifest["layout"]
    needed, optional = expected_files(layout, models, optimizers, schedulers, files)
    what = f"a {layout['family']} save of {layout['world_size']} process(es)"
    for pattern in needed:
        matches = [rel for rel in files if re.fullmatch(pattern, rel)]
        if len(matches) != 1:
            shown = pattern.replace("\\", "").replace("(bf16_)?", "")
            return f"{MANIFEST} does not list {shown}, which {what} writes and a resume reads"
    for rel in sorted(files):
        if not any(re.fullmatch(p, rel) for p in needed + optional):
            return f"{MANIFEST} lists {rel}, which no {what.removeprefix('a ')} writes"
    return None
