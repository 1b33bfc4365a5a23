"""The names and size limits of what a --checkpoint-dir holds: one definition for the checkpoint code and the stop
command (accelrun/stop.py) alike. Standard library only.

    step-00000120/      a complete checkpoint: the engine's files (formats.py), rank-R.done markers and
                        checkpoint.json (manifest.py: the training state, the layout, the size and checksum of
                        every file), written last
    step-00000120.k3x9a2q7/  the same, published under a name of its own when another user holds step-00000120
    .tmp-step-00000130.XXXXXXXX/ a save in progress (a name no one can plant beforehand, mode 0700), or one a
                        crash interrupted: never loaded; removed by the next run once it holds the lock when it
                        still holds .accelrun-saving (the marker a save writes first and removes just before it
                        publishes), else left alone with a warning (lock.py)
    .lock               the run that writes here: host, pid, Slurm job id (lock.py; .lock.<uid>.<random>, a lock
                        of this user's own name where another user holds .lock; .lock.takeover while a stale lock
                        is replaced)

    step-00000120/universal/  derived, not saved: a ZeRO checkpoint's state as DeepSpeed's universal checkpoint,
                        made by the first resume on another world size (resharding.py), with a manifest of its own;
                        the checkpoint's manifest does not list it (nor .tmp-universal/, the conversion in progress)
"""

import os
import re

# The version of the checkpoint format (this layout, formats.py's files, manifest.py's schema) that a manifest
# records; docs/checkpoints.md, "What a format version promises". A change of what a save writes or records moves it
# (tests/test_format_version.py holds that); the versions from READ_SINCE on still load, a checkpoint of any other,
# or of none (those written before it was recorded), is refused by name (train_state.version_problem).
# 2: FSDP2's LoRA checkpoints hold the adapters only (format 1 held the whole model when it began).
# 3: each file's checksum is xxh3_128 (files.CHECKSUMS), not SHA-256; 1 and 2 verify by the SHA-256 they recorded.
FORMAT_VERSION = 3
READ_SINCE = 1  # the oldest format version this code still reads

MANIFEST = "checkpoint.json"  # written last, by the main process: the checkpoint exists once it does
DERIVED, DERIVING = "universal", ".tmp-universal"  # a checkpoint's derived part, and its conversion in progress
TMP = ".tmp-"  # a save in progress begins so: removed by a run taking the lock only when it holds SAVING
SAVING = ".accelrun-saving"  # in a save in progress, written first through its descriptor; never in a checkpoint

# A checkpoint's name: its step, and a suffix of its own when another user's entry holds the plain name.
STEP_NAME = re.compile(r"step-(\d{8})(?:\.[0-9a-z]{8})?")
LOCK = ".lock"
TAKEOVER = ".lock.takeover"  # held (O_EXCL) by the one run replacing a stale lock, for a moment
LOCK_NAMES = re.compile(r"\.lock(?:\.\d+\.[0-9a-f]{8})?")  # .lock, and a user's own where another user holds .lock

# What reading an untrusted entry may cost, checked on the open file before a byte is read: a manifest is a few KB
# (about 600 bytes per rank of the run that wrote it), a lock holds a few fields.
MANIFEST_MAX_BYTES = 4 << 20
# The most processes, and micro-batches per optimizer step, a layout may record: beyond any real run, and small
# enough that the arithmetic a resume does with them (resharding.py) stays exact.
LAYOUT_MAX = 1 << 20
LOCK_MAX_BYTES = 4096


def step_name(step):
    """The name a save of `step` is published under (when no other user holds it)."""
    return f"step-{step:08d}"


def tmp_prefix(name):
    """The start of the name of a save in progress of the checkpoint `name` (a random suffix follows)."""
    return f"{TMP}{name}."


def own_lock_name(uid, token):
    """The lock a run of user `uid` takes where another user holds .lock (token: 8 random hex digits)."""
    return f"{LOCK}.{uid}.{token}"


def is_lock_name(name):
    return LOCK_NAMES.fullmatch(name) is not None


def done_marker(rank):
    """The file each rank writes into a save once its part is written: the main process publishes only when every
    rank's is there (the directory is shared by every node)."""
    return f"rank-{rank}.done"


def steps(directory):
    """[(step, path)] of the step-* entries in `directory`, oldest first ([] when it cannot be listed). Names only:
    whose they are and what they hold is for the caller to check (owners.py, manifest.py)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted((int(m.group(1)), os.path.join(directory, n)) for n in names if (m := STEP_NAME.fullmatch(n)))


def size_limit(parameters):
    """The most a checkpoint of a model of `parameters` elements holds (its files' recorded sizes together): 40 bytes
    per parameter (fp32 weights, two Adam moments, DeepSpeed's half-precision and master copies) and 64 MB besides
    (the RNG states, the scheduler, DeepSpeed's extras). A planted manifest recording more is never hashed."""
    return 40 * parameters + (64 << 20)
