"""Which directories a run may write into: a directory is trusted by its owner, as ssh and sudo trust a path.

Owns the one rule asked before a run removes, reads or writes anything in --checkpoint-dir, --output-dir or the
default runs/<recipe>/<how> (checkpoint/lock.py at start-up, choose.py and rotate.py at each pass, results.py, the
stop command): the directory, and every directory above it up to the first one owned by root, must be
  * owned by this user or root and writable by no one else, or writable by others only with the sticky bit (then
    only each entry's owner may rename or remove it).
A directory owned by another user is refused, whatever its mode: its owner may rename anyone's entries there (a
checkpoint renamed away, a save in progress replaced by a link, DIR/$USER replaced by a directory of their own), and
the sticky bit does not bind them. So is any directory writable by others without the sticky bit, whoever owns it.
The walk goes on past this user's own directories (DIR/$USER is only as safe as DIR) and stops at root's. A symbolic
link on the way must be this user's or root's (another user could point it elsewhere).

A user who trusts every writer of a group project directory says so with ACCELRUN_TRUST_SHARED_DIRS=1: then a
directory owned by another user, or writable by its group, is accepted (one writable by everyone still needs the
sticky bit). What it risks: any of those writers can rename this run's checkpoints and results away or replace them,
and redirect a save in progress (docs/checkpoints.md, "Shared storage"). Standard library only; each owner is looked
up once per process.
"""

import functools
import os
import pwd
import stat

# "1": the other writers of a shared directory are trusted (what it risks: the docstring above)
TRUST_ENV = "ACCELRUN_TRUST_SHARED_DIRS"
ROOT = 0


@functools.cache
def who(uid):
    """A user, as a message names them: `user NAME (uid N)`, or `uid N` when the name is unknown here; looked up once
    per uid (a directory of 100,000 entries of one owner asks the user database once)."""
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def shared_dirs_trusted():
    return os.environ.get(TRUST_ENV) == "1"


def _doubt(st):
    """None when the directory whose stat result is `st` can be trusted, else what makes it untrustworthy."""
    trusting = shared_dirs_trusted()
    owner_ok = st.st_uid in (os.geteuid(), ROOT) or trusting
    writers = st.st_mode & (0o002 if trusting else 0o022)
    sticky = st.st_mode & stat.S_ISVTX
    mode = f"mode {stat.S_IMODE(st.st_mode):o}"
    if not owner_ok:
        return (f"is owned by {who(st.st_uid)} ({mode}), who may rename this run's entries there and put others in "
                f"their place, sticky bit or not")
    if writers and not sticky:
        group = "everyone" if st.st_mode & 0o002 else "its group"
        return (f"can be written by {group} without the sticky bit ({mode}): any of them could rename this run's "
                f"entries there and put others in their place")
    return None


def refusal(path, what):
    """None when a run may use the directory `path` (which need not exist yet: its nearest existing ancestor is
    judged) for `what` (the flag or role, for the message); else the one line refusing it, naming the directory, its
    owner and what to do."""
    given = os.path.abspath(path)
    for part in _prefixes(given):
        try:
            st = os.lstat(part)
        except OSError:
            break
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (os.geteuid(), ROOT):
            return _message(what, path, part, f"is a symbolic link owned by {who(st.st_uid)}, who may point it "
                                              f"anywhere")
    directory = os.path.realpath(given)
    while True:
        try:
            st = os.stat(directory)
        except FileNotFoundError:
            parent = os.path.dirname(directory)
            if parent == directory:
                return None
            directory = parent
            continue
        except OSError as exc:
            return _message(what, path, directory, f"cannot be examined ({exc.strerror})")
        if not stat.S_ISDIR(st.st_mode):
            return f"{what} {path}: {directory} is not a directory. Give a directory of your own."
        doubt = _doubt(st)
        if doubt:
            return _message(what, path, directory, doubt, mine=st.st_uid == os.geteuid())
        parent = os.path.dirname(directory)
        if st.st_uid == ROOT or parent == directory:  # past this user's own: DIR/$USER is only as safe as DIR
            return None
        directory = parent


def _prefixes(path):
    """Each ancestor of the absolute `path`, from the root down, `path` itself last."""
    parts = path.split(os.sep)
    return [os.sep.join(parts[:n]) or os.sep for n in range(2, len(parts) + 1)]


def _message(what, path, directory, doubt, mine=False):
    where = "it" if os.path.abspath(path) == directory else directory
    fix = f"Run `chmod go-w {directory}` (or `chmod +t {directory}`, for a shared one), use" if mine else "Use"
    return (f"{what} {path}: {where} {doubt}. {fix} a directory of your own (mkdir -m 700 DIR where every "
            f"directory above is yours or root's, such as your home or /scratch/$USER), or set {TRUST_ENV}=1 if you "
            f"trust every writer of {directory} (docs/checkpoints.md, 'Shared storage': what it risks).")
