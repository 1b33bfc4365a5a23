"""--checkpoint-dir: checkpoints that lose nothing, one module per stage behind one small Checkpointer.

Run calls two names: lock_directory() at start-up and Checkpointer for the rest (save, choose, load, release); a run
with no --checkpoint-dir (and no --resume PATH) uses NoCheckpoints and imports none of the package's other modules.
accelrun/__init__.py's table lists the package's modules with the one concern each owns; docs/checkpoints.md is the
design and its threat model.

Both names are imported when asked for (PEP 562): the standard-library modules here (layout, owners, untrusted,
lock) import without torch or accelerate, so that the stop command (accelrun/stop.py) runs with the standard
library alone.
"""

__all__ = ["Checkpointer", "lock_directory"]


def no_times():
    """The summary's checkpoint times before any save or resume: the saves' seconds summed by part (accelerate's
    write, the checksums, the flush to disk, the publish: the manifest and the rename), and the resume's
    verification (the choice: manifests, checksums and formats checked by every rank) and load."""
    return {"saves": 0, "save_write_s": 0.0, "save_checksum_s": 0.0, "save_flush_s": 0.0, "save_publish_s": 0.0,
            "resume_verify_s": None, "resume_load_s": None}


class NoCheckpoints:
    """What Run asks of a Checkpointer, for a run that keeps none: nothing to choose, save or release."""

    last_saved_step = newest = None

    def __init__(self):
        self.reshaped, self.times = [], no_times()

    def choose(self, spec):
        return None

    def release(self):
        pass


def __getattr__(name):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import checkpointer

    value = getattr(checkpointer, name)
    globals()[name] = value  # once: later lookups find it here
    return value
