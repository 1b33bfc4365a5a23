"""A directory's files checked as a run checks a held checkpoint's (accelrun.checkpoint.held), for the tests that need
no launch: shared by test_integrity.py and test_hostile_checkpoint_dir.py. The run itself never calls these."""

import os

from accelrun.checkpoint.files import matches
from accelrun.checkpoint.held import HeldCheckpoint
from accelrun.checkpoint.untrusted import RefusedFile


def check_loadable(root, rels, files=None):
    """None, or why one of `rels` under root cannot be loaded as weights only, or reaches beyond `files` (a
    manifest's table; default: rels at whatever size they have). HeldCheckpoint.loadable on a directory."""
    files = files or {rel: {"size": None} for rel in rels}
    with HeldCheckpoint(str(root), files) as held:
        try:
            held.hold()
        except RefusedFile as exc:
            return str(exc)
        if files and any(want.get("size") is None for want in files.values()):  # sizes the storage check needs
            held.files = {rel: {**want, "size": os.fstat(held.held[rel].fileno()).st_size}
                          for rel, want in files.items()}
        return held.loadable(rels)


def check_files(root, expected):
    """None, or what is wrong with the first of `expected` ({rel: {size, <checksum>}}) that does not match."""
    with HeldCheckpoint(str(root), expected) as held:
        try:
            held.hold()
        except RefusedFile as exc:
            return str(exc)
        for rel, want in sorted(expected.items()):
            if not matches(held.held[rel].fileno(), want):
                return f"{rel} does not match its recorded size and checksum (truncated or overwritten)"
    return None
