"""Reading what others may have written: a --checkpoint-dir lives on shared storage, and every entry in it is
untrusted (docs/checkpoints.md, the threat model). Standard library only.

Owns the one way a file there is opened and a small one read (a manifest, a lock), for the checkpoint code and the
stop command alike: O_NOFOLLOW, so that a link is refused, never followed; O_NONBLOCK, so that opening a FIFO never
blocks; then, from the descriptor, its kind (a regular file), its owner (this user: owners.py) and its size, all
before a byte is read; a small file is read only up to its limit (open_regular, read_small). And how a value read
from such a file is checked and shown in a message (whole, shown).
"""

import errno
import os
import stat

from ..exits import cut
from .owners import theirs

VALUE_SHOWN = 40  # characters of a value read from an untrusted file that a message shows: enough to recognise it


class RefusedFile(OSError):
    """A file that is not what this code writes: not a regular file of this user's, or not its recorded size."""


class Missing(RefusedFile):
    """Nothing is at the path."""


class TooLarge(RefusedFile):
    """A regular file of this user's, larger than what is read of its kind."""


def kind(mode):
    """What a non-regular file is, in words."""
    for test, word in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return word
    return "not a regular file"


def open_regular(path, size=None, name=None, dir_fd=None, limit=None):
    """The regular file at `path` (relative to dir_fd when given), opened for reading: O_NONBLOCK, so that opening
    a FIFO never blocks; O_NOFOLLOW, so that a link is refused, never followed; its kind, owner (this user: owners.py),
    size (`size` bytes when given) and bound (at most `limit` bytes when given) from the descriptor. Else RefusedFile
    naming it `name` (default the path): Missing, TooLarge, or another kind."""
    name = name or path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last component is a symbolic link
            raise RefusedFile(f"{name} is a symbolic link, not a file a save writes") from None
        if isinstance(exc, FileNotFoundError):
            raise Missing(f"{name} is missing") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefusedFile(f"{name} is {kind(st.st_mode)}, not a file a save writes")
        if theirs(st):
            raise RefusedFile(f"{name} {theirs(st)}")
        if size is not None and st.st_size != size:
            raise RefusedFile(f"{name} does not match its recorded size and checksum (truncated or overwritten)")
        if limit is not None and st.st_size > limit:
            raise TooLarge(f"{name} is over {limit} bytes")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_small(path, limit, name=None, dir_fd=None):
    """The bytes of the small file at `path` (relative to dir_fd when given): open_regular's checks with `limit`,
    then at most `limit` bytes read (one more, so that a file that grew since its check reads as too long to its
    parser)."""
    with open_regular(path, name=name, dir_fd=dir_fd, limit=limit) as f:
        return f.read(limit + 1)


def whole(value, low=0, high=1 << 62):
    """Whether `value` is an int (not a bool) within [low, high]."""
    return type(value) is int and low <= value <= high


def shown(value, limit=VALUE_SHOWN):
    """A value read from an untrusted file, for a message: its repr, cut to `limit` characters (exits.cut)."""
    return cut(repr(value), limit)
