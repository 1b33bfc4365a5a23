"""Where a run's results go, and how they are written there.

Owns the output directory (docs/measuring.md, "Where results go"), one rule for every recipe:
  * a run writes where --output-dir says, or else where its recipe's default says (runs/<recipe>/<how it runs>);
    a run that continues its --checkpoint-dir without --output-dir writes where the run it continues wrote, when
    that recorded path has the recipe's own default form (relative, plain names, no link on the way): a string
    from a checkpoint is never a place to write otherwise;
  * a run never writes into a directory that holds another run's results: run.json names the run that writes a
    directory (its id, kept in its checkpoints, so a resumed run is the same run). Without --output-dir the run
    takes the next free name (runs/mnist/1proc-2) and says so; a --output-dir that holds another run's results is
    refused in one line at start-up, before any data or model is loaded;
  * every result file is written as a new file renamed over its name (write_file, open_log), so a link planted at a
    result's name is replaced, never followed, and a reader never sees half a file.
"""

import json
import os
import re
import secrets
import stat
import tempfile

MARK = "run.json"  # {"run_id", "recipe"}: which run writes this directory
# What makes a directory hold a run's results (the recipe's files; finetune_lm's exported directories).
RESULTS = ("summary.json", "metrics.jsonl", "eval.jsonl", "model.safetensors", "model", "adapter")
RUN_ID = re.compile(r"[0-9a-f]{32}")
MARK_MAX_BYTES = 4096


def new_run_id():
    return secrets.token_hex(16)


def continued(checkpoint, checkpoint_dir):
    """(run id, its recorded output directory) of the run that wrote `checkpoint` ((path, manifest)) when this run
    continues it: the checkpoint is in this run's --checkpoint-dir. Otherwise (a fresh start; a checkpoint from
    elsewhere, which starts a branch and leaves the original's results alone) a new id and None."""
    if checkpoint and checkpoint_dir and (os.path.realpath(os.path.dirname(checkpoint[0]))
                                          == os.path.realpath(checkpoint_dir)):
        state = checkpoint[1].get("train_state") or {}
        if isinstance(state.get("run_id"), str) and RUN_ID.fullmatch(state["run_id"]):
            return state["run_id"], state.get("output_dir")
    return new_run_id(), None


def default_form(path, recipe):
    """Whether `path` (a recorded output directory) is one this recipe's defaults make: runs/<recipe>/<name>, relative,
    of plain names, with no symbolic link on the way."""
    if not (isinstance(path, str) and re.fullmatch(rf"runs/{re.escape(recipe)}/[A-Za-z0-9][A-Za-z0-9._-]{{0,99}}",
                                                   path)):
        return False
    parts = path.split("/")
    for depth in range(1, len(parts) + 1):
        try:
            if stat.S_ISLNK(os.lstat(os.path.join(*parts[:depth])).st_mode):
                return False
        except FileNotFoundError:
            return True
        except OSError:
            return False
    return True


def holder(directory):
    """Which run's results `directory` holds: None when it holds none (or does not exist), the run id its run.json
    names, or "" for results of a run that left no run.json (an older version, or not this code's)."""
    try:
        names = set(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return ""
    if not names & set(RESULTS):
        return None  # empty, or only run.json: a run that ended before it wrote anything
    mark = _read_mark(os.path.join(directory, MARK)) if MARK in names else None
    return mark or ""


def _read_mark(path):
    """The run id in run.json, read as any small untrusted file (checkpoint/untrusted.read_small: a regular file of
    this user's, not followed if a link, never blocking, bounded); None if it names none."""
    from .checkpoint.untrusted import read_small  # standard library only, as this module

    try:
        data = read_small(path, MARK_MAX_BYTES)
        run_id = json.loads(data).get("run_id") if len(data) <= MARK_MAX_BYTES else None
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return run_id if isinstance(run_id, str) and RUN_ID.fullmatch(run_id) else None


def _held(directory):
    """The result files `directory` holds, for a message."""
    try:
        return ", ".join(sorted(set(os.listdir(directory)) & set(RESULTS)))
    except OSError:
        return "unreadable"


def choose(given, default, recipe, run_id, recorded=None):
    """(output directory, a line to print or None, an error or None) for the run `run_id`: given (--output-dir),
    else `recorded` (where the run it continues wrote) if it has this recipe's default form, else `default`; a
    directory that holds another run's results is refused when given, and otherwise passed for the next free
    name."""
    if given:
        if holder(given) in (None, run_id):
            return given, None, None
        return None, None, (f"--output-dir {given} holds another run's results ({_held(given)}); this run would "
                            f"overwrite them. Give another --output-dir, or remove that one (rm -r {given}).")
    staying = recorded and recorded != default and default_form(recorded, recipe)
    place = recorded if staying else default
    if holder(place) in (None, run_id):
        note = (f"results: in {place}, with the run this checkpoint comes from (not {default}; give --output-dir "
                f"to write elsewhere)") if staying else None
        return place, note, None
    n = 2
    while holder(f"{place}-{n}") not in (None, run_id):
        n += 1
    return f"{place}-{n}", (f"results: {place} holds another run's results ({_held(place)}); this run writes "
                            f"{place}-{n} (give --output-dir to choose)"), None


def mark(directory, run_id, recipe):
    """Main process: run.json in `directory` (made if need be), naming the run that writes it."""
    os.makedirs(directory, exist_ok=True)
    write_file(os.path.join(directory, MARK), json.dumps({"run_id": run_id, "recipe": recipe}) + "\n")


def write_file(path, data):
    """`data` (str or bytes) as the file `path`: a new file renamed over the name, so whatever was at `path` (a
    link included) is replaced, never followed or written through."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def open_log(path, lines=()):
    """A log file at `path` to append to, starting with `lines`: a new file renamed over the name at once (a link
    there is replaced, never followed), kept open."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    f = os.fdopen(fd, "w")
    f.writelines(lines)
    f.flush()
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return f


def written_by(path, writer):
    """`path` written by writer(name), a writer that takes a path (safetensors' save_file): into a fresh name beside
    it (created by this process, never an existing file or a link), then renamed over `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=os.path.dirname(path) or ".")
    os.close(fd)
    try:
        writer(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
