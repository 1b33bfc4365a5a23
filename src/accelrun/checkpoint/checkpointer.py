"""The one object Run calls for --checkpoint-dir: lock_directory() at start-up, then Checkpointer.

Owns the order of the stages and what the run reads back of them: the lock taken before any data or model is loaded
(lock.py) with the start-up refusal of another recipe's or engine's checkpoint (choose.peek, choose.start_refusal);
then save (save.py) followed by rotation (rotate.py), choose (choose.py) followed by load (load.py), and release;
the newest checkpoint this run wrote or resumed, and the times the summary reports. When to save is Run's decision
(run.py); what a resumed run may change is rules.py's; what a checkpoint holds and how it is read is the other
modules' of this package. Every rank calls every method but release (docs/checkpoints.md).
"""

import time

from ..collectives import main_process_result
from ..engines import Engine
from . import no_times
from .choose import Chooser, distrust, peek, start_refusal
from .formats import FrozenRule
from .layout import size_limit
from .load import load
from .lock import take
from .manifest import run_problem
from .owners import Passed
from .rotate import Rotation
from .save import Saver


def lock_directory(accelerator, directory, resume="auto", recipe=None):
    """Collective, at start-up, before any data or model is loaded: take --checkpoint-dir's lock (one writer per
    directory) on the main process, so that a second run on it stops in seconds; and refuse a checkpoint the resume
    would take that another recipe or engine wrote (the main process reads its manifest). Returns (the lock: the main
    process's, None elsewhere and without --checkpoint-dir; the (path, manifest) the resume would take as far as
    manifests tell, on every rank, or None)."""
    lock, error, peeked = None, None, None
    if accelerator.is_main_process:
        lock, error = take(directory) if directory else (None, None)
        error = error or distrust(None, resume)  # the checkpoint --resume names, where it lies
        peeked = None if error or resume == "none" else peek(directory, resume)
        error = error or (peeked and start_refusal(*peeked, Engine.of(accelerator).layout(), recipe))
        if error and lock:
            lock.release()
    return lock, main_process_result(accelerator, (peeked, error))


class Scope:
    """What every stage asks of this run: its accelerator and --checkpoint-dir, its engine (whose checkpoint format
    it is) and layout, the settings and recipe a checkpoint must match, what a checkpoint of its model can hold, and,
    for the whole run, the entries passed over (each named once) and the checkpoints verified (each checked once)."""

    def __init__(self, accelerator, directory, must_match, model, recipe):
        self.accelerator, self.directory, self.must_match, self.recipe = accelerator, directory, must_match, recipe
        self.engine = Engine.of(accelerator)  # the run's, decided once
        self.layout = self.engine.layout()  # with the accelerator's accumulation steps: a resume may change them
        self.size_limit = size_limit(sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()))
        self.passed = Passed("skipping checkpoint")  # entries not used: another user's, damaged; each named once
        self.verified = set()  # checkpoints in --checkpoint-dir whose every file this run checked or wrote

    def manifest_problem(self, manifest):
        """None, or why a manifest read_manifest accepts is not one this run's save would have written."""
        acc = self.accelerator
        return run_problem(manifest, self.size_limit, len(acc._models), len(acc._optimizers), len(acc._schedulers))


class Checkpointer:
    def __init__(self, accelerator, directory, keep_last, must_match, model, lock, recipe=None):
        """must_match: the settings a resumed run must share (rules.must_match_settings); model: the prepared model,
        whose per-rank buffers FSDP needs kept; lock: lock_directory()'s, taken at start-up; recipe: the recipe's
        name, recorded in each manifest (a checkpoint of another recipe is named as such)."""
        self.scope = Scope(accelerator, directory, must_match, model, recipe)
        self.frozen = FrozenRule(self.scope.engine, model)  # LoRA: what saves leave out
        self.saver = Saver(self.scope, lock, model, self.frozen.save_kwargs)
        self.chooser, self.rotation = Chooser(self.scope, self.frozen), Rotation(self.scope, keep_last)
        self.model, self.lock, self.keep_last = model, lock, keep_last
        self.reshaped = []  # what the resume changed (world size, --grad-accum) and the rules that applied
        self.last_saved_step, self.newest = None, None  # the newest checkpoint this run wrote or resumed: its path
        self.held = None  # the checkpoint choose() verified, held until load() has read it
        self.times = no_times()

    def save(self, step, train_state):
        """Collective: write step-NNNNNNNN, verify and publish it, then rotate the older ones."""
        scope = self.scope
        final, took = self.saver.save(step, {
            "step": step, "layout": scope.layout, "must_match": scope.must_match, "train_state": train_state,
            **({"recipe": scope.recipe} if scope.recipe else {})})
        self.last_saved_step, self.newest = step, final
        scope.verified.add(final)
        self._count_save(final, took)
        if scope.accelerator.is_main_process and self.keep_last:
            self.rotation.rotate(step, final)

    def _count_save(self, final, took):
        """The save's times, for the summary, and its line: where the time went (saver.save's parts)."""
        acc = self.scope.accelerator
        self.times["saves"] += 1
        for part in ("write", "checksum", "flush", "publish"):
            self.times[f"save_{part}_s"] += took["checksums" if part == "checksum" else part]
        if acc.is_main_process:
            print(f"checkpoint saved: {final} (written in {took['write']:.1f} s, checksums by {acc.num_processes} "
                  f"rank(s) in {took['checksums']:.1f} s, flushed to disk in {took['flush']:.1f} s, published in "
                  f"{took['publish']:.1f} s)", flush=True)

    def choose(self, spec):
        """Collective. The checkpoint `spec` names (auto: the newest usable one; the directory of step-*
        checkpoints: its newest usable one), checked by every rank for compatibility, checksums and loadability,
        and held until load() has read it, as (path, manifest); None to start fresh."""
        started = time.perf_counter()
        chosen = self.chooser.choose(spec)
        if chosen is None:
            return None
        path, manifest, self.held = chosen
        self.times["resume_verify_s"] = time.perf_counter() - started
        return path, manifest

    def load(self, path, manifest):
        """Collective: load the checkpoint choose() returned and holds into the prepared objects, reading only the
        files it verified; returns its training state, as this run's ranks carry it."""
        state, self.reshaped, self.times["resume_load_s"] = load(
            self.scope, self.model, self.frozen.load_kwargs, self.held, path, manifest, self.times["resume_verify_s"])
        self.held = None
        self.last_saved_step, self.newest = manifest["step"], path
        return state

    def release(self):
        """The run is over: let the next run write here."""
        if self.held:
            self.held.close()
            self.held = None
        if self.lock:
            self.lock.release()
