"""What a checkpoint file may contain, and loading that never runs code from one.

Owns the rules for a file's contents, whatever its checksum says (the checksum is only as good as the manifest,
which whoever can write a file can rewrite):
  * no code runs while a checkpoint loads (weights_only_loading): every torch.load is weights-only, with exactly
    the non-tensor types DeepSpeed's and accelerate's files hold allowed; torch.distributed.checkpoint's .metadata
    pickle is read by an unpickler that builds only that format's own classes;
  * memory bounded by a file's size: a torch zip (a whole file, or one slice of a DCP .distcp file) is stored
    uncompressed, as torch.save writes it, and holds no more than its size; a DCP .metadata points only at files
    the manifest lists, within their recorded sizes, without a compressing transform;
  * a DCP storage entry is of the kind the live object is: a tensor where the model or optimizer has a tensor,
    bytes where it has another object (weights_only_loading checks it as the load plan is made);
  * numpy in a file is plain uint32/uint64 RNG state.
A file that breaks a rule is refused by name (UnsafeCheckpointFile, or a problem string from contents_problem).
It reads only what it is given: held.HeldCheckpoint gives it the files a checkpoint verified.
"""

import contextlib
import functools
import io
import os
import pickle
import re
import types
import zipfile

import torch


class UnsafeCheckpointFile(Exception):
    """A checkpoint file that cannot be read without running code from it, or beyond the memory its size bounds."""


class CheckpointKindMismatch(ValueError):
    """A DCP storage entry of another kind (tensor or bytes) than the object this run loads it into."""


# ---- weights-only loading ----------------------------------------------------------------------------------

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


def safe_metadata_load(file, *args, name=None, **kwargs):
    """A DCP .metadata, built from its own classes only. name: what to call the file in a refusal (default its
    path; a file opened from a descriptor has none)."""
    try:
        return _MetadataUnpickler(file).load()
    except Exception as exc:
        raise UnsafeCheckpointFile(f"{name or getattr(file, 'name', file)}: refused ({exc})") from None


# What torch.distributed.checkpoint.filesystem gets for `pickle` while a checkpoint loads: saving is unchanged.
_SAFE_PICKLE = types.SimpleNamespace(load=safe_metadata_load, dump=pickle.dump,
                                     HIGHEST_PROTOCOL=pickle.HIGHEST_PROTOCOL)


def _kind_problem(state_dict, metadata):
    """None, or the first entry of a DCP load whose stored kind (tensor or bytes) is not the live object's."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    for fqn, obj in state_dict.items():
        stored = metadata.state_dict_metadata.get(fqn)
        if stored is None:
            continue
        stored_tensor, live_tensor = isinstance(stored, TensorStorageMetadata), torch.is_tensor(obj)
        if stored_tensor != live_tensor:
            return (f"its .metadata stores {fqn} as {'a tensor' if stored_tensor else 'bytes'}, where this run has "
                    f"{'a tensor' if live_tensor else 'a ' + type(obj).__name__}")
    return None


def _stream_problem(f):
    """None, or why the torch zip in the seekable stream f (a DCP slice) would take more memory than its size."""
    start = f.tell()
    try:
        f.seek(0, os.SEEK_END)  # DCP's slice view returns its base file's offset here, and tells its own
        size = f.tell() - start
        with zipfile.ZipFile(_Window(f, start, size)) as archive:
            return zip_problem(archive.infolist(), size)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return "it is not a tensor record torch.save writes"
    finally:
        f.seek(start)


def _load_problem(f):
    """None, or why what torch.load is given (a path, or a stream: a DCP slice) would inflate beyond its size."""
    if isinstance(f, (str, os.PathLike)):
        try:
            with open(f, "rb") as opened:
                return torch_file_problem(str(f), opened.fileno())
        except OSError:
            return None  # torch.load says why it cannot read it
    if hasattr(f, "seek") and hasattr(f, "read"):
        problem = _stream_problem(f)
        return f"a slice of a sharded checkpoint: refused ({problem})" if problem else None
    return None


@contextlib.contextmanager
def weights_only_loading():
    """While active, no file torch.load or torch.distributed.checkpoint reads can run code or inflate beyond its
    size, and a DCP entry loads only into an object of its kind."""
    real_load = torch.load
    allowed = _deepspeed_types() + _numpy_types()

    @functools.wraps(real_load)
    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        problem = _load_problem(f)
        if problem:
            raise UnsafeCheckpointFile(problem)
        try:
            with torch.serialization.safe_globals(allowed):
                return real_load(f, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            named = re.search(r"GLOBAL ([\w.]+)", str(exc))
            reason = (f"it asks for {named.group(1)}, which is neither a tensor nor a type a checkpoint holds"
                      if named else str(exc).strip().split("\n")[-1][:200])
            raise UnsafeCheckpointFile(f"{f}: not loadable as weights only ({reason})") from None

    import torch.distributed.checkpoint.default_planner as dcp_planner
    import torch.distributed.checkpoint.filesystem as dcp_files
    real_pickle, real_plan = dcp_files.pickle, dcp_planner.create_default_local_load_plan

    @functools.wraps(real_plan)
    def plan(state_dict, metadata, *args, **kwargs):
        problem = _kind_problem(state_dict, metadata)
        if problem:
            raise CheckpointKindMismatch(problem)
        return real_plan(state_dict, metadata, *args, **kwargs)

    torch.load, dcp_files.pickle, dcp_planner.create_default_local_load_plan = load, _SAFE_PICKLE, plan
    try:
        yield
    finally:
        torch.load, dcp_files.pickle, dcp_planner.create_default_local_load_plan = real_load, real_pickle, real_plan


# ---- bounded contents -------------------------------------------------------------------------------------

class _Window(io.RawIOBase):
    """Bytes [start, start + size) of a file descriptor or seekable stream, read without moving anything else."""

    def __init__(self, source, start, size):
        super().__init__()
        self.source, self.start, self.size, self.pos = source, start, size, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=os.SEEK_SET):
        self.pos = max(0, {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence] + offset)
        return self.pos

    def readinto(self, buffer):
        n = max(0, min(len(buffer), self.size - self.pos))
        if isinstance(self.source, int):
            data = os.pread(self.source, n, self.start + self.pos)
        else:
            self.source.seek(self.start + self.pos)
            data = self.source.read(n)
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def zip_problem(infos, size):
    """None, or why a torch zip of `size` bytes with these entries could take more memory than its size: torch.save
    stores every entry uncompressed, so a compressed one (a few MB inflating to GB) is not a file it wrote."""
    if any(info.compress_type != zipfile.ZIP_STORED for info in infos) or sum(i.file_size for i in infos) > size:
        return "its entries are compressed; torch.save never compresses, and they could inflate to far more " \
               "memory than the file's size"
    return None


def torch_file_problem(rel, fd):
    """None, or why the torch file open at fd is refused before it is loaded (a compressed zip). A legacy (non-zip)
    torch file passes: torch.load reads it as weights only."""
    size = os.fstat(fd).st_size
    try:
        with zipfile.ZipFile(_Window(fd, 0, size)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return None
    problem = zip_problem(infos, size)
    return f"{rel}: refused ({problem})" if problem else None


def storage_problem(rel, metadata, files, fds):
    """None, or why a DCP .metadata (at `rel`) reaches beyond what the manifest's table `files` lists: every storage
    entry must name a plain file beside it, listed, lie within its recorded size, use no transform (this code never
    compresses one), and be a torch zip bounded by its slice (fds: {rel: an open descriptor of each listed file})."""
    folder = os.path.dirname(rel)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return f"{rel}: refused (it has no storage table this code writes)"
    for info in storage.values():
        where, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        listed = os.path.join(folder, where) if isinstance(where, str) else None
        if not (isinstance(where, str) and plain_name(where) and listed in files):
            return f"{rel}: refused (it points a tensor at a file its checkpoint does not list)"
        if not (type(offset) is int and type(length) is int and 0 <= offset and 0 <= length
                and offset + length <= files[listed]["size"]):
            return f"{rel}: refused (it points a tensor past the end of {listed})"
        if getattr(info, "transform_descriptors", None):
            return f"{rel}: refused (it asks for a transform of {listed} ({info.transform_descriptors}); this code " \
                   f"never writes one)"
        try:
            with zipfile.ZipFile(_Window(fds[listed], offset, length)) as archive:
                problem = zip_problem(archive.infolist(), length)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError):
            problem = "it is not a tensor record torch.save writes"
        if problem:
            return f"{listed}: refused (a slice at {offset}: {problem})"
    return None


def plain_name(name):
    """A name that is one path component of its own: a non-empty string without a separator, NUL, '.' or '..'."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name
            and len(name.encode(errors="replace")) <= 255)


def numpy_problem(rel, loaded):
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


def file_format(rel):
    """How a checkpoint file is read back: 'torch' (torch.load), 'metadata' (a DCP .metadata), or None
    (not a pickle: JSON, safetensors, raw tensor bytes, text; DeepSpeed's zero_to_fp32.py is never run)."""
    name = os.path.basename(rel)
    if name == ".metadata":
        return "metadata"
    if name in ("latest", "latest_universal") or name.endswith((".json", ".safetensors", ".py", ".distcp", ".done")):
        return None
    return "torch"
