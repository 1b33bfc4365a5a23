"""What a checkpoint's files may contain, and whether they are the files that were saved.

Owns two guarantees (docs/checkpoints.md, "What a checkpoint can and cannot do"):

* No code runs when a checkpoint loads, whatever its files contain. While one loads,
  every torch.load is weights-only: DeepSpeed asks for weights_only=False and gets True,
  with exactly the non-tensor types its files hold allowed; torch.distributed.checkpoint's
  .metadata pickle (FSDP's sharded checkpoints) is read by an unpickler that builds only
  that format's own classes. A file that cannot be read that way is refused by name.
* checkpoint.json, the manifest: the SHA-256 table in it is computed and checked by all ranks together:
  a file whose name carries a rank (DeepSpeed's zero_pp_rank_N, torch.distributed.checkpoint's
  __N_0.distcp, accelerate's random_states_N) is hashed by that rank, which wrote it and
  reads it back; the other files are dealt out in turn. On resume no rank loads anything
  before every rank's verdict is in.

And a third, against whoever else can write into --checkpoint-dir: a checkpoint is exactly what its
manifest lists, every entry a regular file inside it, read with bounded size (open_regular, coverage);
a DCP .metadata may point only at files the manifest lists, within their recorded sizes; a torch file
must be stored uncompressed (its memory is bounded by its size); numpy arrays in it are plain RNG state.
The manifest is written once, never through a link (write_manifest), and an entry is removed as itself,
never through a link (remove_entry). One function checks a rank's share of any manifest's files (check_share),
for a checkpoint and for its converted universal/ part alike.
"""

import contextlib
import errno
import functools
import hashlib
import json
import os
import pickle
import re
import shutil
import stat
import types
import zipfile

import torch

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


class RefusedFile(OSError):
    """A checkpoint file that is not what a save writes: not a regular file, or not its recorded size."""


MANIFEST_MAX_BYTES = 64 << 20  # a manifest is a few KB; this bounds what a planted one can make us read


def _kind(mode):
    """What a non-regular file is, in words."""
    for test, word in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return word
    return "not a regular file"


def open_regular(path, size=None, name=None):
    """The file at `path`, opened for reading, if it is a regular file (not a link, FIFO or device) of `size`
    bytes when given; else raise RefusedFile naming it (`name`, default the path). O_NONBLOCK: opening a FIFO
    never blocks; O_NOFOLLOW: a link is refused, never followed; the size comes from the descriptor."""
    name = name or path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
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
        if size is not None and st.st_size != size:
            raise RefusedFile(f"{name} does not match its recorded size and checksum (truncated or overwritten)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def sha256(path, size=None, name=None):
    """(size, SHA-256) of the regular file at `path`, reading at most `size` bytes (its size when not given)."""
    digest = hashlib.sha256()
    with open_regular(path, size, name) as f:
        left = os.fstat(f.fileno()).st_size if size is None else size
        total = left
        while left > 0:
            block = f.read(min(left, 1 << 22))
            if not block:
                break
            digest.update(block)
            left -= len(block)
    return total - left, digest.hexdigest()


def file_table(root, rels):
    """{rel: {size, sha256}} of the given files under root (each a regular file, or RefusedFile)."""
    table = {}
    for rel in rels:
        size, digest = sha256(os.path.join(root, rel), name=rel)
        table[rel] = {"size": size, "sha256": digest}
    return table


def check_files(root, expected):
    """None, or what is wrong with the first of `expected` ({rel: {size, sha256}}) that does not match."""
    for rel, want in sorted(expected.items()):
        try:
            size, digest = sha256(os.path.join(root, rel), want["size"], rel)
        except RefusedFile as exc:
            return str(exc)
        if size != want["size"] or digest != want["sha256"]:
            return f"{rel} does not match its recorded size and checksum (truncated or overwritten)"
    return None


def write_manifest(directory, manifest):
    """directory/checkpoint.json, written once (never over a file or through a link another wrote) and synced."""
    fd = os.open(os.path.join(directory, MANIFEST), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def check_share(root, files, rank, world):
    """(damage, unsafe) of this rank's share of `files` ({rel: {size, sha256}}, a manifest's table) under root:
    damage, the first file that is not what was saved; unsafe, the first that cannot be loaded without running
    code or reaches outside the table; each None when there is none. Every rank checks its own share, and
    collectives.first_rank_problems then gives every rank the verdict, before any rank loads a file."""
    mine = my_share(list(files), rank, world)
    try:
        damage = check_files(root, {rel: files[rel] for rel in mine})
        unsafe = None if damage else check_loadable(root, mine, files)
    except OSError as exc:
        damage, unsafe = f"it cannot be read ({exc})", None
    return damage, unsafe


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


def entries(root):
    """Every entry under root, as (path relative to it, its lstat result), directories walked but not listed;
    a link is listed, never followed."""
    found, folders = [], [""]
    while folders:
        folder = folders.pop()
        with os.scandir(os.path.join(root, folder)) as it:
            for entry in it:
                rel = os.path.join(folder, entry.name)
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    folders.append(rel)
                else:
                    found.append((rel, st))
    return sorted(found)


def _plain_path(rel):
    """A relative path of plain names: no absolute part, no '..', '.' or empty component."""
    parts = rel.split("/") if isinstance(rel, str) else []
    return bool(parts) and "\0" not in rel and all(p not in ("", ".", "..") for p in parts)


def _is_sha256(value):
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def read_manifest(path, contents=True):
    """The checkpoint's manifest, or raise ValueError saying why there is none to use (cheap: no hashing).
    contents: also check that the checkpoint holds exactly the files it lists, each a regular file of its
    recorded size (lstat: nothing is opened or followed)."""
    name = os.path.join(path, MANIFEST)
    try:
        with open_regular(name, name=MANIFEST) as f:
            text = f.read(MANIFEST_MAX_BYTES + 1)
        if len(text) > MANIFEST_MAX_BYTES:
            raise ValueError(f"{MANIFEST} is over {MANIFEST_MAX_BYTES >> 20} MB, far more than a manifest holds")
        manifest = json.loads(text)
    except RefusedFile as exc:
        if str(exc).endswith("is missing"):
            raise ValueError(f"no {MANIFEST}: the save never finished") from None
        raise ValueError(str(exc)) from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"unreadable {MANIFEST} ({exc})") from None
    except RecursionError:
        raise ValueError(f"unreadable {MANIFEST} (nested too deeply to be a manifest this code wrote)") from None
    layout = manifest.get("layout") if isinstance(manifest, dict) else None
    if not (isinstance(layout, dict) and isinstance(manifest.get("files"), dict)
            and type(manifest.get("step")) is int and manifest["step"] >= 0
            and isinstance(manifest.get("must_match"), dict) and isinstance(manifest.get("train_state"), dict)
            and {"family", "zero_stage", "world_size"} <= set(layout)
            and isinstance(layout["family"], str) and type(layout["world_size"]) is int):
        raise ValueError(f"{MANIFEST} is not a manifest this code wrote")
    for rel, want in manifest["files"].items():
        if not _plain_path(rel) or rel == MANIFEST:
            raise ValueError(f"{MANIFEST} names {rel!r}, which is not a file inside the checkpoint")
        if not (isinstance(want, dict) and type(want.get("size")) is int and want["size"] >= 0
                and _is_sha256(want.get("sha256"))):
            raise ValueError(f"{MANIFEST} records no valid size and checksum for {rel!r}")
    if contents:
        problem = coverage(path, manifest["files"])
        if problem:
            raise ValueError(problem)
    return manifest


def coverage(root, files):
    """None, or what makes the checkpoint under root more or less than `files` (its manifest's table) plus
    the manifest: an extra file, a missing one, a link, FIFO, device or socket anywhere, a size that differs."""
    try:
        found = {rel: st for rel, st in entries(root) if rel.split("/")[0] not in (DERIVED, DERIVING)}
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


# ---- weights-only loading --------------------------------------------------------------------------

def _deepspeed_types():
    """The non-tensor classes DeepSpeed 0.19's ZeRO checkpoints hold (found with
    torch.serialization.get_unsafe_globals_in_checkpoint on checkpoints of every ZeRO config)."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:
        return []
    return [LossScaler, ZeroStageEnum, fragment_address]


def _numpy_types():
    """accelerate's random_states_N.pkl holds numpy's RNG state: an array and its dtype."""
    import numpy as np
    core = np._core if hasattr(np, "_core") else np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, *(
        [np.dtypes.UInt32DType] if hasattr(np, "dtypes") else [])]


class UnsafeCheckpointFile(Exception):
    """A checkpoint file that cannot be read without running code from it."""


# .metadata of torch.distributed.checkpoint: its own dataclasses and enums, and the plain types they hold
# (found by recording what the .metadata files of FSDP checkpoints ask for), nothing else.
_DCP = "torch.distributed.checkpoint."
_METADATA_GLOBALS = {
    *((_DCP + "metadata", name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING")),
    (_DCP + "filesystem", "_StorageInfo"), (_DCP + "filesystem", "_StoragePrefix"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        # A dotted name would walk from an allowed module to anything it imports (os.system...).
        dtype = module == "torch" and "." not in name and isinstance(getattr(torch, name, None), torch.dtype)
        if "." in name or not ((module, name) in _METADATA_GLOBALS or dtype):
            raise pickle.UnpicklingError(f"it asks for {module}.{name}, which a checkpoint's metadata never holds")
        return super().find_class(module, name)


def _safe_metadata_load(file, *args, name=None, **kwargs):
    """name: what to call the file in a refusal (default its path; a file opened from a descriptor has none)."""
    try:
        return _MetadataUnpickler(file).load()
    except Exception as exc:
        raise UnsafeCheckpointFile(f"{name or getattr(file, 'name', file)}: refused ({exc})") from None


# What torch.distributed.checkpoint.filesystem gets for `pickle` while a checkpoint loads: saving is unchanged.
_SAFE_PICKLE = types.SimpleNamespace(load=_safe_metadata_load, dump=pickle.dump,
                                     HIGHEST_PROTOCOL=pickle.HIGHEST_PROTOCOL)


@contextlib.contextmanager
def weights_only_loading():
    """While active, no file torch.load or torch.distributed.checkpoint reads can run code."""
    real_load = torch.load
    allowed = _deepspeed_types() + _numpy_types()

    @functools.wraps(real_load)
    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            with torch.serialization.safe_globals(allowed):
                return real_load(f, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            named = re.search(r"GLOBAL ([\w.]+)", str(exc))
            reason = (f"it asks for {named.group(1)}, which is neither a tensor nor a type a checkpoint holds"
                      if named else str(exc).strip().split("\n")[-1][:200])
            raise UnsafeCheckpointFile(f"{f}: not loadable as weights only ({reason})") from None

    import torch.distributed.checkpoint.filesystem as dcp_files
    real_pickle = dcp_files.pickle
    torch.load, dcp_files.pickle = load, _SAFE_PICKLE
    try:
        yield
    finally:
        torch.load, dcp_files.pickle = real_load, real_pickle


def _format(rel):
    """How a checkpoint file is read back: 'torch' (torch.load), 'metadata' (a DCP .metadata), or None
    (not a pickle: JSON, safetensors, raw tensor bytes, text; DeepSpeed's zero_to_fp32.py is never run)."""
    name = os.path.basename(rel)
    if name == ".metadata":
        return "metadata"
    if name in ("latest", "latest_universal") or name.endswith((".json", ".safetensors", ".py", ".distcp", ".done")):
        return None
    return "torch"


def _storage_problem(rel, metadata, files):
    """None, or why a DCP .metadata (at `rel`) points outside the files the manifest lists: every storage entry
    must name a plain file beside it, listed in the manifest, and lie within that file's recorded size."""
    folder = os.path.dirname(rel)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return f"{rel}: refused (it has no storage table this code writes)"
    for info in storage.values():
        where, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        listed = os.path.join(folder, where) if isinstance(where, str) else None
        if not (isinstance(where, str) and _plain_path(where) and "/" not in where and listed in files):
            return f"{rel}: refused (it points a tensor at a file its checkpoint does not list)"
        if not (type(offset) is int and type(length) is int and 0 <= offset and 0 <= length
                and offset + length <= files[listed]["size"]):
            return f"{rel}: refused (it points a tensor past the end of {listed})"
    return None


def _zip_problem(rel, f):
    """None, or why a torch zip file would take more memory than its size: torch.save stores every entry
    uncompressed, so a compressed one (a few MB inflating to GB) is not a file it wrote. None for a
    legacy (non-zip) torch file too."""
    try:
        with zipfile.ZipFile(f) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    size = os.fstat(f.fileno()).st_size
    if any(info.compress_type != zipfile.ZIP_STORED for info in infos) or sum(i.file_size for i in infos) > size:
        return f"{rel}: refused (its entries are compressed; torch.save never compresses, and they could inflate " \
               f"to far more memory than the file's size)"
    return None


def _numpy_problem(rel, loaded):
    """None, or why an object torch.load returned holds numpy data that is not plain RNG state: an array or
    dtype other than uint32/uint64 without fields or subarrays (such a dtype can build an array whose repr
    crashes). The objects are never printed."""
    import numpy as np

    def plain(dtype):
        return (isinstance(dtype, np.dtype) and dtype.fields is None and dtype.subdtype is None
                and not dtype.hasobject and dtype.type in (np.uint32, np.uint64))

    todo, seen = [loaded], set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            if not plain(obj.dtype):
                return f"{rel}: refused (it holds a numpy array that is not plain uint32/uint64 RNG state)"
        elif isinstance(obj, np.dtype):
            if not plain(obj):
                return f"{rel}: refused (it holds a numpy dtype other than plain uint32/uint64)"
        elif isinstance(obj, dict):
            todo.extend(obj.values())
            todo.extend(obj.keys())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.Tensor, type)):
            todo.extend(vars(obj).values())
    return None


def check_loadable(root, rels, files=None):
    """None, or why one of `rels` cannot be read without running code or outside what the manifest's table
    `files` ({rel: {size, sha256}}) lists: the pickles are parsed here, with the tensors memory-mapped rather
    than read, so that every rank can refuse before any rank loads. Every file is opened as a regular file of
    its recorded size."""
    files = files or {}
    with weights_only_loading():
        for rel in rels:
            path, kind = os.path.join(root, rel), _format(rel)
            size = files.get(rel, {}).get("size")
            try:
                if kind == "metadata":
                    with open_regular(path, size, rel) as f:
                        problem = _storage_problem(rel, _safe_metadata_load(f, name=rel), files)
                elif kind == "torch":
                    with open_regular(path, size, rel) as f:
                        problem = _zip_problem(rel, f)
                    if problem:
                        return problem
                    try:
                        loaded = torch.load(path, map_location="cpu", mmap=True)
                    except RuntimeError as exc:
                        if "mmap" not in str(exc):
                            raise
                        loaded = torch.load(path, map_location="cpu")  # a file in torch's legacy format
                    problem = _numpy_problem(rel, loaded)
                    del loaded
                else:
                    problem = None
                if problem:
                    return problem
            except (UnsafeCheckpointFile, RefusedFile) as exc:
                return str(exc).replace(path, rel)
            except Exception as exc:  # noqa: BLE001 - any unreadable file is a refused checkpoint
                return f"{rel} cannot be read ({type(exc).__name__}: {str(exc)[:200]})"
    return None
