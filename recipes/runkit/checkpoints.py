"""Checkpoints that lose nothing: save, verify, choose and load them.

Owns --checkpoint-dir: its lock, its layout, saving, choosing and loading, and rotation. When to save is
the run object's decision (run.py, Run._checkpoint_due); what a resumed run may change is resume_rules.py's,
and how the state of another world size or --grad-accum reaches this run's ranks is resharding.py's.

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

import os
import re
import shutil
import stat
import sys
import time

from accelerate.utils import DistributedType, gather_object
from torch.distributed.checkpoint.api import CheckpointException  # FSDP's sharded saves and loads raise it

from .collectives import first_rank_problems, main_process_result
from .dirlock import take
from .engines import uncompiled_name
from .exits import fail
from .integrity import (
    MANIFEST,
    UnsafeCheckpointFile,
    check_share,
    file_table,
    fsync,
    listing,
    my_share,
    read_manifest,
    remove_entry,
    weights_only_loading,
    write_manifest,
)
from .resharding import (
    load_rank_buffers,
    loading_universal,
    needs_universal,
    reshaped_window,
    rng_for_new_rank,
    save_rank_buffers,
    set_micro_batch_counter,
    universal_part,
)
from .resume_rules import incompatibility, layout, reshaped

NAME = re.compile(r"^step-(\d{8})$")


def lock_directory(accelerator, directory):
    """Collective: take --checkpoint-dir's lock (one writer per directory) on the main process, at start-up,
    so a second run on it stops in seconds, before it loads data or a model. Returns the lock (main process)."""
    lock, error = take(directory) if accelerator.is_main_process else (None, None)
    main_process_result(accelerator, (None, error))
    return lock


class Checkpointer:
    def __init__(self, accelerator, directory, keep_last, must_match, model, lock):
        """must_match: the settings a resumed run must share (resume_rules.must_match_settings); model: the
        prepared model, whose per-rank buffers FSDP needs kept; lock: lock_directory()'s, taken at start-up.
        The layout records the accelerator's accumulation steps (a resume may change them: resume_rules.RESHAPE)."""
        self.accelerator, self.directory, self.keep_last = accelerator, directory, keep_last
        self.must_match, self.model, self.lock = must_match, model, lock
        self.layout = layout(accelerator)
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
        distributed_type = self.accelerator.distributed_type
        if not frozen or distributed_type == DistributedType.FSDP:
            return {}, {}
        if distributed_type == DistributedType.DEEPSPEED:
            return {"exclude_frozen_parameters": True}, {"load_module_strict": False}

        def trainable_only(models, weights, output_dir):  # accelerate calls it with each model's state dict
            for state in weights:  # named as in the model, or behind DDP's module. and compile's _orig_mod.
                for key in [k for k in state if uncompiled_name(k.removeprefix("module.")) in frozen]:
                    del state[key]
        self.accelerator.register_save_state_pre_hook(trainable_only)
        return {}, {"strict": False}

    def _complete(self):
        names = os.listdir(self.directory) if os.path.isdir(self.directory) else []
        return sorted((int(m.group(1)), os.path.join(self.directory, n)) for n in names if (m := NAME.match(n)))

    def save(self, step, train_state):
        """Collective: write step-NNNNNNNN, verify and publish it, then rotate the older ones."""
        acc, name = self.accelerator, f"step-{step:08d}"
        final, tmp = os.path.join(self.directory, name), os.path.join(self.directory, f".tmp-{name}")
        main_process_result(acc, (None, self.lock.lost() if self.lock else None))  # another run took the directory over
        started = time.perf_counter()
        made = self._fresh_tmp(tmp, final)
        self._write_state(tmp, final)
        written = time.perf_counter()
        shares = self._hash_shares(tmp)
        self._publish(tmp, final, made, shares, {"step": step, "layout": self.layout, "must_match": self.must_match,
                                                 "train_state": train_state})
        self.last_saved_step = step
        self._count_save(final, started, written)
        if acc.is_main_process and self.keep_last:
            self._rotate(step, final)

    def _fresh_tmp(self, tmp, final):
        """Collective: the main process makes `tmp` anew, only this user writing in it; returns its identity
        there (None on the other ranks)."""
        made, error = None, None
        if self.accelerator.is_main_process:
            try:
                remove_entry(tmp)  # left by a run killed while saving this step, or a planted link
                os.mkdir(tmp, 0o700)  # only this user writes in it
                made = _identity(tmp)
            except OSError as exc:
                error = f"saving checkpoint {final} failed: cannot create {tmp} ({exc}); the earlier checkpoints " \
                        f"are untouched"
        main_process_result(self.accelerator, (None, error))
        return made

    def _write_state(self, tmp, final):
        """Collective: every rank writes its part (accelerate's save_state, FSDP's per-rank buffers) and its
        rank-R.done marker. A rank that cannot exits 2, which makes the launcher stop the others."""
        acc = self.accelerator
        try:
            acc.save_state(tmp, **self.save_kwargs)
            save_rank_buffers(acc, self.model, tmp)
            open(os.path.join(tmp, f"rank-{acc.process_index}.done"), "w").close()
        except (OSError, RuntimeError, CheckpointException) as exc:  # a full disk (torch.save: RuntimeError)
            free = shutil.disk_usage(tmp).free / 1e6 if os.path.isdir(tmp) else float("nan")
            print(f"error: saving checkpoint {final} failed on rank {acc.process_index} ({type(exc).__name__}: "
                  f"{(str(exc).splitlines() or [''])[0][:200]}; {free:.1f} MB left on its file system); the earlier "
                  f"checkpoints are untouched. Free space and run the same command again to resume from the newest "
                  f"of them.", file=sys.stderr, flush=True)
            sys.exit(2)
        acc.wait_for_everyone()

    def _hash_shares(self, tmp):
        """Collective: every rank hashes and syncs its share, the files it wrote and its turn of the others.
        Returns (every rank's (table, problem), the files this rank saw)."""
        acc = self.accelerator
        table, error, seen = {}, None, []
        try:
            seen = listing(tmp)
            mine = my_share(seen, acc.process_index, acc.num_processes)
            table = file_table(tmp, mine)
            for rel in mine:
                fsync(os.path.join(tmp, rel))
        except OSError as exc:  # RefusedFile too: a link or FIFO where this save wrote a file
            error = f"rank {acc.process_index}: {exc}"
        return (gather_object([(table, error)]) if acc.num_processes > 1 else [(table, error)]), seen

    def _publish(self, tmp, final, made, shares, manifest):
        """Collective: the main process completes the manifest with every file's size and checksum, writes it
        last and renames `tmp` to `final`, the moment the checkpoint becomes visible; on an error every rank
        fails, and the earlier checkpoints are untouched."""
        error = None
        if self.accelerator.is_main_process:
            try:
                files = self._file_table(tmp, *shares)
                self._still_ours(tmp, made, final)
                write_manifest(tmp, {**manifest, "files": files})
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
        main_process_result(self.accelerator, (None, error))

    def _file_table(self, tmp, tables, seen):
        """Main process: {rel: {size, sha256}} of every file of the save, from the ranks' tables; refuses a
        save whose ranks wrote where the main process cannot see."""
        missing = [r for r in range(self.accelerator.num_processes)
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
        return files

    def _count_save(self, final, started, written):
        """The save's times, for the summary, and its line."""
        done = time.perf_counter()
        self.times["saves"] += 1
        self.times["save_write_s"] += written - started
        self.times["save_checksum_s"] += done - written
        if self.accelerator.is_main_process:
            print(f"checkpoint saved: {final} (written in {written - started:.1f} s, checksums by "
                  f"{self.accelerator.num_processes} rank(s) in {done - written:.1f} s)", flush=True)

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
        candidates, held = main_process_result(acc, result) or ([], 0)
        for path, manifest in candidates:
            self._check_compatible(path, manifest)
            damage, unsafe = first_rank_problems(acc, *check_share(path, manifest["files"], acc.process_index,
                                                                   acc.num_processes))
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
        """Collective: load a checkpoint choose() returned into the prepared objects, each rank's own state by
        resume_rules.PER_RANK (resharding.py); returns its training state, as this run's ranks carry it."""
        acc = self.accelerator
        started = time.perf_counter()
        try:
            universal = universal_part(acc, path, manifest) if needs_universal(manifest, self.layout) else None
            with weights_only_loading(), loading_universal(self.model, universal):  # again while loading: a
                acc.load_state(path, **self.load_kwargs)  # file swapped since the check runs no code either
                rng_for_new_rank(acc, path, manifest)
            load_rank_buffers(acc, self.model, path)
        # ValueError: a universal checkpoint that does not fit this model (DeepSpeed's loader, and ours).
        # The exit makes the launcher stop the others.
        except (UnsafeCheckpointFile, CheckpointException, ValueError) as exc:
            print(f"error: checkpoint {path} cannot be loaded: {(str(exc).splitlines() or [''])[0][:300]}. Remove "
                  f"it, or resume from another one.", file=sys.stderr, flush=True)
            sys.exit(2)
        set_micro_batch_counter(acc, manifest["step"])
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
        state = manifest["train_state"]
        if state.get("window"):  # written by another world size or --grad-accum: resume_rules.PER_RANK
            state = {**state, "window": reshaped_window(state["window"], manifest, self.layout)}
        return state

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


def _identity(path):
    """(device, inode) of the entry at `path` itself (not followed), or None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None
