"""Checkpoints that lose nothing: save, verify, choose and load them.

Owns --checkpoint-dir: its lock, its layout, saving, choosing and loading, and rotation. When to save is
the run object's decision (run.py, Run._checkpoint_due); what a resumed run may change is resume_rules.py's,
and how the state of another world size or --grad-accum reaches this run's ranks is resharding.py's.

Layout of --checkpoint-dir:

    step-00000120/      a complete checkpoint: accelerate's save_state files plus
                        checkpoint.json (training state, world size, and the size and
                        SHA-256 of every file), written last
    step-00000120.k3x9a2q7/  the same, published under a name of its own when another user holds step-00000120
    .tmp-step-00000130.XXXXXXXX/ a save in progress (a name no one can plant beforehand), or one a crash
                        interrupted: never loaded, removed by the next run once it holds the lock
    .lock               the run that writes here: host, pid, Slurm job id (one writer per directory;
                        dirlock.py: a lock of this user's own name where another user holds .lock)

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
Another user's entries (a shared directory with the sticky bit) are passed over by every step here, and
what planted entries can cost is bounded (owners.py).
"""

import json
import os
import re
import secrets
import shutil
import stat
import sys
import tempfile
import time

from accelerate.utils import DistributedType, gather_object
from torch.distributed.checkpoint.api import CheckpointException  # FSDP's sharded saves and loads raise it

from ..collectives import checked_by_every_rank, main_process_result
from ..engines import uncompiled_name
from ..exits import fail, report
from .integrity import (
    MANIFEST,
    HeldCheckpoint,
    file_table,
    files_problem,
    fsync,
    listing,
    my_share,
    read_manifest,
    remove_entry,
    write_manifest,
)
from .lock import take
from .owners import INSPECTED, SHOWN, Passed, theirs
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
from .rules import checkpoint_kind, incompatibility, layout, reshaped
from .safe_loading import UnsafeCheckpointFile, weights_only_loading
from .train_state import state_problem

# A checkpoint's name: its step, and a suffix of its own when another user's entry holds the plain name.
NAME = re.compile(r"^step-(\d{8})(?:\.[0-9a-z]{8})?$")


def lock_directory(accelerator, directory, resume="auto", recipe=None):
    """Collective, at start-up, before any data or model is loaded: take --checkpoint-dir's lock (one writer per
    directory) on the main process, so that a second run on it stops in seconds; and refuse a checkpoint the resume
    would take that another recipe or engine wrote (the main process reads its manifest). Returns (the lock: the main
    process's, None elsewhere and without --checkpoint-dir; the (path, manifest) the resume would take as far as
    manifests tell, on every rank, or None)."""
    lock, error, peeked = None, None, None
    if accelerator.is_main_process:
        lock, error = take(directory) if directory else (None, None)
        peeked = None if error or resume == "none" else peek(directory, resume)
        error = error or (peeked and _written_by_another(accelerator, *peeked, recipe))
        if error and lock:
            lock.release()
    return lock, main_process_result(accelerator, (peeked, error))


def peek(directory, resume):
    """Main process: (path, manifest) of the checkpoint --resume would take, from manifests and sizes alone (the
    newest of this user's step-* that holds exactly the files its manifest lists; or the one --resume names), or
    None. The checksums and the checks that need the model come once it is built; what is passed over here is named
    then. It decides nothing for good: the start-up refusal of another recipe's or engine's checkpoint, and where
    the results go (run.py), which choose() confirms."""
    root = directory if resume == "auto" else resume
    if not root:
        return None
    if resume != "auto" and os.path.lexists(os.path.join(resume, MANIFEST)):
        paths = [resume]
    else:
        paths = [path for _, path in own_steps(root, None)]
    for path in paths:
        try:
            manifest = read_manifest(path, contents=path != resume)
        except (OSError, ValueError):
            continue
        # The files a save of its layout writes (a recipe of one model, optimizer and scheduler): a planted
        # manifest listing none is passed over here, and named when the run chooses.
        if path == resume or not files_problem(manifest):
            return path, manifest
    return None


def _written_by_another(accelerator, path, manifest, recipe):
    """Main process: None, or why the checkpoint at `path` cannot be this run's, from its manifest alone: another
    recipe wrote it, or another engine (its files differ)."""
    other = manifest.get("recipe")
    if recipe and other and other != recipe:
        return f"cannot resume from {path}: it was written by {other}.py, and this is {recipe}.py. Give a " \
               f"checkpoint of {recipe}.py, or another --checkpoint-dir."
    return _check_layout(path, manifest, layout(accelerator))


def own_steps(directory, passed):
    """[(step, path)] of this user's step-* directories in `directory`, newest first, at most owners.INSPECTED of
    them ([] when it cannot be listed). Another user's entries are passed over (passed.add, naming the owner, when
    `passed` is given), and so are those beyond the bound, counted in one line; neither is ever counted or read."""
    found = []
    for step, path in reversed(_steps(directory)):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if theirs(st):
            if passed:
                passed.add(path, f"it {theirs(st)}")
            continue
        found.append((step, path))
    if len(found) > INSPECTED and passed:
        print(f"warning: {directory} holds {len(found)} step-* entries of this user's; only the newest {INSPECTED} "
              f"were looked at (remove the others)", file=sys.stderr, flush=True)
    return found[:INSPECTED]


def _check_layout(path, manifest, now):
    saved = manifest["layout"]
    if checkpoint_kind(saved) != checkpoint_kind(now):
        return f"cannot resume from {path}: {incompatibility(manifest, now, {})}. Use the original config, or start " \
               f"fresh with another --checkpoint-dir."
    return None


class Checkpointer:
    def __init__(self, accelerator, directory, keep_last, must_match, model, lock, recipe=None):
        """must_match: the settings a resumed run must share (resume_rules.must_match_settings); model: the
        prepared model, whose per-rank buffers FSDP needs kept; lock: lock_directory()'s, taken at start-up;
        recipe: the recipe's name, recorded in each manifest (a checkpoint of another recipe is named as such).
        The layout records the accelerator's accumulation steps (a resume may change them: resume_rules.RESHAPE)."""
        self.accelerator, self.directory, self.keep_last = accelerator, directory, keep_last
        self.must_match, self.model, self.lock, self.recipe = must_match, model, lock, recipe
        self.layout = layout(accelerator)
        self.reshaped = []  # what the resume changed (world size, --grad-accum) and the rules that applied
        self.last_saved_step, self.newest = None, None  # the newest checkpoint this run wrote or resumed: its path
        self.left_alone = set()  # step-* entries rotation left alone, each reported once
        self.passed = Passed("skipping checkpoint")  # entries not used: another user's, damaged; each named once
        # What a checkpoint of this model can hold (its files' recorded sizes together): 40 bytes per parameter
        # (fp32 weights, two Adam moments, DeepSpeed's half-precision and master copies) and 64 MB besides (the RNG
        # states, the scheduler, DeepSpeed's extras). A planted manifest recording more is never hashed.
        self.size_limit = 40 * sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()) + (64 << 20)
        self.verified = set()  # checkpoints in --checkpoint-dir whose every file this run checked or wrote
        self.held = None  # the checkpoint choose() verified, held until load() has read it
        self.times = {"saves": 0, "save_write_s": 0.0, "save_checksum_s": 0.0, "resume_verify_s": None,
                      "resume_load_s": None}
        self.save_kwargs, self.load_kwargs = self._leave_out_frozen(model)

    def _leave_out_frozen(self, model):
        """(save_state, load_state) keyword arguments. Frozen parameters (LoRA's base model) are loaded again
        from the model the run starts from, which must_match pins, so checkpoints leave them out where the
        engine allows: DeepSpeed's module files, and the model file without DeepSpeed or FSDP. FSDP's sharded
        save takes the whole state dict (accelerate has no filter for it), each rank writing its shard. The load
        is then not strict, so choose() checks the model file holds exactly what trains (_model_keys_problem)."""
        plain = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        frozen = {name for name, p in plain.named_parameters() if not p.requires_grad}
        self.frozen, self.saved_keys = frozen, set(plain.state_dict()) - frozen
        distributed_type = self.accelerator.distributed_type
        if not frozen or distributed_type == DistributedType.FSDP:
            self.frozen = set()
            return {}, {}
        if distributed_type == DistributedType.DEEPSPEED:
            return {"exclude_frozen_parameters": True}, {"load_module_strict": False}

        def trainable_only(models, weights, output_dir):  # accelerate calls it with each model's state dict
            for state in weights:  # named as in the model, or behind DDP's module. and compile's _orig_mod.
                for key in [k for k in state if uncompiled_name(k.removeprefix("module.")) in frozen]:
                    del state[key]
        self.accelerator.register_save_state_pre_hook(trainable_only)
        return {}, {"strict": False}

    def save(self, step, train_state):
        """Collective: write step-NNNNNNNN, verify and publish it, then rotate the older ones."""
        acc, name = self.accelerator, f"step-{step:08d}"
        final = os.path.join(self.directory, name)
        main_process_result(acc, (None, self.lock.lost() if self.lock else None))  # another run took the directory over
        started = time.perf_counter()
        tmp, made = self._fresh_tmp(name, final)
        self._write_state(tmp, final)
        written = time.perf_counter()
        shares = self._hash_shares(tmp)
        final = self._publish(tmp, final, made, shares, {
            "step": step, "layout": self.layout, "must_match": self.must_match, "train_state": train_state,
            **({"recipe": self.recipe} if self.recipe else {})})
        self.last_saved_step, self.newest = step, final
        self.verified.add(final)
        self._count_save(final, started, written)
        if acc.is_main_process and self.keep_last:
            self._rotate(step, final)

    def _fresh_tmp(self, name, final):
        """Collective: the main process makes a new directory .tmp-step-N.XXXXXXXX (mode 0700, a name no one can
        plant beforehand); returns (its path, its identity there: None on the other ranks) on every rank."""
        made, error, tmp = None, None, None
        if self.accelerator.is_main_process:
            try:
                tmp = tempfile.mkdtemp(prefix=f".tmp-{name}.", dir=self.directory)  # mode 0700: only this user
                made = _identity(tmp)
            except OSError as exc:
                error = f"saving checkpoint {final} failed: cannot create a directory in {self.directory} ({exc}); " \
                        f"the earlier checkpoints are untouched"
        return main_process_result(self.accelerator, (tmp, error)), made

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
        last and renames `tmp` to `final` (or to a name of its own where another user holds `final`), the moment
        the checkpoint becomes visible; returns the checkpoint's path on every rank. On an error every rank fails,
        and the earlier checkpoints are untouched."""
        error = None
        if self.accelerator.is_main_process:
            try:
                files = self._file_table(tmp, *shares)
                self._still_ours(tmp, made, final)
                write_manifest(tmp, {**manifest, "files": files})
                final = self._free_name(final)
                self._still_ours(tmp, made, final)
                os.replace(tmp, final)  # the moment the checkpoint becomes visible
                fsync(self.directory)
            except OSError as exc:
                error = f"saving checkpoint {final} failed ({exc}); the earlier checkpoints are untouched"
                if _identity(tmp) == made:
                    shutil.rmtree(tmp, ignore_errors=True)  # a full disk: give back what this save took
            except RuntimeError as exc:
                error = str(exc)
        return main_process_result(self.accelerator, (final, error))

    def _free_name(self, final):
        """Main process: where to publish: `final`, after removing what this user has there (an older save of this
        very step, or a planted link); or, where another user's entry holds that name (a shared directory with the
        sticky bit: it cannot be removed), `final` with a suffix of its own, saying so once."""
        try:
            st = os.lstat(final)
        except FileNotFoundError:
            return final
        if not theirs(st):
            remove_entry(final)
            return final
        other = f"{final}.{secrets.token_hex(4)}"
        self.passed.add(final, f"it {theirs(st)}; this save is published as {other}")
        return other

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
        wrote beyond --keep-last. Newest first, a checkpoint counts only if it verifies (_rotation_problem): as
        many as --keep-last keeps are checked file by file (each once per run), the older ones by their manifest
        and sizes; a step-* link is unlinked, never followed; anything else is left alone and reported once. So a
        planted or damaged look-alike never takes the place of a real checkpoint, which is then deleted."""
        counted, strange = [], []
        for named_step, path in own_steps(self.directory, self.passed):
            if path == final:
                continue
            try:
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):
                    os.unlink(path)  # the link itself: its target is not ours to delete
                    print(f"warning: removed {path}: a symbolic link, not a checkpoint this code writes",
                          file=sys.stderr, flush=True)
                    continue
            except OSError:
                continue
            kept = len(counted) < self.keep_last - 1  # the one just saved counts as kept
            problem = self._rotation_problem(path, st, named_step, step, checksums=kept)
            (strange if problem else counted).append(path)
        for old in counted[max(0, self.keep_last - 1):]:
            try:
                shutil.rmtree(old)
            except OSError as exc:  # the new checkpoint is complete: a warning, not an error
                print(f"warning: --keep-last {self.keep_last}: saved {final}, but could not remove the older "
                      f"checkpoint {old} ({exc}); remove it by hand", file=sys.stderr, flush=True)
        self._report_left_alone(strange, final)

    def _report_left_alone(self, strange, final):
        """One warning naming the look-alikes rotation left alone that no earlier warning named (at most
        owners.SHOWN of them by name, the rest counted)."""
        new = [p for p in sorted(strange) if p not in self.left_alone]
        if not new:
            return
        self.left_alone.update(new)
        more = f" and {len(new) - SHOWN} more" if len(new) > SHOWN else ""
        print(f"warning: --keep-last {self.keep_last}: left alone {', '.join(new[:SHOWN])}{more}: not a checkpoint "
              f"this run wrote before {final} (it does not verify, or another run or layout wrote it, or a later "
              f"step); remove it by hand if it is yours", file=sys.stderr, flush=True)

    def _rotation_problem(self, path, st, named_step, step, checksums):
        """Main process: None if the directory at `path` (lstat `st`) is a checkpoint of this run family older than
        `step`, which verifies: this user's directory, its manifest valid for this run and its name, its files
        exactly those listed at their sizes, and (checksums) every file's checksum and format."""
        if not stat.S_ISDIR(st.st_mode) or theirs(st):
            return "not a directory of this user's"
        try:
            manifest = read_manifest(path)
        except (OSError, ValueError) as exc:
            return str(exc)
        problem = self._manifest_problem(manifest) or (
            incompatibility(manifest, self.layout, self.must_match) if manifest.get("recipe", self.recipe)
            == self.recipe else "another recipe wrote it")
        if problem or not manifest["step"] == named_step < step or not checksums or path in self.verified:
            return problem or (None if manifest["step"] == named_step < step else "not an older step")
        with HeldCheckpoint(path, manifest["files"], follow=False) as held:
            damage, unsafe = held.share_problems(0, 1)
        if not (damage or unsafe):
            self.verified.add(path)
        return damage or unsafe

    def _manifest_problem(self, manifest):
        """None, or why a manifest that read_manifest accepts is not one this run's save would have written: its
        train_state (train_state.py), its files, exactly those its engine and layout write for this run, and their
        sizes together, at most what a checkpoint of this model holds (size_limit: nothing beyond it is hashed)."""
        acc = self.accelerator
        total = sum(want["size"] for want in manifest["files"].values())
        if total > self.size_limit:
            return f"its {MANIFEST} records {total / 1e9:.3g} GB of files, more than a checkpoint of this model " \
                   f"holds ({self.size_limit / 1e9:.3g} GB at most)"
        return state_problem(manifest) or files_problem(
            manifest, len(acc._models), len(acc._optimizers), len(acc._schedulers))

    def choose(self, spec):
        """Collective. The checkpoint `spec` names (auto: the newest usable one; the directory of step-*
        checkpoints: its newest usable one), checked by every rank for compatibility, checksums and loadability,
        and held (integrity.HeldCheckpoint) until load() has read it, as (path, manifest); None to start fresh."""
        acc = self.accelerator
        started = time.perf_counter()
        result = (None, None)
        where = self.directory if spec == "auto" else spec
        if acc.is_main_process:
            result = self._refuse_fresh_start() if spec == "none" else self._candidates(spec)
            self.passed.close(where)
        candidates, held, fall_back = main_process_result(acc, result) or ([], 0, False)
        for path, manifest in candidates:
            self._check_compatible(path, manifest)
            checkpoint = HeldCheckpoint(path, manifest["files"], follow=spec != "auto")
            also = self._model_keys_problem if acc.is_main_process and self.frozen else None
            damage, unsafe = checked_by_every_rank(acc, checkpoint, also)
            if unsafe:  # not damage: a file this code never writes. Stop, whatever --resume says.
                checkpoint.close()
                fail(acc, f"checkpoint {path} cannot be used: {unsafe}. This code never writes such a file: find "
                          f"out who did, and do not load it by other means.")
            if not damage:
                self.held = checkpoint
                if os.path.dirname(path) == self.directory:
                    self.verified.add(path)
                self.times["resume_verify_s"] = time.perf_counter() - started
                return path, manifest
            checkpoint.close()
            if not fall_back:
                fail(acc, f"checkpoint {path} cannot be used: {damage}. Pick another one, or --resume auto "
                          f"for the newest complete one.")
            if acc.is_main_process:
                self.passed.add(path, damage)
        if acc.is_main_process:
            self.passed.close(where)
        if held:  # this user's checkpoints: starting fresh would rotate them away
            fail(acc, f"--resume {spec}: none of the {held} checkpoint(s) in {where} can be used (the warnings above "
                      f"say why). Give another --checkpoint-dir, or remove them.")
        return None

    def _model_keys_problem(self, held):
        """Main process, the model's trainable part only saved (LoRA: the frozen base left out, so the load is not
        strict): None, or why the checkpoint's model file does not hold exactly what this run saves, the adapters
        and no frozen weight (a frozen weight in it would replace --model's, a missing adapter would stay new)."""
        rel, keys = _model_keys(held, self.layout)
        if rel is None:
            return None
        names = {uncompiled_name(k.removeprefix("module.")) for k in keys}
        frozen = sorted(names & self.frozen)
        if frozen:
            return f"{rel} holds {frozen[0]}, a weight of the frozen base model: a LoRA checkpoint holds only what " \
                   f"trains, the base comes from --model"
        missing, unknown = sorted(self.saved_keys - names), sorted(names - self.saved_keys)
        if missing:
            return f"{rel} lacks {missing[0]}, which this run trains: a LoRA checkpoint holds every adapter"
        return f"{rel} holds {unknown[0]}, which this model does not have" if unknown else None

    def load(self, path, manifest):
        """Collective: load the checkpoint choose() returned and holds into the prepared objects, reading only the
        files it verified (its view), each rank's own state by resume_rules.PER_RANK (resharding.py); returns its
        training state, as this run's ranks carry it."""
        acc, held, universal = self.accelerator, self.held, None
        started = time.perf_counter()
        try:
            universal = universal_part(acc, held, manifest) if needs_universal(manifest, self.layout) else None
            source = held.view()
            with weights_only_loading(), loading_universal(self.model, universal and universal.view()):
                acc.load_state(source, **self.load_kwargs)  # under weights-only loading again: a file that
                rng_for_new_rank(acc, source, manifest)  # changed since its check runs no code either
            load_rank_buffers(acc, self.model, source)
        # ValueError: a universal checkpoint that does not fit this model (DeepSpeed's loader, and ours); a DCP entry
        # of another kind. RuntimeError: a state dict that does not fit (a strict load). The exit makes the launcher
        # stop the others.
        except (UnsafeCheckpointFile, CheckpointException, ValueError, RuntimeError) as exc:
            message = _first_failure(exc).replace(held.view(), path)
            report(f"checkpoint {path} cannot be loaded: {message}. Remove it, or resume from another one.",
                   acc.is_main_process or not isinstance(exc, CheckpointException))  # DCP's: every rank raises it
            sys.exit(2)
        finally:
            if universal:
                universal.close()
        self._loaded(path, manifest, started)
        state = manifest["train_state"]
        if state.get("window"):  # written by another world size or --grad-accum: resume_rules.PER_RANK
            state = {**state, "window": reshaped_window(state["window"], manifest, self.layout)}
        return state

    def _loaded(self, path, manifest, started):
        """After the load: the micro-batch counter, the times, the lines that say what was loaded, and a warning
        naming a verified file that was replaced while the run read the checkpoint (the run read the verified
        one); the held files let go."""
        acc = self.accelerator
        set_micro_batch_counter(acc, manifest["step"])
        self.times["resume_load_s"] = time.perf_counter() - started
        self.last_saved_step, self.newest = manifest["step"], path
        self.reshaped = reshaped(manifest, self.layout)
        replaced = self.held.replaced() if acc.is_main_process else []
        self.held.close()
        self.held = None
        if not acc.is_main_process:
            return
        print(f"resumed from {path} (step {manifest['step']}, written by {manifest['layout']['world_size']} "
              f"processes; checksums and formats checked by {acc.num_processes} rank(s) in "
              f"{self.times['resume_verify_s']:.1f} s, loaded in {self.times['resume_load_s']:.1f} s)", flush=True)
        for note in self.reshaped:
            print(f"resumed on another shape: {note}", flush=True)
        if replaced:
            print(f"warning: checkpoint {path} changed while this run read it: {replaced[0]} was replaced after "
                  f"it was verified (this run read the verified file; the next resume will refuse the checkpoint). "
                  f"Someone else writes there: check {os.path.dirname(path)}", file=sys.stderr, flush=True)

    def _check_compatible(self, path, manifest):
        """Collective (every rank has the same manifest): refuse a checkpoint this run cannot continue."""
        other = manifest.get("recipe")
        if self.recipe and other and other != self.recipe:
            fail(self.accelerator, f"cannot resume from {path}: it was written by {other}.py, and this is "
                                   f"{self.recipe}.py. Give a checkpoint of {self.recipe}.py, or another "
                                   f"--checkpoint-dir.")
        problem = incompatibility(manifest, self.layout, self.must_match)
        if problem:
            fail(self.accelerator, f"cannot resume from {path}: {problem}. Use the original settings, or start "
                                   f"fresh with another --checkpoint-dir.")

    def _refuse_fresh_start(self):
        """Main process: --resume none into a directory that holds this user's checkpoints would rotate them away."""
        held = [os.path.basename(p) for _, p in own_steps(self.directory, self.passed)] if self.directory else []
        if not held:
            return None, None
        return None, (f"--resume none, but --checkpoint-dir {self.directory} already holds {len(held)} "
                      f"checkpoint(s) ({held[0]} the newest); starting fresh there would rotate them away. "
                      f"To start fresh, give another --checkpoint-dir (or remove that one); to continue, "
                      f"use --resume auto.")

    def _candidates(self, spec):
        """Main process: (([(path, manifest)...] newest first, how many of this user's step-* there are, whether to
        fall back to an older one), None) or (None, error message). The ranks then verify the checksums together and
        take the first that passes. --resume given the directory of step-* checkpoints (the parent of a step-*)
        takes its newest usable one, as --resume auto does in --checkpoint-dir (accelerate's load_state() takes the
        newest too). Another user's entries are passed over with a line naming the owner, and not counted."""
        if spec != "auto":
            if not os.path.isdir(spec):
                return None, (f"--resume {spec}: no such directory. Give the path of a step-* checkpoint "
                              f"directory, or --resume auto for the newest complete one in --checkpoint-dir.")
            if os.path.lexists(os.path.join(spec, MANIFEST)) or not _steps(spec):
                try:
                    return ([(spec, self._usable(spec, None))], 1, False), None
                except ValueError as exc:
                    return None, (f"checkpoint {spec} cannot be used: {exc}. Pick another one, or --resume auto "
                                  f"for the newest complete one.")
            print(f"--resume {spec}: a directory of checkpoints; resuming from its newest complete one",
                  flush=True)
        root = self.directory if spec == "auto" else spec
        if not root or not os.path.isdir(root):
            return None, None
        found, held = [], own_steps(root, self.passed)
        for step, path in held:
            try:
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    raise ValueError("a symbolic link or a file, not a checkpoint directory this code writes")
                found.append((path, self._usable(path, step)))
            except (OSError, ValueError) as exc:
                self.passed.add(path, str(exc))
        return (found, len(held), True), None

    def _usable(self, path, named_step):
        """Main process: the manifest of the checkpoint at `path`, or ValueError saying why this run cannot use it
        (read_manifest's checks, then _manifest_problem's, and a step other than its name's)."""
        manifest = read_manifest(path)
        problem = self._manifest_problem(manifest)
        if problem:
            raise ValueError(problem)
        if named_step is not None and manifest["step"] != named_step:
            raise ValueError(f"its {MANIFEST} says step {manifest['step']}, not the step of its name")
        return manifest

    def release(self):
        """The run is over: let the next run write here."""
        if self.held:
            self.held.close()
            self.held = None
        if self.lock:
            self.lock.release()


def _steps(directory):
    """[(step, path)] of the step-* entries in `directory`, oldest first ([] when it cannot be listed)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted((int(m.group(1)), os.path.join(directory, n)) for n in names if (m := NAME.match(n)))


def _model_keys(held, now):
    """(the model file's name, the keys it holds) of a held checkpoint, read through the held descriptor: the
    safetensors header without DeepSpeed or FSDP, DeepSpeed's module state; (None, None) for FSDP."""
    if now["family"] == "full":
        rel = "model.safetensors"
        fd, size = held.held[rel].fileno(), held.files[rel]["size"]
        length = int.from_bytes(os.pread(fd, 8, 0), "little") if size >= 8 else -1
        if not 0 <= length <= min(size - 8, 100 << 20):
            return rel, ["<a header this code does not write>"]
        try:
            header = json.loads(os.pread(fd, length, 8))
        except (ValueError, RecursionError):
            return rel, ["<a header this code does not write>"]
        return rel, [k for k in header if k != "__metadata__"] if isinstance(header, dict) else ["<no table>"]
    if now["family"] == "deepspeed":
        import torch
        rel = next(r for r in sorted(held.held) if r.startswith("pytorch_model/") and r.endswith("_model_states.pt"))
        with weights_only_loading():
            states = torch.load(held.fd_path(rel), map_location="cpu", mmap=True)
        module = states.get("module") if isinstance(states, dict) else None
        return rel, list(module) if isinstance(module, dict) else ["<no module state>"]
    return None, None


def _first_failure(exc):
    """The first line of what went wrong in a load: for torch.distributed.checkpoint's CheckpointException, the first
    failing rank's own exception (its message is otherwise the list of ranks)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]


def _identity(path):
    """(device, inode) of the entry at `path` itself (not followed), or None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None
