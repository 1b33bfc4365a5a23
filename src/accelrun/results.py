"""Where a run's results go, and how they are written there.

Owns the output directory (docs/measuring.md, "Where results go"), one rule for every recipe:
  * a run writes where --output-dir says, or else where its recipe's default says (runs/<recipe>/<how it runs>);
    a run that continues its --checkpoint-dir without --output-dir writes where the run it continues wrote, when
    that recorded path has the recipe's own default form (relative, plain names, no link on the way): a string
    from a checkpoint is never a place to write otherwise;
  * the directory is judged at start-up, before any data or model is loaded (place_problem): a name on the way
    that is not a directory, a symbolic link at the directory's own name (never written through, whoever made it)
    and trust.py's rule (who may rename entries in it and above it) are refused in one line;
  * a run never writes into a directory that holds another run's results or claim: the run claims its directory
    at start-up with exclusive creation (claim: the directory made, then run.json created with O_EXCL), and run.json
    names the run that writes it (its id, kept in its checkpoints, so a resumed run is the same run). Without
    --output-dir the run takes the next free name (runs/mnist/1proc-2, checked name after name) and says so, so two
    runs started together write two directories; a --output-dir that holds another run's results or claim, or
    results without run.json, is refused in one line. A claim left without results is given back at exit;
  * every result file is written as a new file renamed over its name (write_file, open_log, written_by), and every
    exported directory is written into a private temporary directory then renamed into place (exported_directory),
    so a link planted at a result's name is replaced, never followed, and a reader never sees half a file.
"""

import atexit
import json
import os
import re
import secrets
import shutil
import stat
import tempfile

from . import trust

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
    names, or "" for results of a run that left no run.json (an older version, or not this code's) and for whatever
    is not a directory of its own at that name (a link is never followed: it is nobody's results to write into)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:
        return ""
    try:
        names = set(os.listdir(fd))
        if not names & set(RESULTS):
            return None  # empty, or only run.json: a run that is loading, or one that ended before it wrote anything
        return (_read_mark(MARK, fd) if MARK in names else None) or ""
    finally:
        os.close(fd)


def _read_mark(path, dir_fd=None):
    """The run id in run.json (relative to dir_fd when given), read as any small untrusted file
    (checkpoint/untrusted.read_small: a regular file of this user's, not followed if a link, never blocking,
    bounded); None if it names none."""
    from .checkpoint.untrusted import read_small  # standard library only, as this module

    try:
        data = read_small(path, MARK_MAX_BYTES, dir_fd=dir_fd)
        run_id = json.loads(data).get("run_id") if len(data) <= MARK_MAX_BYTES else None
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return run_id if isinstance(run_id, str) and RUN_ID.fullmatch(run_id) else None


def _held(directory):
    """The result files `directory` holds, for a message (run.json alone: a run that claimed it)."""
    try:
        names = set(os.listdir(directory))
    except OSError:
        return "unreadable"
    return ", ".join(sorted(names & set(RESULTS))) or (MARK if MARK in names else "nothing")


def _kind(mode):
    """What a non-directory is, in words."""
    for test, word in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISREG, "a file"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return word
    return "not a directory"


def place_problem(path, what):
    """None, or the one line refusing `path` as an output directory (`what`: the flag or role, for the message):
    a name on the way that is not a directory (a file someone put at runs/mnist, /dev/null), the directory's own
    name holding a symbolic link (results are never written through one), and trust.py's rule on who may rename
    entries in it and the directories above it."""
    parts = os.path.normpath(path).split(os.sep)
    for depth in range(1, len(parts) + 1):
        prefix = os.sep.join(parts[:depth]) or os.sep
        try:
            st = os.lstat(prefix)
        except FileNotFoundError:
            break
        except OSError as exc:
            return f"{what} {path}: {prefix} cannot be examined ({exc.strerror}). Give a directory of your own."
        last = depth == len(parts)
        if stat.S_ISDIR(st.st_mode) or (stat.S_ISLNK(st.st_mode) and not last):
            continue  # a link above the directory: trust.refusal judges who may point it elsewhere
        it = "it" if last else prefix
        if stat.S_ISLNK(st.st_mode):
            return (f"{what} {path}: it is a symbolic link (owned by {trust.who(st.st_uid)}, to "
                    f"{os.readlink(prefix)!r}), and results are never written through a link. Give the directory "
                    f"itself" + ("" if what == "--output-dir" else ", or --output-dir") + ".")
        where = "there" if last else "under it"
        return (f"{what} {path}: {it} is {_kind(st.st_mode)} (owned by {trust.who(st.st_uid)}), not a directory, "
                f"so results cannot go {where}. Give --output-dir a directory of your own.")
    return trust.refusal(path, what)


def choose(given, default, recipe, run_id, recorded=None):
    """(output directory, a line to print or None, an error or None) for the run `run_id`, claimed for it (claim):
    given (--output-dir), else `recorded` (where the run it continues wrote) if it has this recipe's default form,
    else `default`. Each is judged first (place_problem). A directory that holds another run's results or claim is
    refused when given, and otherwise passed for the next free name, checked name after name until one is claimed."""
    if given:
        taken, error = _take(given, run_id, recipe, "--output-dir")
        if taken:
            rm = "" if taken.startswith("belongs") else f", or remove that one (rm -r {given})"
            over = "; this run would overwrite them" if taken.startswith("holds") else ""
            error = f"--output-dir {given} {taken}{over}. Give another --output-dir{rm}."
        return (None if error else given), None, error
    staying = recorded and recorded != default and default_form(recorded, recipe)
    place = recorded if staying else default
    taken, error = _take(place, run_id, recipe, "results")
    if error or not taken:
        note = (f"results: in {place}, with the run this checkpoint comes from (not {default}; give --output-dir "
                f"to write elsewhere)") if staying else None
        return (None, None, error) if error else (place, note, None)
    n = 2
    while (found := _take(f"{place}-{n}", run_id, recipe, "results")) and found[0]:  # until a name is claimed
        n += 1
    if found[1]:
        return None, None, found[1]
    return f"{place}-{n}", f"results: {place} {taken}; this run writes {place}-{n} (give --output-dir to choose)", None


def _take(directory, run_id, recipe, what):
    """(why `directory` is another's, or None when it is now the run `run_id`'s (claim); the one line refusing it
    as an output directory, or None)."""
    error = place_problem(directory, what)
    if error:
        return None, error
    try:
        if claim(directory, run_id, recipe):
            return None, None
        st = os.lstat(directory)
    except OSError as exc:
        return None, (f"{what} {directory}: it cannot be made this run's ({exc.strerror or exc}). Give --output-dir a "
                      f"directory of your own.")
    if st.st_uid not in (os.geteuid(), trust.ROOT):
        return f"belongs to {trust.who(st.st_uid)}, whose results go there", None
    if holder(directory) in (None, run_id):
        return (f"is claimed by another run (its {MARK}, and no results yet: a run that is loading, or one killed "
                f"before it wrote any)"), None
    return f"holds another run's results ({_held(directory)})", None


def claim(directory, run_id, recipe):
    """Main process: whether `directory` is now the run `run_id`'s, claimed atomically: the directory made if need
    be (never through a link), then its run.json created with exclusive creation (O_EXCL), so that of two runs
    started together only one claims a name and the other takes the next. True also when its run.json already names
    this run (a continued run); False when it belongs to another user, holds another run's results, or its run.json
    names another run. A claim this run leaves without results is given back when the process ends (release)."""
    parent = os.path.dirname(directory)
    if parent:
        os.makedirs(parent, exist_ok=True)
    made = True
    try:
        os.mkdir(directory)
    except FileExistsError:
        made = False
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)  # a link planted since: refused here
    try:
        if os.fstat(fd).st_uid not in (os.geteuid(), trust.ROOT) or holder(directory) not in (None, run_id):
            return False
        try:
            mark_fd = os.open(MARK, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=fd)
        except FileExistsError:
            return _read_mark(MARK, fd) == run_id
        with os.fdopen(mark_fd, "w") as f:
            f.write(json.dumps({"run_id": run_id, "recipe": recipe}) + "\n")
    finally:
        os.close(fd)
    atexit.register(release, os.path.abspath(directory), run_id, made)  # the same place, whatever the cwd then
    return True


def release(directory, run_id, made=False):
    """Give back the claim of the run `run_id` on `directory` if it wrote no results there: its run.json removed,
    and the directory too when this run made it and that leaves it empty (a run refused after start-up leaves no
    name taken)."""
    try:
        if holder(directory) is None and _read_mark(os.path.join(directory, MARK)) == run_id:
            os.unlink(os.path.join(directory, MARK))
            if made:
                os.rmdir(directory)
    except OSError:
        pass  # not empty, or gone: nothing of another's is removed


def mark(directory, run_id, recipe):
    """Main process: run.json in `directory` (claimed by choose, a directory of its own, never a link), naming the
    run that writes it."""
    if not stat.S_ISDIR(os.lstat(directory).st_mode):
        raise NotADirectoryError(f"{directory} is no longer a directory of this run's: its results are not written")
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


def exported_directory(output_dir, name, writer):
    """OUTPUT_DIR/name, a directory writer(path) fills (save_pretrained's, a tokenizer's): written into a private
    temporary directory (mkdtemp, mode 0700: no one else can plant a link in it while it is written), then given
    the usual mode and renamed into place; what was at the name (an earlier export of this run, or a link) is
    moved aside, never written through, and removed once the new one is in place (without following links).
    Returns its path."""
    final = os.path.join(output_dir, name)
    fresh = tempfile.mkdtemp(prefix=f".{name}.", dir=output_dir)
    aside = None
    try:
        writer(fresh)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(fresh, 0o777 & ~umask)
        if os.path.lexists(final):
            aside = tempfile.mkdtemp(prefix=f".{name}.replaced.", dir=output_dir)
            os.rename(final, os.path.join(aside, name))
        os.rename(fresh, final)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)  # an earlier export moved aside stays there, hidden, not lost
        raise
    if aside:
        shutil.rmtree(aside, ignore_errors=True)  # rmtree never follows a link: only the old entries go
    return final
