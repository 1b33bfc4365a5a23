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
"""

import contextlib
import functools
import hashlib
import json
import os
import pickle
import re
import types

import torch

MANIFEST = "checkpoint.json"  # written last, by the main process: the checkpoint exists once it does

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


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def file_table(root, rels):
    """{rel: {size, sha256}} of the given files under root."""
    return {rel: {"size": os.path.getsize(os.path.join(root, rel)), "sha256": sha256(os.path.join(root, rel))}
            for rel in rels}


def check_files(root, expected):
    """None, or what is wrong with the first of `expected` ({rel: {size, sha256}}) that does not match."""
    for rel, want in sorted(expected.items()):
        path = os.path.join(root, rel)
        if not os.path.isfile(path) or os.path.islink(path):
            return f"{rel} is missing"
        if os.path.getsize(path) != want["size"] or sha256(path) != want["sha256"]:
            return f"{rel} does not match its recorded size and checksum (truncated or overwritten)"
    return None


def fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def listing(root):
    """Every file of a checkpoint, as paths relative to it, but its manifest."""
    return sorted(os.path.relpath(os.path.join(folder, name), root)
                  for folder, _, files in os.walk(root) for name in files if name != MANIFEST or folder != root)


def read_manifest(path):
    """The checkpoint's manifest, or raise ValueError saying why there is none to use (cheap: no hashing)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"no {MANIFEST}: the save never finished") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"unreadable {MANIFEST} ({exc})") from None
    layout = manifest.get("layout") if isinstance(manifest, dict) else None
    if not (isinstance(manifest.get("files") if layout else None, dict) and isinstance(manifest.get("step"), int)
            and isinstance(manifest.get("must_match"), dict) and isinstance(manifest.get("train_state"), dict)
            and isinstance(layout, dict) and {"family", "zero_stage", "world_size"} <= set(layout)):
        raise ValueError(f"{MANIFEST} is not a manifest this code wrote")
    for rel, want in manifest["files"].items():
        if (os.path.isabs(rel) or ".." in rel.split(os.sep) or not isinstance(want, dict)
                or not isinstance(want.get("sha256"), str)):
            raise ValueError(f"{MANIFEST} names {rel!r}, which is not a file inside the checkpoint")
        if not os.path.isfile(os.path.join(path, rel)):
            raise ValueError(f"{rel} is missing")
        if os.path.getsize(os.path.join(path, rel)) != want.get("size"):
            raise ValueError(f"{rel} does not match its recorded size and checksum (truncated or overwritten)")
    return manifest


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


def _safe_metadata_load(file, *args, **kwargs):
    try:
        return _MetadataUnpickler(file).load()
    except Exception as exc:
        raise UnsafeCheckpointFile(f"{getattr(file, 'name', file)}: refused ({exc})") from None


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
    if name == "latest" or name.endswith((".json", ".safetensors", ".py", ".distcp", ".done")):
        return None
    return "torch"


def check_loadable(root, rels):
    """None, or why one of `rels` cannot be read without running code: the pickles are parsed here, with
    the tensors memory-mapped rather than read, so that every rank can refuse before any rank loads."""
    with weights_only_loading():
        for rel in rels:
            path, kind = os.path.join(root, rel), _format(rel)
            try:
                if kind == "metadata":
                    with open(path, "rb") as f:
                        _safe_metadata_load(f)
                elif kind == "torch":
                    try:
                        torch.load(path, map_location="cpu", mmap=True)
                    except RuntimeError as exc:
                        if "mmap" not in str(exc):
                            raise
                        torch.load(path, map_location="cpu")  # a file in torch's legacy format
            except UnsafeCheckpointFile as exc:
                return str(exc).replace(path, rel)
            except Exception as exc:  # noqa: BLE001 - any unreadable file is a refused checkpoint
                return f"{rel} cannot be read ({type(exc).__name__}: {str(exc)[:200]})"
    return None
