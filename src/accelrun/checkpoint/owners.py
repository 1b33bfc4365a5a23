"""Whose entries a run may use in a directory that others can write into, and how many it looks at.

Owns two rules of --checkpoint-dir (docs/checkpoints.md, the threat model), asked wherever an entry is chosen,
counted, read or removed (choose.py, rotate.py, lock.py, untrusted.py, held.py, the stop command):
  * a run uses only what belongs to the user it runs as: a step directory, every file read from it, the lock.
    In a shared directory with the sticky bit, another user may create entries of their own beside this user's,
    and cannot remove or rename this user's; their entries are passed over with one line each, never read,
    counted or removed, and never stop a run (mine, who);
  * what planted entries can cost is bounded: at most INSPECTED step-* entries are read (newest first) and at
    most SHOWN of those passed over are named one per line, the rest counted in one more line (Passed); own_steps
    applies both to a directory's step-* entries. Standard library only.
"""

import os
import sys

from ..trust import who
from .layout import steps

INSPECTED = 1000  # step-* entries whose manifests one choice reads, newest first
SHOWN = 10  # entries passed over that are named, one line each; the rest are counted in one line


def mine(st):
    """Whether the entry whose (l)stat result is `st` belongs to the user this process runs as."""
    return st.st_uid == os.geteuid()


def theirs(st):
    """None for this user's entry, else why a run passes it over, naming its owner (to follow `it` or a name)."""
    return None if mine(st) else _not_mine(st.st_uid)


def _not_mine(uid):
    return (f"belongs to {who(uid)}, not to {who(os.geteuid())}: a run uses only its own user's files (copy them "
            f"to use them)")


class Passed:
    """The entries one pass over a directory left alone, reported as warnings: the first SHOWN by name, each once per
    run, and one line counting the rest, so that a directory of 100,000 planted entries costs a few lines."""

    def __init__(self, verb="skipping"):
        self.verb, self.named, self.unnamed = verb, set(), 0

    def add(self, path, why):
        """Pass over `path` for `why`: the reason, or a function giving it, called only when the entry is named (a
        pass over 100,000 planted entries builds ten messages, not 100,000)."""
        if path in self.named:
            return
        if len(self.named) < SHOWN:
            self.named.add(path)
            print(f"warning: {self.verb} {path}: {why() if callable(why) else why}", file=sys.stderr, flush=True)
        else:
            self.unnamed += 1

    def close(self, where):
        """The line counting what was not named (if anything), once per pass."""
        if self.unnamed:
            print(f"warning: {self.verb} {self.unnamed} more entries in {where} (the first {SHOWN} are named above)",
                  file=sys.stderr, flush=True)
            self.unnamed = 0


def own_steps(directory, passed):
    """[(step, path)] of this user's step-* directories in `directory`, newest first, at most INSPECTED of them ([]
    when it cannot be listed). Another user's entries are passed over (passed.add, naming the owner, when `passed` is
    given), and so are those beyond the bound, counted in one line; neither is ever counted or read."""
    found, me = [], os.geteuid()
    for step, path in reversed(steps(directory)):
        try:
            uid = os.lstat(path).st_uid
        except OSError:
            continue
        if uid != me:  # one lstat per entry; the owner's name looked up only for the few named (trust.who, cached)
            if passed:
                passed.add(path, lambda uid=uid: f"it {_not_mine(uid)}")
            continue
        found.append((step, path))
    if len(found) > INSPECTED and passed:
        print(f"warning: {directory} holds {len(found)} step-* entries of this user's; only the newest {INSPECTED} "
              f"were looked at (remove the others)", file=sys.stderr, flush=True)
    return found[:INSPECTED]
