"""checkpoint.json, a checkpoint's manifest: its schema, read once and checked field by field, written once.

Owns (docs/checkpoints.md, "What a checkpoint can and cannot do"):
* the format version a manifest records (layout.FORMAT_VERSION): new saves write it, a manifest of an earlier one
  this code still reads (READABLE_VERSIONS) verifies by the checksum it recorded, and one of another version, or of
  none (written before it was recorded), is refused in one line naming the version;
* every field's type and range (read_manifest), the layout's included (the family and ZeRO stage one of formats.py's
  formats writes), and the training state Run keeps in it (TRAIN_STATE, WINDOW, state_problem: what run.py's
  Run.start and timing.py's window_state put there); a manifest on shared storage is untrusted, and a field of
  another type would otherwise surface as a traceback deep in a resume;
* reading it: through one descriptor (untrusted.open_regular: a regular file of this user's, bounded by
  layout.MANIFEST_MAX_BYTES), parsed once per process however often it is asked for; and, with contents, that the
  checkpoint holds exactly the files it lists (files.coverage);
* writing it once, never over a file or through a link another wrote (write_manifest);
* which recipe wrote it (another_recipe), and whether it is one this run's save would have written (run_problem).
"""

import copy
import json
import os
import re

from ..results import RUN_ID
from .files import coverage, recorded
from .formats import FORMATS, files_problem
from .layout import FORMAT_VERSION, MANIFEST, MANIFEST_MAX_BYTES
from .untrusted import Missing, RefusedFile, TooLarge, open_regular, shown, whole

MANIFEST_FIELDS = {"format_version", "step", "layout", "must_match", "train_state", "files"}
OPTIONAL_FIELDS = {"recipe", "derived_from"}  # the recipe that wrote it (since issue 36); a derived part's source


def _plain_path(rel):
    """A relative path of plain names: no absolute part, no '..', '.' or empty component."""
    parts = rel.split("/") if isinstance(rel, str) else []
    return bool(parts) and "\0" not in rel and all(p not in ("", ".", "..") for p in parts)


def _is_sha256(value):
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


# The format versions this code reads: 1 and 2 recorded each file's SHA-256, 3 (FORMAT_VERSION, what it writes) its
# xxh3_128; each file is verified by the checksum its entry records (files.recorded).
READABLE_VERSIONS = (1, 2, 3)


def _version_problem(manifest):
    """None, or the line refusing a manifest of a format version this code does not read, naming the one it has (a
    manifest that is no JSON object is read_manifest's to refuse)."""
    if not isinstance(manifest, dict):
        return None
    version = manifest.get("format_version")
    if whole(version) and version in READABLE_VERSIONS:
        return None
    if "format_version" not in manifest:
        wrote = f"records no format_version: accelrun before format {READABLE_VERSIONS[0]} wrote it"
    else:
        wrote = f"records format_version {shown(version)}: another version of accelrun wrote it"
    return f"{MANIFEST} {wrote}, and this code reads format {READABLE_VERSIONS[0]} to {READABLE_VERSIONS[-1]} only " \
           f"(resume it with the code that wrote it)"


def _layout_problem(layout):
    """None, or why a manifest's layout is not one rules.layout writes."""
    if not (isinstance(layout, dict) and {"family", "zero_stage", "world_size"} <= set(layout)
            <= {"family", "zero_stage", "world_size", "grad_accum", "sequence_parallel"}):
        return "its layout is not one this code writes"
    family, stage = layout["family"], layout["zero_stage"]
    engine = FORMATS.get(family) if isinstance(family, str) else None
    if engine is None:
        return f"its layout names an engine this code does not write ({shown(family)})"
    if not engine.writes_stage(stage):
        return f"its layout's zero_stage {shown(stage)} is not one a {family} run writes"
    if not whole(layout["world_size"], 1, 1 << 20):
        return f"its layout's world_size {shown(layout['world_size'])} is not a number of processes"
    if "grad_accum" in layout and not whole(layout["grad_accum"], 1, 1 << 20):
        return f"its layout's grad_accum {shown(layout['grad_accum'])} is not a number of micro-batches"
    if "sequence_parallel" in layout and not whole(layout["sequence_parallel"], 2, layout["world_size"]):
        return f"its layout's sequence_parallel {shown(layout['sequence_parallel'])} is not a size of process groups"
    return None


_PARSED = {}  # (device, inode, size, mtime) of a manifest file -> its JSON, or why it has none: parsed once per run


def _read_json(path):
    """The manifest's JSON, read through one descriptor (a regular file of this user's, at most MANIFEST_MAX_BYTES, its
    size checked before reading), parsed once per process however often it is asked for (a file hard-linked into
    many planted checkpoints included); ValueError saying why there is none."""
    try:
        with open_regular(os.path.join(path, MANIFEST), name=MANIFEST, limit=MANIFEST_MAX_BYTES) as f:
            st = os.fstat(f.fileno())
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if key not in _PARSED:
                if len(_PARSED) > 256:
                    _PARSED.clear()
                _PARSED[key] = _parsed(f.read(MANIFEST_MAX_BYTES + 1))
    except TooLarge:
        raise ValueError(f"{MANIFEST} is over {MANIFEST_MAX_BYTES >> 20} MB, far more than a manifest holds") from None
    except Missing:
        raise ValueError(f"no {MANIFEST}: the save never finished") from None
    except RefusedFile as exc:
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
    """The checkpoint's manifest, or raise ValueError saying why there is none to use (cheap: no hashing). Its format
    version first, then every field is checked for its type and range (a train_state's own fields are
    state_problem's to check). contents: also check that the checkpoint holds exactly the files it lists, each a
    regular file of its recorded size (lstat: nothing is opened or followed)."""
    manifest = _read_json(path)
    problem = _version_problem(manifest)
    if problem:
        raise ValueError(problem)
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
        if not (recorded(want) and whole(want["size"])):  # {size, xxh3_128}, or {size, sha256} (formats 1, 2)
            raise ValueError(f"{MANIFEST} records no valid size and checksum for {rel!r}")
    if contents:
        problem = coverage(path, manifest["files"])
        if problem:
            raise ValueError(problem)
    return manifest


def write_manifest(directory, manifest):
    """directory/checkpoint.json, with this code's format version, written once (never over a file or through a link
    another wrote) and synced."""
    fd = os.open(os.path.join(directory, MANIFEST), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump({"format_version": FORMAT_VERSION, **manifest}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def another_recipe(manifest, recipe):
    """The recipe that wrote the checkpoint when it is not `recipe` (this run's), else None. A manifest written before
    manifests named their recipe names none: then the settings tell (rules.incompatibility)."""
    other = manifest.get("recipe")
    return other if recipe and other and other != recipe else None


def run_problem(manifest, size_limit, models, optimizers, schedulers):
    """None, or why a manifest that read_manifest accepts is not one this run's save would have written: its files
    together larger than a checkpoint of this run's model holds (size_limit: nothing beyond it is hashed), its
    train_state, or its files not exactly those its engine and layout write for this many models, optimizers and
    schedulers."""
    total = sum(want["size"] for want in manifest["files"].values())
    if total > size_limit:
        return f"its {MANIFEST} records {total / 1e9:.3g} GB of files, more than a checkpoint of this model " \
               f"holds ({size_limit / 1e9:.3g} GB at most)"
    return state_problem(manifest) or files_problem(manifest, models, optimizers, schedulers)


# ---- the training state Run keeps in it ----------------------------------------------------------------------

def _number(value):
    return type(value) in (int, float)


def _scalar(value):
    return value is None or type(value) in (int, float, bool)


# What Run keeps in a checkpoint's train_state (run.py: the state Run.start makes, saved by Run._save), each field
# with its type and range; a manifest whose train_state holds anything else is not one this code wrote. The window
# (timing.py's window_state) is checked against the layout's world size in state_problem.
TRAIN_STATE = {
    "step": whole, "total_steps": whole, "epoch": whole, "step_in_epoch": whole, "epochs_run": whole,
    "first_loss": lambda v: v is None or _number(v), "final_loss": lambda v: v is None or _number(v),
    # Numbers only: an evaluation's figures reach summary.json, which must carry no string from a checkpoint.
    "last_eval": lambda v: v is None or (isinstance(v, dict) and whole(v.get("step"))
                                         and all(_scalar(x) for x in v.values())),
    "train_time": lambda v: _number(v) and v >= 0,
    "window": lambda v: v is None or isinstance(v, dict),
    # Where the run wrote (results.default_form decides whether a resumed run writes there too), and which run it
    # is (results.py: its mark in the output directory).
    "output_dir": lambda v: v is None or isinstance(v, str),
    "run_id": lambda v: isinstance(v, str) and RUN_ID.fullmatch(v) is not None,
    "stopped": lambda v: type(v) is bool,  # saved for a stop signal (the stop command, accelrun/stop.py, reads it)
}
WINDOW = {"loss_sums": lambda v: isinstance(v, list) and all(_number(x) for x in v), "micro": whole,
          "data_time": lambda v: _number(v) and v >= 0, "compute_time": lambda v: _number(v) and v >= 0}


def state_problem(manifest):
    """None, or why a manifest's train_state is not one Run writes (TRAIN_STATE): a field missing, unknown, or of
    another type or range; a step other than the manifest's; a log window of another world size."""
    state = manifest["train_state"]
    problem = _fields_problem(state, TRAIN_STATE) or (_fields_problem(state["window"], WINDOW) if state["window"]
                                                      else None)
    if problem:
        return problem
    if state["step"] != manifest["step"]:
        return f"its train_state's step {state['step']} is not its step {manifest['step']}"
    window = state["window"]
    if window and len(window["loss_sums"]) != manifest["layout"]["world_size"]:
        return f"its log window holds {len(window['loss_sums'])} loss sums for {manifest['layout']['world_size']} " \
               f"processes"
    return None


def _fields_problem(part, fields):
    """None, or the first field of `part` missing, unknown, or of another type or range than `fields` says."""
    if set(part) != set(fields):
        odd = sorted(set(part) ^ set(fields))[0]
        return f"its train_state {'lacks' if odd in fields else 'holds an unknown field'} {shown(odd)}"
    bad = next((k for k, ok in fields.items() if not ok(part[k])), None)
    return f"its train_state's {bad} {shown(part[bad])} is not of the type and range Run writes" if bad else None
