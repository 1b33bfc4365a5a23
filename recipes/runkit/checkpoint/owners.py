"""Whose entries a run may use in a directory that others can write into, and how many it looks at.

Owns two rules of --checkpoint-dir (docs/checkpoints.md, the threat model), asked wherever an entry is chosen,
counted, read or removed (checkpoints.py, dirlock.py, integrity.py, the stop command):
  * a run uses only what belongs to the user it runs as: a step directory, every file read from it, the lock.
    In a shared directory with the sticky bit, another user may create entries of their own beside this user's,
    and cannot remove or rename this user's; their entries are passed over with one line each, never read,
    counted or removed, and never stop a run (mine, who);
  * what planted entries can cost is bounded: at most INSPECTED step-* entries are read (newest first) and at
    most SHOWN of those passed over are named one per line, the rest counted in one more line (Passed).
"""

import os
import pwd
import sys

INSPECTED = 1000  # step-* entries whose manifests one choice reads, newest first
SHOWN = 10  # entries passed over that are named, one line each; the rest are counted in one line


def mine(st):
    """Whether the entry whose (l)stat result is `st` belongs to the user this process runs as."""
    return st.st_uid == os.geteuid()


def who(uid):
    """A user, as a message names them: `user NAME (uid N)`, or `uid N` when the name is unknown here."""
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def theirs(st):
    """None for this user's entry, else why a run passes it over, naming its owner (to follow `it` or a name)."""
    if mine(st):
        return None
    return (f"belongs to {who(st.st_uid)}, not to {who(os.geteuid())}: a run uses only its own user's files (copy "
            f"them to use them)")


class Passed:
    """The entries one pass over a directory left alone, reported as warnings: the first SHOWN by name, each once per
    run, and one line counting the rest, so that a directory of 100,000 planted entries costs a few lines."""

    def __init__(self, verb="skipping"):
        self.verb, self.named, self.unnamed = verb, set(), 0

    def add(self, path, why):
        if path in self.named:
            return
        if len(self.named) < SHOWN:
            self.named.add(path)
            print(f"warning: {self.verb} {path}: {why}", file=sys.stderr, flush=True)
        else:
            self.unnamed += 1

    def close(self, where):
        """The line counting what was not named (if anything), once per pass."""
        if self.unnamed:
            print(f"warning: {self.verb} {self.unnamed} more entries in {where} (the first {SHOWN} are named above)",
                  file=sys.stderr, flush=True)
            self.unnamed = 0
