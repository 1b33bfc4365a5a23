"""A manifest as the standard library reads it, for the checkpoint code and the stop command (accelrun/stop.py) alike.

Owns (manifest.py builds the rest of checkpoint.json's schema on it):
* reading checkpoint.json's JSON: through one descriptor (untrusted.open_regular: a regular file of this user's,
  bounded by layout.MANIFEST_MAX_BYTES), parsed once per process however often it is asked for (read_json);
* which format versions this code reads (version_problem: layout.FORMAT_VERSION and the older ones still readable,
  layout.READ_SINCE; docs/checkpoints.md, "What a format version promises");
* the training state Run keeps in it (TRAIN_STATE, WINDOW_STATE, state_problem: what run.py's Run.start and
  timing.py's window_state put there), each field's type and range: a manifest on shared storage is untrusted;
* the training state of one checkpoint read alone (training_state), which the stop command asks for.
Standard library only.
"""

import copy
import json
import os

from ..results import RUN_ID
from .layout import FORMAT_VERSION, MANIFEST, MANIFEST_MAX_BYTES, READ_SINCE
from .untrusted import Missing, RefusedFile, TooLarge, open_regular, shown, whole

_PARSED = {}  # (device, inode, size, mtime) of a manifest file -> its JSON, or why it has none: parsed once per run


def read_json(path):
    """The JSON of the manifest of the checkpoint at `path`, read through one descriptor (a regular file of this
    user's, at most MANIFEST_MAX_BYTES, its size checked before reading), parsed once per process however often it
    is asked for (a file hard-linked into many planted checkpoints included); ValueError saying why there is none."""
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


def version_problem(manifest):
    """None, or the line refusing a manifest of a format version this code does not read (one before READ_SINCE,
    one after FORMAT_VERSION, none at all: written before it was recorded), naming the one it has. A manifest that is
    no JSON object is read_manifest's to refuse."""
    if not isinstance(manifest, dict):
        return None
    version = manifest.get("format_version")
    if whole(version, READ_SINCE, FORMAT_VERSION):
        return None  # an older version's own changes are its engine's to judge (manifest.read_manifest)
    if "format_version" not in manifest:
        wrote = f"records no format_version: accelrun before format {READ_SINCE} wrote it"
    else:
        wrote = f"records format_version {shown(version)}: another version of accelrun wrote it"
    return f"{MANIFEST} {wrote}, and this code reads format {readable_versions()} only (resume it with the code that " \
           f"wrote it)"


def readable_versions():
    """The format versions this code reads, in words: "2", "1 and 2", "1 to 3"."""
    if READ_SINCE == FORMAT_VERSION:
        return f"{FORMAT_VERSION}"
    return f"{READ_SINCE} {'and' if FORMAT_VERSION == READ_SINCE + 1 else 'to'} {FORMAT_VERSION}"


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
WINDOW_STATE = {"loss_sums": lambda v: isinstance(v, list) and all(_number(x) for x in v), "micro": whole,
                "data_time": lambda v: _number(v) and v >= 0, "compute_time": lambda v: _number(v) and v >= 0}


def state_problem(manifest):
    """None, or why a manifest's train_state is not one Run writes (TRAIN_STATE): a field missing, unknown, or of
    another type or range; a step other than the manifest's; a log window of another world size."""
    state = manifest["train_state"]
    problem = _fields_problem(state, TRAIN_STATE) or (_fields_problem(state["window"], WINDOW_STATE)
                                                      if state["window"] else None)
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


def training_state(path):
    """The train_state of the checkpoint at `path` (read_json), of a format version this code reads and of the
    fields and ranges Run writes (state_problem); ValueError saying why there is none. Its files are not looked at:
    the stop command asks only which step a run saved, whether for a stop, and where it wrote."""
    manifest = read_json(path)
    problem = version_problem(manifest)
    if problem:
        raise ValueError(problem)
    if not (isinstance(manifest, dict) and whole(manifest.get("step")) and isinstance(manifest.get("train_state"), dict)
            and isinstance(manifest.get("layout"), dict) and whole(manifest["layout"].get("world_size"), 1)):
        raise ValueError(f"{MANIFEST} is not a manifest this code wrote")
    problem = state_problem(manifest)
    if problem:
        raise ValueError(f"{MANIFEST}: {problem}")
    return manifest["train_state"]
