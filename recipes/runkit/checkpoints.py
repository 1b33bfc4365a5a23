"""Checkpoints that lose nothing: save, verify, choose and load them.

Owns --checkpoint-dir: its lock, its layout, saving, choosing and loading, and rotation. When to save is
the run object's decision (run.py, Run._checkpoint_due); what a resumed run may change is resume_rules.py's.

Layout of --checkpoint-dir:

    step-00000120/      a complete checkpoint: accelerate's save_state files plus
                        checkpoint.json (training state, world size, and the size and
                        SHA-256 of every file), written last
    .tmp-step-00000130/ a save in progress, or one a crash interrupted: never loaded,
                        removed by the next run once it holds the lock (a link: unlinked)
    .lock               the run that writes here: host, pid, Slurm job id (one writer per directory)

    step-00000120/universal/  derived, not saved: a ZeRO checkpoint's state as DeepSpeed's universal
                        checkpoint, made by the first resume on another world size, with a manifest of its
                        own; the checkpoint's manifest does not list it (integrity.DERIVED)

Every rank calls save() and resume(): accelerate's save_state/load_state are collective
under DeepSpeed and FSDP (each rank writes and reads its own shards).
A checkpoint becomes visible by one atomic rename, after every rank has finished writing
and the main process has recorded the checksums, so a kill at any moment leaves either
the old set of checkpoints or the old set plus one complete new one. The ranks share the
hashing, and loading never runs code from a file (integrity.py).

Others may write into --checkpoint-dir (docs/checkpoints.md, the threat model): a save writes into a
.tmp directory it created (mode 0700) and publishes it only if it is still that directory; rotation
deletes only checkpoints this run family wrote, older than the one just saved, and never follows a link.
"""

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import stat
import sys
import time

import numpy as np
import torch
from accelerate.utils import DistributedType, broadcast_object_list, gather_object
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException  # FSDP's sharded saves and loads raise it

from .dirlock import take
from .exits import fail
from .integrity import (
    DERIVED,
    DERIVING,
    MANIFEST,
    UnsafeCheckpointFile,
    check_files,
    check_loadable,
    file_table,
    fsync,
    listing,
    my_share,
    read_manifest,
    weights_only_loading,
)
from .resume_rules import incompatibility, layout, reshaped
from .stopping import add_stop_args

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
                       help="save every N optimizer steps instead of at each epoch's end (0: at each epoch's end); "
                            "the last step and a stop by a signal are always saved")
    group.add_argument("--keep-last", type=count, default=2, help="complete checkpoints to keep (0: keep all)")
    group.add_argument("--resume", default="auto",
                       help="auto: newest complete checkpoint in --checkpoint-dir, if any; none: start fresh "
                            "(refused when --checkpoint-dir already holds checkpoints); or the path of one checkpoint")
    add_stop_args(group)


def write_manifest(directory, manifest):
    """directory/checkpoint.json, written once (never over a file or through a link another wrote) and synced."""
    fd = os.open(os.path.join(directory, MANIFEST), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def agree(accelerator, main_result):
    """Collective: broadcast the main process's (value, error) to every rank; every rank fails on an error."""
    box = [main_result]
    broadcast_object_list(box)
    value, error = box[0]
    if error:
        fail(accelerator, error)
    return value


def lock_directory(accelerator, directory):
    """Collective: take --checkpoint-dir's lock (one writer per directory) on the main process, at start-up,
    so a second run on it stops in seconds, before it loads data or a model. Returns the lock (main process)."""
    lock, error = take(directory) if accelerator.is_main_process else (None, None)
    agree(accelerator, (None, error))
    return lock


class Checkpointer:
    def __init__(self, accelerator, directory, keep_last, must_match, model, lock, grad_accum=1):
        """must_match: the settings a resumed run must share (resume_rules.settings); model: the prepared model,
        whose per-rank buffers FSDP needs kept; lock: lock_directory()'s, taken at start-up; grad_accum: this
        run's accumulation steps, recorded in the layout (a resume may change it: resume_rules.RESHAPE)."""
        self.accelerator, self.directory, self.keep_last = accelerator, directory, keep_last
        self.must_match, self.model, self.lock = must_match, model, lock
        self.layout = layout(accelerator, grad_accum)
        self.reshaped = []  # what the resume changed (world size, --grad-accum) and the rules that applied
        self.last_saved_step = None
        self.reported = set()  # step-* entries rotation left alone, each reported once
        self.times = {"saves": 0, "save_write_s": 0.0, "save_checksum_s": 0.0, "resume_verify_s": None,
                      "resume_load_s": None}
        self.save_kwargs, self.load_kwargs = self._leave_out_frozen(model)

    def _leave_out_frozen(self, model):
        """(save_state, load_state) keyword arguments. Frozen parameters (LoRA's base model) are loaded again
        from the model the run starts from, which must_match pins, so checkpoints leave them out where the
        engine allows: DeepSpeed's module files, and the model file without DeepSpeed or FSDP. FSDP's sharded
        save takes the whole state dict (accelerate has no filter for it), each rank writing its shard."""
        plain = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        frozen = {name for name, p in plain.named_parameters() if not p.requires_grad}
        engine = self.accelerator.distributed_type
        if not frozen or engine == DistributedType.FSDP:
            return {}, {}
        if engine == DistributedType.DEEPSPEED:
            return {"exclude_frozen_parameters": True}, {"load_module_strict": False}

        def trainable_only(models, weights, output_dir):  # accelerate calls it with each model's state dict
            for state in weights:  # named as in the model, or behind DDP's module. and compile's _orig_mod.
                for key in [k for k in state if k.removeprefix("module.").replace("_orig_mod.", "") in frozen]:
                    del state[key]
        self.accelerator.register_save_state_pre_hook(trainable_only)
        return {}, {"strict": False}

    def _complete(self):
        names = os.listdir(self.directory) if os.path.isdir(self.directory) else []
        return sorted((int(m.group(1)), os.path.join(self.directory, n)) for n in names if (m := NAME.match(n)))

    def _all_ranks(self, *problems):
        """Collective: for each kind of problem (a string or None per rank), the first rank's, or None."""
        acc = self.accelerator
        per_rank = gather_object([problems]) if acc.num_processes > 1 else [problems]
        return [next((f"rank {r}: {p[i]}" if acc.num_processes > 1 else p[i] for r, p in enumerate(per_rank) if p[i]),
                     None) for i in range(len(problems))]

    def save(self, step, train_state):
        """Collective: write step-NNNNNNNN, verify and publish it, then rotate the older ones."""
        acc, name = self.accelerator, f"step-{step:08d}"
        final, tmp = os.path.join(self.directory, name), os.path.join(self.directory, f".tmp-{name}")
        agree(self.accelerator, (None, self.lock.lost() if self.lock else None))  # another run took the directory over
        started = time.perf_counter()
        made, error = None, None
        if acc.is_main_process:
            try:
                remove_entry(tmp)  # left by a run killed while saving this step, or a planted link
                os.mkdir(tmp, 0o700)  # only this user writes in it
                made = _identity(tmp)
            except OSError as exc:
                error = f"saving checkpoint {final} failed: cannot create {tmp} ({exc}); the earlier checkpoints " \
                        f"are untouched"
        agree(self.accelerator, (None, error))
        try:
            acc.save_state(tmp, **self.save_kwargs)
            self._save_rank_buffers(tmp)
            open(os.path.join(tmp, f"rank-{acc.process_index}.done"), "w").close()
        except (OSError, RuntimeError, CheckpointException) as exc:  # a full disk (torch.save: RuntimeError),
            free = shutil.disk_usage(tmp).free / 1e6 if os.path.isdir(tmp) else float("nan")  # this rank's exit
            print(f"error: saving checkpoint {final} failed on rank {acc.process_index} ({type(exc).__name__}: "
                  f"{(str(exc).splitlines() or [''])[0][:200]}; {free:.1f} MB left on its file system); the earlier "
                  f"checkpoints are untouched. Free space and run the same command again to resume from the newest "
                  f"of them.", file=sys.stderr, flush=True)  # makes the launcher stop the others
            sys.exit(2)
        acc.wait_for_everyone()
        written = time.perf_counter()
        # Every rank hashes and syncs its share: the files it wrote, and its turn of the others.
        table, error, seen = {}, None, []
        try:
            seen = listing(tmp)
            mine = my_share(seen, acc.process_index, acc.num_processes)
            table = file_table(tmp, mine)
            for rel in mine:
                fsync(os.path.join(tmp, rel))
        except OSError as exc:  # RefusedFile too: a link or FIFO where this save wrote a file
            error = f"rank {acc.process_index}: {exc}"
        tables = gather_object([(table, error)]) if acc.num_processes > 1 else [(table, error)]
        error = None
        if acc.is_main_process:
            try:
                missing = [r for r in range(acc.num_processes)
                           if not os.path.exists(os.path.join(tmp, f"rank-{r}.done"))]
                if missing:
                    raise RuntimeError(f"ranks {missing} wrote their part of the checkpoint somewhere the main "
                                       f"process cannot see: --checkpoint-dir {self.directory!r} must be on "
                                       f"storage shared by every node")
                files = {}
                for part, problem in tables:
                    if problem:
                        raise OSError(problem)
                    files.update(part)
                unhashed = sorted(set(seen) - set(files))  # seen only by this rank (none on shared storage)
                files.update(file_table(tmp, unhashed))
                manifest = {"step": step, "layout": self.layout, "must_match": self.must_match,
                            "train_state": train_state, "files": files}
                self._still_ours(tmp, made, final)
                write_manifest(tmp, manifest)
                remove_entry(final)  # an older save of this very step (a rerun), or a planted link
                self._still_ours(tmp, made, final)
                os.replace(tmp, final)  # the moment the checkpoint becomes visible
                fsync(self.directory)
            except OSError as exc:
                error = f"saving checkpoint {final} failed ({exc}); the earlier checkpoints are untouched"
                if _identity(tmp) == made:
                    shutil.rmtree(tmp, ignore_errors=True)  # a full disk: give back what this save took
            except RuntimeError as exc:
                error = str(exc)
        agree(self.accelerator, (None, error))
        self.last_saved_step = step
        done = time.perf_counter()
        self.times["saves"] += 1
        self.times["save_write_s"] += written - started
        self.times["save_checksum_s"] += done - written
        if acc.is_main_process:
            print(f"checkpoint saved: {final} (written in {written - started:.1f} s, checksums by "
                  f"{acc.num_processes} rank(s) in {done - written:.1f} s)", flush=True)
            if self.keep_last:
                self._rotate(step, final)

    def _still_ours(self, tmp, made, final):
        """Main process: refuse to publish when `tmp` is no longer the directory this save created (someone
        replaced it, e.g. by a link, while the ranks wrote into it)."""
        if _identity(tmp) != made:
            raise RuntimeError(f"saving checkpoint {final} failed: {tmp} was replaced while this run wrote into it "
                               f"(someone else writes into {self.directory}); nothing was published. Use a "
                               f"--checkpoint-dir only you can write to (chmod go-w), and check the files there")

    def _rotate(self, step, final):
        """Main process, after `final` (step `step`) is published: delete the oldest checkpoints this run family
        wrote beyond --keep-last. Only real directories with a manifest read_manifest accepts, of this run's
        layout family and an older step, count; a step-* link is unlinked, never followed; anything else that
        only looks like a checkpoint is left alone and reported once."""
        ours, strange, now = [], [], self.layout
        for name in sorted(os.listdir(self.directory)):
            m, path = NAME.match(name), os.path.join(self.directory, name)
            if not m or path == final:
                continue
            try:
                mode = os.lstat(path).st_mode
                if stat.S_ISLNK(mode):
                    os.unlink(path)  # the link itself: its target is not ours to delete
                    print(f"warning: removed {path}: a symbolic link, not a checkpoint this code writes",
                          file=sys.stderr, flush=True)
                    continue
                manifest = read_manifest(path, contents=False) if stat.S_ISDIR(mode) else None
            except (OSError, ValueError):
                manifest = None
            if (manifest and manifest["step"] == int(m.group(1)) < step
                    and manifest["layout"]["family"] == now["family"]):
                ours.append(path)
            else:
                strange.append(path)
        for old in ours[:max(0, len(ours) - (self.keep_last - 1))]:  # the one just saved counts as kept
            try:
                shutil.rmtree(old)
            except OSError as exc:  # the new checkpoint is complete: a warning, not an error
                print(f"warning: --keep-last {self.keep_last}: saved {final}, but could not remove the older "
                      f"checkpoint {old} ({exc}); remove it by hand", file=sys.stderr, flush=True)
        new = [p for p in strange if p not in self.reported]
        if new:
            self.reported.update(new)
            print(f"warning: --keep-last {self.keep_last}: left alone {', '.join(new)}: not a checkpoint this run "
                  f"wrote before {final} (no valid {MANIFEST}, another layout, or a later step); remove it by hand "
                  f"if it is yours", file=sys.stderr, flush=True)

    def choose(self, spec):
        """Collective. The checkpoint `spec` names (auto: the newest usable one), checked by every rank for
        compatibility, checksums and loadability, as (path, manifest); None to start fresh."""
        acc = self.accelerator
        started = time.perf_counter()
        result = (None, None)
        if acc.is_main_process:
            result = self._refuse_fresh_start() if spec == "none" else self._candidates(spec)
        candidates, held = agree(acc, result) or ([], 0)
        for path, manifest in candidates:
            self._check_compatible(path, manifest)
            mine = my_share(list(manifest["files"]), acc.process_index, acc.num_processes)
            try:
                damage = check_files(path, {rel: manifest["files"][rel] for rel in mine})
                unsafe = None if damage else check_loadable(path, mine, manifest["files"])
            except OSError as exc:
                damage, unsafe = f"it cannot be read ({exc})", None
            damage, unsafe = self._all_ranks(damage, unsafe)
            if unsafe:  # not damage: a file this code never writes. Stop, whatever --resume says.
                fail(acc, f"checkpoint {path} cannot be used: {unsafe}. This code never writes such a file: find "
                          f"out who did, and do not load it by other means.")
            if not damage:
                self.times["resume_verify_s"] = time.perf_counter() - started
                return path, manifest
            if spec != "auto":
                fail(acc, f"checkpoint {path} cannot be used: {damage}. Pick another one, or --resume auto "
                          f"for the newest complete one.")
            if acc.is_main_process:
                print(f"warning: skipping checkpoint {path}: {damage}", file=sys.stderr, flush=True)
        if held:  # starting fresh would rotate them away
            fail(acc, f"--resume auto: none of the {held} checkpoint(s) in {self.directory} can be used (the "
                      f"warnings above say why). Give another --checkpoint-dir, or remove them.")
        return None

    def load(self, path, manifest):
        """Collective: load a checkpoint choose() returned into the prepared objects; returns its training state."""
        acc = self.accelerator
        started = time.perf_counter()
        try:
            universal = self._universal(path, manifest) if self._needs_universal(manifest) else None
            with weights_only_loading(), _loading_universal(self.model, universal):  # again while loading: a
                acc.load_state(path, **self.load_kwargs)  # file swapped since the check runs no code either
                if acc.process_index >= manifest["layout"]["world_size"]:
                    _take_rng_state(os.path.join(path, "random_states_0.pkl"))  # a new rank (PER_RANK)
            self._load_rank_buffers(path)
        # ValueError: a universal checkpoint that does not fit this model (DeepSpeed's loader, and ours below).
        # The exit makes the launcher stop the others.
        except (UnsafeCheckpointFile, CheckpointException, ValueError) as exc:
            print(f"error: checkpoint {path} cannot be loaded: {(str(exc).splitlines() or [''])[0][:300]}. Remove "
                  f"it, or resume from another one.", file=sys.stderr, flush=True)
            sys.exit(2)
        # load_state restores accelerate's micro-batch counter, whose remainder modulo --grad-accum decides which
        # micro-batch syncs: after a change of --grad-accum it must fall on an optimizer step again.
        acc.step = manifest["step"] * acc.gradient_accumulation_steps
        self.times["resume_load_s"] = time.perf_counter() - started
        self.last_saved_step = manifest["step"]
        self.reshaped = reshaped(manifest, self.layout)
        if acc.is_main_process:
            print(f"resumed from {path} (step {manifest['step']}, written by {manifest['layout']['world_size']} "
                  f"processes; checksums and formats checked by {acc.num_processes} rank(s) in "
                  f"{self.times['resume_verify_s']:.1f} s, loaded in {self.times['resume_load_s']:.1f} s)",
                  flush=True)
            for note in self.reshaped:
                print(f"resumed on another shape: {note}", flush=True)
        return manifest["train_state"]

    def _needs_universal(self, manifest):
        return manifest["layout"]["family"] == "deepspeed" and manifest["layout"]["world_size"] != self.layout[
            "world_size"]

    def _universal(self, path, manifest):
        """Collective: the checkpoint's ZeRO state as DeepSpeed's universal checkpoint, which loads on any world
        size: PATH/universal, converted once (by the main process, weights-only) and kept as a derived part with
        its own manifest and checksums; every rank verifies its share of it like any checkpoint file."""
        acc, derived = self.accelerator, os.path.join(path, DERIVED)
        source = hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()
        error = None
        if acc.is_main_process:
            try:
                if not os.path.lexists(derived):
                    self._convert(path, manifest, source)
            except (OSError, RuntimeError, AssertionError, ValueError, UnsafeCheckpointFile) as exc:
                error = (f"checkpoint {path} cannot be used on {acc.num_processes} processes: converting its ZeRO "
                         f"state to DeepSpeed's universal checkpoint failed ({type(exc).__name__}: "
                         f"{(str(exc).splitlines() or [''])[0][:300]}). Relaunch with "
                         f"{manifest['layout']['world_size']} processes.")
        agree(acc, (None, error))
        damage, unsafe = None, None
        try:
            if not stat.S_ISDIR(os.lstat(derived).st_mode):
                raise ValueError("a symbolic link or a file, not a directory this code writes")
            derived_manifest = read_manifest(derived)
            if derived_manifest.get("derived_from") != source:
                raise ValueError("it was converted from other files than this checkpoint's")
            files = derived_manifest["files"]
            mine = my_share(list(files), acc.process_index, acc.num_processes)
            damage = check_files(derived, {rel: files[rel] for rel in mine})
            unsafe = None if damage else check_loadable(derived, mine, files)
        except (OSError, ValueError) as exc:
            damage = str(exc)
        damage, unsafe = self._all_ranks(damage, unsafe)
        if damage or unsafe:
            fail(acc, f"checkpoint {path} cannot be used on {acc.num_processes} processes: its converted part "
                      f"{derived}: {damage or unsafe}. Remove {derived} to have it converted again, or relaunch "
                      f"with {manifest['layout']['world_size']} processes.")
        return derived

    def _convert(self, path, manifest, source):
        """Main process: DeepSpeed's ds_to_universal, into .tmp-universal, then published by one rename."""
        from deepspeed.checkpoint import ds_to_universal

        tmp, started = os.path.join(path, DERIVING), time.perf_counter()
        remove_entry(tmp)  # a conversion a kill interrupted
        os.mkdir(tmp, 0o700)
        # Accelerate's DeepSpeed checkpoints lack the universal_checkpoint_info a Megatron client writes; for a
        # plain data-parallel model its defaults (no tensor-parallel patterns) are right: inject_missing_state.
        args = argparse.Namespace(input_folder=os.path.join(path, "pytorch_model"),
                                  output_folder=os.path.join(tmp, "pytorch_model"), num_extract_workers=1,
                                  num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
        with weights_only_loading():  # ds_to_universal's own torch.load calls ask for weights_only=False
            ds_to_universal.main(args)
        files = file_table(tmp, listing(tmp))
        derived = {"step": manifest["step"], "layout": manifest["layout"], "must_match": manifest["must_match"],
                   "train_state": {}, "derived_from": source, "files": files}
        write_manifest(tmp, derived)
        os.replace(tmp, os.path.join(path, DERIVED))
        fsync(path)
        print(f"converted {path}'s ZeRO state to DeepSpeed's universal checkpoint in {os.path.join(path, DERIVED)} "
              f"({len(files)} files, {time.perf_counter() - started:.1f} s): later resumes on another world size "
              f"reuse it", flush=True)

    # FSDP's sharded checkpoint keeps one copy of a buffer, but BatchNorm statistics differ per rank: keep each.
    def _save_rank_buffers(self, root):
        if self.accelerator.distributed_type == DistributedType.FSDP:
            buffers = {name: b.detach().cpu().contiguous() for name, b in self.model.named_buffers()}
            save_file(buffers, os.path.join(root, f"rank-{self.accelerator.process_index}.buffers.safetensors"))

    def _load_rank_buffers(self, root):
        """This rank's buffers; a rank the checkpoint does not have (written by fewer processes) takes rank 0's."""
        path = os.path.join(root, f"rank-{self.accelerator.process_index}.buffers.safetensors")
        if not os.path.exists(path):
            path = os.path.join(root, "rank-0.buffers.safetensors")
        if self.accelerator.distributed_type == DistributedType.FSDP and os.path.exists(path):
            saved = load_file(path)
            for name, b in ((n, b) for n, b in self.model.named_buffers() if n in saved):
                b.copy_(saved[name].to(b.device))

    def _check_compatible(self, path, manifest):
        """Collective (every rank has the same manifest): refuse a checkpoint this run cannot continue."""
        problem = incompatibility(manifest, self.layout, self.must_match)
        if problem:
            fail(self.accelerator, f"cannot resume from {path}: {problem}. Use the original settings, or start "
                                   f"fresh with another --checkpoint-dir.")

    def _refuse_fresh_start(self):
        """Main process: --resume none into a directory that holds checkpoints would rotate them away."""
        held = [os.path.basename(p) for _, p in self._complete()] if self.directory else []
        if not held:
            return None, None
        return None, (f"--resume none, but --checkpoint-dir {self.directory} already holds {len(held)} "
                      f"checkpoint(s) ({held[-1]} the newest); starting fresh there would rotate them away. "
                      f"To start fresh, give another --checkpoint-dir (or remove that one); to continue, "
                      f"use --resume auto.")

    def _candidates(self, spec):
        """Main process: (([(path, manifest)...] newest first, how many step-* there are), None) or (None, error
        message). The ranks then verify the checksums together and take the first that passes."""
        if spec != "auto":
            if not os.path.isdir(spec):
                return None, (f"--resume {spec}: no such directory. Give the path of a step-* checkpoint "
                              f"directory, or --resume auto for the newest complete one in --checkpoint-dir.")
            try:
                return ([(spec, read_manifest(spec))], 1), None
            except ValueError as exc:
                return None, (f"checkpoint {spec} cannot be used: {exc}. Pick another one, or --resume auto "
                              f"for the newest complete one.")
        if not self.directory or not os.path.isdir(self.directory):
            return None, None
        found, held = [], self._complete()
        for _, path in reversed(held):
            try:
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    raise ValueError("a symbolic link or a file, not a checkpoint directory this code writes")
                found.append((path, read_manifest(path)))
            except (OSError, ValueError) as exc:
                print(f"warning: skipping checkpoint {path}: {exc}", file=sys.stderr, flush=True)
        return (found, len(held)), None

    def release(self):
        """The run is over: let the next run write here."""
        if self.lock:
            self.lock.release()


@contextlib.contextmanager
def _loading_universal(engine, root):
    """While active (root given), accelerate's load_state reads the DeepSpeed engine's state from the universal
    checkpoint under root instead of the checkpoint's own ZeRO files; the rest (scheduler, RNG) as usual."""
    if root is None:
        yield
        return
    own = engine.load_checkpoint

    def load_checkpoint(load_dir, tag=None, **kwargs):
        loaded = own(root, tag, **kwargs)
        if engine.zero_optimization_stage() == 3 and kwargs.get("load_optimizer_states", True):
            saved = os.path.join(root, tag, "zero", "optimizer_state.pt")
            _repair_zero3_universal_load(engine.optimizer.optimizer, saved)
        return loaded

    engine._config.load_universal_checkpoint = True
    engine.load_checkpoint = load_checkpoint
    try:
        yield
    finally:
        del engine.load_checkpoint
        engine._config.load_universal_checkpoint = False


def _repair_zero3_universal_load(optimizer, path):
    """Two faults of ZeRO-3's universal load (DeepSpeed 0.19.8, stage3.load_hp_checkpoint_state_from_checkpoint_
    dir_stage3) that made the training drift (0.2% in the loss 8 steps after a 2 -> 1 resume, the step most of
    it): it gives every parameter group's state one and the same `step` tensor, which ZeRO-3's step of each
    group then increments in place, so Adam's bias correction runs ahead; and it gives every group the first
    group's settings, so the gpt recipe's group without weight decay decays. Each group takes its own step
    tensor and its own settings back from the converted optimizer_state.pt (under weights_only_loading: the
    file runs no code)."""
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    saved = torch.load(path)["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"{path} holds {len(saved)} parameter groups and the optimizer {len(optimizer.param_groups)}")
    for group, settings in zip(optimizer.param_groups, saved):
        group.update({key: value for key, value in settings.items() if key != "params"})


def _take_rng_state(path):
    """Set this process's RNG states from another rank's accelerate file, as load_state sets its own (under
    weights_only_loading: the file runs no code)."""
    states = torch.load(path)
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"][:torch.cuda.device_count()])


def _identity(path):
    """(device, inode) of the entry at `path` itself (not followed), or None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def remove_entry(path):
    """Remove whatever is at `path`: a directory tree, or a link or file itself (never what a link points to)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)
