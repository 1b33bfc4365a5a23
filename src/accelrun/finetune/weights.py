"""What a model directory's weight files hold, read from their headers without loading them and without running code.

Owns, for a --model directory (shared storage: its files are untrusted):
  * which weight files transformers loads from it (weight_files): the safetensors shards, else the .bin ones; an
    index that is not one (not JSON, not an object, shard names that are not names in the directory) and a file
    that is not a regular one (a FIFO would block the run before it starts) are one line (open_weight_file);
  * the problems that must stop a run, in one line, before transformers loads anything (weights_problem): a
    safetensors header that cannot be one (longer than its file, or than safetensors' own limit), a .bin file whose
    pickle would run code (refused by weights-only loading), a config.json that describes a model far larger than
    the files hold (vocab_size 10**9 made transformers allocate 128 GB before any check);
  * the fingerprint of the weights (fingerprint): what tells one model's weights from another's, for LoRA, whose
    checkpoints and adapter hold no base weights and must go with the base they were trained on. It reads each
    tensor's first, middle and last WINDOW bytes and the headers: megabytes for a model of gigabytes, never the
    weights a second time. A fingerprint, not a checksum: it tells two models apart, not a deliberate edit;
  * the check the documented adapter snippet makes (check_base), against the record the export writes (BASE_RECORD).

It imports torch only to look into a .bin file, under weights-only loading.
"""

import hashlib
import json
import math
import os
import stat
import struct

from accelrun.results import write_file

SAFETENSORS_HEADER_LIMIT = 100_000_000  # the safetensors library's own limit on a header (100 MB)
WINDOW = 16 * 1024  # bytes of each tensor read for the fingerprint, at its start, middle and end
BASE_RECORD = "base_model.json"  # in OUTPUT_DIR/adapter: the base the adapter was trained on, and its fingerprint
INDEX_LIMIT = 64 * 1024 * 1024  # bytes of a shard index read: one of a model of 100,000 tensors is a few MB
PACKING = 8  # a file may hold fewer values than the model has parameters: up to 8 4-bit weights in one int32


class WeightsProblem(ValueError):
    """A weight file that must not be loaded, or a base that is not the one an adapter was trained on: one line."""


def kind(mode):
    """What a file that is not a regular one is, in words."""
    for test, word in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return word
    return "not a regular file"


def open_weight_file(path):
    """The file at `path` opened for reading as the checkpoint files are (checkpoint/untrusted.py): O_NONBLOCK, so
    that a FIFO never blocks the run, then from the descriptor its kind (a regular file), before a byte is read.
    Else WeightsProblem. A symbolic link is followed, unlike in a checkpoint: a hub cache's snapshot is links to its
    blobs, and transformers follows them when it loads; what it points to passes the same checks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise WeightsProblem(f"{path}: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise WeightsProblem(f"{path} is {kind(st.st_mode)}, not a weight file: give a directory written by "
                             f"save_pretrained, as it wrote it")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _shards(directory, index):
    """The shard names the index file `index` in `directory` maps tensors to; WeightsProblem for an index that is
    not one (not JSON, not an object, a weight_map of anything but names in the directory)."""
    with open_weight_file(os.path.join(directory, index)) as f:
        size = os.fstat(f.fileno()).st_size
        if size > INDEX_LIMIT:
            raise WeightsProblem(f"{index} is {size} bytes, over the {INDEX_LIMIT} an index of shards needs")
        raw = f.read(INDEX_LIMIT + 1)
    try:
        weight_map = json.loads(raw).get("weight_map")
    except (ValueError, RecursionError):
        raise WeightsProblem(f"{index} is not JSON: give the index save_pretrained wrote") from None
    except AttributeError:
        raise WeightsProblem(f"{index} is not a JSON object with a weight_map: give the index save_pretrained "
                             f"wrote") from None
    if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
        raise WeightsProblem(f"{index}'s weight_map is not a table of tensor names to shard file names: give the "
                             f"index save_pretrained wrote")
    shards = sorted(set(weight_map.values()))
    outside = [name for name in shards if os.path.basename(name) != name or name in ("", ".", "..")]
    if outside:
        raise WeightsProblem(f"{index} names a shard outside the model directory: {outside[0][:80]!r}")
    return shards


def weight_files(directory):
    """The weight files transformers loads from `directory`: the shards its index names, or the single file;
    safetensors first, as transformers prefers them. [] when it has none of them (transformers then says why).
    Each is checked to be a regular file (open_weight_file); WeightsProblem for one that is not, or a bad index."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if os.path.lexists(os.path.join(directory, index)):
            files = [os.path.join(directory, name) for name in _shards(directory, index)]
        elif os.path.lexists(os.path.join(directory, single)):
            files = [os.path.join(directory, single)]
        else:
            continue
        for path in files:
            open_weight_file(path).close()
        return files
    return []


def safetensors_header(path):
    """(the header's bytes, its tensors {name: (dtype, shape, start, end)}, where the data starts) of a safetensors
    file, checked against the file's size before anything is allocated for it."""
    with open_weight_file(path) as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        length = struct.unpack("<Q", raw)[0] if len(raw) == 8 else None
        if length is None or length > min(SAFETENSORS_HEADER_LIMIT, size - 8):
            raise WeightsProblem(f"{path} is not a safetensors file this code reads: its header claims "
                                 f"{length if length is not None else '?'} bytes in a file of {size}")
        header = f.read(length)
    try:
        entries = json.loads(header)
        tensors = {name: (e["dtype"], [int(n) for n in e["shape"]], *map(int, e["data_offsets"]))
                   for name, e in entries.items() if name != "__metadata__"}
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise WeightsProblem(f"{path}: its safetensors header is not one ({type(exc).__name__})") from None
    data = 8 + length
    if any(start < 0 or end < start or data + end > size or min(shape, default=0) < 0
           for _, shape, start, end in tensors.values()):
        raise WeightsProblem(f"{path}: its safetensors header places tensors outside the file ({size} bytes)")
    return header, tensors, data


def bin_values(path):
    """The number of values a .bin weight file holds, read under weights-only loading (its pickle runs no code) with
    its storage mapped, not read."""
    import pickle

    import torch
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        found = str(exc).split("WeightsUnpickler error:")[-1].strip().split(" was not an allowed")[0][:120]
        raise WeightsProblem(f"{path} holds a pickle that would run code, refused by weights-only loading "
                             f"({found}); use a model saved as safetensors") from None
    except RuntimeError:
        return None  # not a zip-format file this check maps: transformers loads it, weights-only, or says why
    return sum(t.numel() for t in state.values() if torch.is_tensor(t)) if isinstance(state, dict) else None


def values_held(files):
    """The number of values the weight files hold (None when a .bin file cannot tell); raises WeightsProblem."""
    total = 0
    for path in files:
        if path.endswith(".safetensors"):
            total += sum(math.prod(shape) for _, shape, _, _ in safetensors_header(path)[1].values())
            continue
        held = bin_values(path)
        if held is None:
            return None
        total += held
    return total


def weights_problem(directory, n_params, config):
    """None, or why --model's weight files must not be loaded (one line): see the module's docstring."""
    try:
        files = weight_files(directory)
        held = values_held(files) if files else None
    except WeightsProblem as exc:
        return str(exc)
    except OSError as exc:
        return f"{exc.filename or directory}: {exc.strerror or exc}"
    if held is not None and held * PACKING < n_params:
        sizes = ", ".join(f"{key} {getattr(config, key)}" for key in ("vocab_size", "hidden_size", "num_hidden_layers")
                          if hasattr(config, key))
        return (f"its config.json describes a model of {n_params:,} parameters ({sizes}) and its weight files hold "
                f"{held:,} values: they do not belong together, and loading would allocate the model config.json "
                f"describes. Give a directory written by save_pretrained, as it wrote it")
    return None


def fingerprint(directory):
    """'sha256:...' of the weight files' names, headers and the sampled bytes of each tensor; None without weight
    files. Raises WeightsProblem, OSError."""
    files = weight_files(directory)
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(os.path.basename(path).encode() + b"\0")
        with open_weight_file(path) as f:
            size = os.fstat(f.fileno()).st_size
            digest.update(str(size).encode() + b"\0")
            if path.endswith(".safetensors"):
                header, tensors, data = safetensors_header(path)
                digest.update(header)
                spans = sorted((data + start, data + end) for _, _, start, end in tensors.values())
            else:  # a .bin file: its whole length, in 64 equal parts
                spans = [(size * i // 64, size * (i + 1) // 64) for i in range(64)]
            for start, end in spans:
                for at in sorted({start, max(start, (start + end) // 2 - WINDOW // 2), max(start, end - WINDOW)}):
                    f.seek(at)
                    digest.update(f.read(min(WINDOW, end - at)))
    return "sha256:" + digest.hexdigest()


def model_directory(name):
    """The local directory of --model: itself, or for a hub id the snapshot transformers loaded it from (None when it
    is not in the local cache)."""
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return path
    from transformers.utils import cached_file
    try:
        found = cached_file(name, "config.json", local_files_only=True, _raise_exceptions_for_missing_entries=False)
    except (OSError, ValueError):
        return None
    return os.path.dirname(found) if found else None


def base_fingerprint(name):
    """The fingerprint of --model's weights (local directory or the hub snapshot loaded), or None."""
    directory = model_directory(name)
    return fingerprint(directory) if directory else None


def record_base(adapter_dir, base_model, weights):
    """Write BASE_RECORD into the adapter's directory: the --model it adapts, and that model's fingerprint (a new
    file renamed over the name: a link there is replaced, never written through)."""
    write_file(os.path.join(adapter_dir, BASE_RECORD), json.dumps({"base_model": base_model, "base_weights": weights},
                                                                  indent=1))


def check_base(adapter_dir, base_model):
    """Raise WeightsProblem unless `base_model` (a directory, or a hub id in the local cache) holds the weights the
    adapter in adapter_dir was trained on (the fingerprint its export recorded). The adapter snippet calls it."""
    with open(os.path.join(adapter_dir, BASE_RECORD)) as f:
        recorded = json.load(f)
    now = base_fingerprint(base_model)
    if now != recorded["base_weights"]:
        raise WeightsProblem(f"{base_model} does not hold the weights the adapter in {adapter_dir} was trained on "
                             f"(fingerprint {short(recorded['base_weights'])}, now {short(now)}): an adapter on "
                             f"another base gives other answers. Load the base it was trained on "
                             f"({recorded['base_model']}, as it was then)")


def short(weights):
    return str(weights)[:19]
