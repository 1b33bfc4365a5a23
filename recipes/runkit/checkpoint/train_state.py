"""The training state Run keeps in a checkpoint's manifest: its fields, their types and ranges, and whether a
manifest's train_state is exactly one Run writes.

Owns TRAIN_STATE and WINDOW (what run.py's Run.start and timing.py's window_state put there) and state_problem,
which checkpoints.py asks before a checkpoint is chosen: a manifest on shared storage is untrusted, and a field of
another type would otherwise surface as a traceback deep in a resume.
"""

from ..results import RUN_ID
from .integrity import whole


def _number(value):
    return type(value) in (int, float)


def _scalar(value):
    return value is None or type(value) in (int, float, bool)


# What Run keeps in a checkpoint's train_state (run.py: the state Run.start makes, saved by Run._save), each field
# with its type and range; a manifest whose train_state holds anything else is not one this code wrote. The window
# (timing.py's window_state) is checked against the layout's world size in state_problem.
TRAIN_STATE = {
    "step": whole, "epoch": whole, "step_in_epoch": whole, "epochs_run": whole,
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
    "stopped": lambda v: type(v) is bool,  # saved for a stop signal (stopping.py's stop command reads it)
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
        return f"its train_state {'lacks' if odd in fields else 'holds an unknown field'} {_shown(odd)}"
    bad = next((k for k, ok in fields.items() if not ok(part[k])), None)
    return f"its train_state's {bad} {_shown(part[bad])} is not of the type and range Run writes" if bad else None


def _shown(value):
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
