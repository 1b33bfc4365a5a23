"""Checkpoints that lose nothing: save, verify, choose and load them.

Owns --checkpoint-dir, its layout and its rotation; the run object (run.py) decides when to save.

Layout of --checkpoint-dir:

    step-00000120/      a complete checkpoint: accelerate's save_state files plus
                        checkpoint.json (training state, world size, and the size and
                        SHA-256 of every file), written last
    .tmp-step-00000130/ a save in progress, or one a crash interrupted: never loaded

Every rank calls save() and resume(): accelerate's save_state/load_state are collective
under DeepSpeed and FSDP (each rank writes and reads its own shards).
A checkpoint becomes visible by one atomic rename, after every rank has finished writing
and the main process has recorded the checksums, so a kill at any moment leaves either
the old set of checkpoints or the old set plus one complete new one.
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import sys

from accelerate.utils import DistributedType, broadcast_object_list

from .checks import engine, fail
from .stopping import add_stop_args
MANIFEST = "checkpoint.json"
NAME = re.compile(r"^step-(\d{8})$")


def count(text):
    """argparse type: a whole number >= 0 (a negative --keep-last would slice the checkpoint list backwards)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number, 0 or more")
    return value


def add_checkpoint_args(parser):
    group = parser.add_argument_group("checkpoints and stopping (docs/checkpoints.md)")
    group.add_argument("--checkpoint-dir", default=None,
                       help="save checkpoints here (must be storage every node sees); off when not given")
    group.add_argument("--checkpoint-every", type=count, default=0,
                       help="also save every N optimizer steps (a checkpoint is always saved at the end of "
                            "each epoch and when stopped by a signal)")
    group.add_argument("--keep-last", type=count, default=2, help="complete checkpoints to keep (0: keep all)")
    group.add_argument("--resume", default="auto",
                       help="auto: newest complete checkpoint in --checkpoint-dir, if any; none: start fresh "
                            "(refused when --checkpoint-dir already holds checkpoints); or the path of one checkpoint")
    add_stop_args(group)


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_table(root):
    table = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if rel != MANIFEST:
                table[rel] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    return table


def verify(path):
    """The checkpoint's manifest, or raise ValueError saying what is wrong with it."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"no {MANIFEST}: the save never finished") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable {MANIFEST} ({exc})") from None
    for rel, expected in manifest.get("files", {}).items():
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            raise ValueError(f"{rel} is missing")
        if os.path.getsize(file) != expected["size"] or _sha256(file) != expected["sha256"]:
            raise ValueError(f"{rel} does not match its recorded size and checksum (truncated or overwritten)")
    return manifest


def _layout(accelerator):
    """What decides whether a checkpoint's files can be read back by this run."""
    # 1 process and DDP store the same full state; DeepSpeed and FSDP store their own formats.
    family = {DistributedType.DEEPSPEED: "deepspeed", DistributedType.FSDP: "fsdp"}.get(
        accelerator.distributed_type, "full")
    return {"family": family, "zero_stage": engine(accelerator)["deepspeed_stage"],
            "world_size": accelerator.num_processes}


class Checkpointer:
    def __init__(self, accelerator, directory, keep_last, must_match):
        """must_match: the recipe's settings a resumed run must share (batch size, seed...)."""
        self.accelerator, self.directory, self.keep_last = accelerator, directory, keep_last
        self.must_match = must_match
        self.last_saved_step = None

    def _complete(self):
        names = os.listdir(self.directory) if os.path.isdir(self.directory) else []
        return sorted((int(m.group(1)), os.path.join(self.directory, n)) for n in names if (m := NAME.match(n)))

    def _agree(self, main_result):
        """Broadcast the main process's (value, error) to every rank; every rank fails on an error."""
        box = [main_result]
        broadcast_object_list(box)
        value, error = box[0]
        if error:
            fail(self.accelerator, error)
        return value

    def save(self, step, train_state):
        """Collective. Skipped when this step is already saved (e.g. end of epoch right after --checkpoint-every)."""
        if step == self.last_saved_step:
            return
        acc, name = self.accelerator, f"step-{step:08d}"
        final, tmp = os.path.join(self.directory, name), os.path.join(self.directory, f".tmp-{name}")
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving this step
            os.makedirs(tmp)
        acc.wait_for_everyone()
        acc.save_state(tmp)
        open(os.path.join(tmp, f"rank-{acc.process_index}.done"), "w").close()
        acc.wait_for_everyone()
        error = None
        if acc.is_main_process:
            try:
                missing = [r for r in range(acc.num_processes) if not os.path.exists(os.path.join(tmp, f"rank-{r}.done"))]
                if missing:
                    raise RuntimeError(f"ranks {missing} wrote their part of the checkpoint somewhere the main "
                                       f"process cannot see: --checkpoint-dir {self.directory!r} must be on "
                                       f"storage shared by every node")
                manifest = {"step": step, "layout": _layout(acc), "must_match": self.must_match,
                            "train_state": train_state, "files": _file_table(tmp)}
                for rel in manifest["files"]:
                    _fsync(os.path.join(tmp, rel))
                with open(os.path.join(tmp, MANIFEST), "w") as f:
                    json.dump(manifest, f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
                shutil.rmtree(final, ignore_errors=True)  # an older save of this very step (a rerun)
                os.replace(tmp, final)  # the moment the checkpoint becomes visible
                _fsync(self.directory)
            except OSError as exc:
                error = f"saving checkpoint {final} failed ({exc}); the earlier checkpoints are untouched"
            except RuntimeError as exc:
                error = str(exc)
        self._agree((None, error))
        self.last_saved_step = step
        if acc.is_main_process:
            print(f"checkpoint saved: {final}", flush=True)
            for _, old in self._complete()[:-self.keep_last] if self.keep_last else []:
                try:
                    shutil.rmtree(old)
                except OSError as exc:  # the new checkpoint is complete: a warning, not an error
                    print(f"warning: --keep-last {self.keep_last}: could not remove the older checkpoint {old} "
                          f"({exc}); remove it by hand", file=sys.stderr, flush=True)

    def resume(self, spec):
        """Collective. Load the checkpoint `spec` names and return its training state, or None to start fresh."""
        acc = self.accelerator
        result = (None, None)
        if acc.is_main_process:
            result = self._refuse_fresh_start() if spec == "none" else self._choose(spec)
        path, manifest = self._agree(result) or (None, None)
        if path is None:
            return None
        saved, now = manifest["layout"], _layout(acc)
        problem = None
        if saved["family"] != now["family"] or saved["zero_stage"] != now["zero_stage"]:
            problem = (f"it was written by {saved['family']} (ZeRO stage {saved['zero_stage']}) and this run is "
                       f"{now['family']} (ZeRO stage {now['zero_stage']}); their files differ")
        elif saved["family"] != "full" and saved["world_size"] != now["world_size"]:
            problem = (f"{saved['family']} shards its state over the {saved['world_size']} processes that wrote "
                       f"it, and this run has {now['world_size']}; relaunch with {saved['world_size']} processes")
        else:
            differ = {k: (v, self.must_match.get(k)) for k, v in manifest["must_match"].items()
                      if self.must_match.get(k) != v}
            if differ:
                problem = "these settings differ from the run that wrote it (saved, now): " + ", ".join(
                    f"{k} {a!r} vs {b!r}" for k, (a, b) in differ.items())
        if problem:
            self._agree((None, f"cannot resume from {path}: {problem}. Use the original settings, or start "
                               f"fresh with another --checkpoint-dir."))
        acc.load_state(path)
        self.last_saved_step = manifest["step"]
        if acc.is_main_process:
            print(f"resumed from {path} (step {manifest['step']}, written by {saved['world_size']} processes)",
                  flush=True)
        return manifest["train_state"]

    def _refuse_fresh_start(self):
        """Main process: --resume none into a directory that holds checkpoints would rotate them away."""
        held = [os.path.basename(p) for _, p in self._complete()] if self.directory else []
        if not held:
            return None, None
        return None, (f"--resume none, but --checkpoint-dir {self.directory} already holds {len(held)} "
                      f"checkpoint(s) ({held[-1]} the newest); starting fresh there would rotate them away. "
                      f"To start fresh, give another --checkpoint-dir (or remove that one); to continue, "
                      f"use --resume auto.")

    def _choose(self, spec):
        """Main process: ((path, manifest), None) or (None, error message)."""
        if spec != "auto":
            if not os.path.isdir(spec):
                return None, (f"--resume {spec}: no such directory. Give the path of a step-* checkpoint "
                              f"directory, or --resume auto for the newest complete one in --checkpoint-dir.")
            try:
                return (spec, verify(spec)), None
            except ValueError as exc:
                return None, (f"checkpoint {spec} cannot be used: {exc}. Pick another one, or --resume auto "
                              f"for the newest complete one.")
        if not self.directory or not os.path.isdir(self.directory):
            return None, None
        for leftover in (n for n in os.listdir(self.directory) if n.startswith(".tmp-")):
            print(f"warning: ignoring {os.path.join(self.directory, leftover)}: a save that never finished",
                  file=sys.stderr, flush=True)
        for _, path in reversed(self._complete()):
            try:
                return (path, verify(path)), None
            except ValueError as exc:
                print(f"warning: skipping checkpoint {path}: {exc}", file=sys.stderr, flush=True)
        return None, None
