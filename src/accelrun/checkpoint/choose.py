"""Choosing the checkpoint a run resumes from: the candidates, their verification by every rank, the fall back to an
older one, the refusal of a fresh start over checkpoints, and the start-up look at what the resume would take.

Owns --resume's choice (docs/checkpoints.md, the flags and "What a checkpoint can and cannot do"): auto takes the
newest of this user's step-* in --checkpoint-dir that verifies, a PATH that checkpoint or an error (or, the
directory of step-* checkpoints, its newest that verifies), none starts fresh unless --checkpoint-dir holds this
user's checkpoints. A candidate's manifest must be one this run would have written (manifest.run_problem) and its
settings ones this run may continue (rules.incompatibility); then every rank checks its share of the files, held
open from here to the load (held.HeldCheckpoint), and the ranks pool their verdicts
(collectives.checked_by_every_rank): damage makes auto fall back to an older one (one warning each) and is one
error for a PATH; a file that would run code stops every rank, whatever --resume says. Nothing is read from a
directory others could rename entries in (distrust: accelrun/trust.py's rule). peek(), at start-up, reads
manifests and sizes alone: what it finds decides the refusal of another recipe's or engine's checkpoint before any
data or model is loaded (start_refusal) and where the results go, which choose() confirms.
"""

import os
import stat

from ..collectives import checked_by_every_rank, main_process_result
from ..exits import fail
from ..trust import refusal
from .formats import files_problem
from .held import HeldCheckpoint
from .layout import MANIFEST, steps
from .manifest import another_recipe, read_manifest, state_problem
from .owners import own_steps
from .rules import RESHAPE, checkpoint_kind, incompatibility


def distrust(directory, resume):
    """Main process: None, or the one line refusing what this choice would read or remove (trust.refusal, the one
    rule): --checkpoint-dir `directory`, and the directory holding the checkpoint --resume names (a checkpoint: its
    parent; a directory of step-* checkpoints: itself), asked at start-up (checkpointer.lock_directory) and again
    at each choice."""
    problem = refusal(directory, "--checkpoint-dir") if directory else None
    if problem or resume in (None, "auto", "none"):
        return problem
    path = os.path.abspath(resume)
    holds_steps = not os.path.lexists(os.path.join(path, MANIFEST)) and steps(path)
    return refusal(path if holds_steps else os.path.dirname(path), "--resume")


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


def finished(peeked, directory, flags):
    """Main process: the path of the checkpoint the resume would take (peek's) when it ends the run it belongs to, so
    the same command again can say so before any data or model loads: it continues `directory` (this run's
    --checkpoint-dir), holds its run's last step, was written with these `flags` (rules.must_match_settings without
    data facts; what RESHAPE lets change aside), and verifies here (checksums and formats, as choose() checks
    them). None otherwise: start() then decides with the model built."""
    if not (peeked and directory and os.path.realpath(os.path.dirname(peeked[0])) == os.path.realpath(directory)):
        return None
    path, manifest = peeked
    state, saved = manifest["train_state"], manifest["must_match"]
    if state_problem(manifest) or state["step"] != state["total_steps"] or any(
            saved.get(k) != v for k, v in flags.items() if k not in RESHAPE):
        return None
    with HeldCheckpoint(path, manifest["files"], follow=False) as held:
        damage, unsafe = held.share_problems(0, 1)
    return None if damage or unsafe else path


def _written_by_another(path, manifest, recipe):
    """None, or the line refusing a checkpoint another recipe wrote (manifest.another_recipe)."""
    other = another_recipe(manifest, recipe)
    if other:
        return f"cannot resume from {path}: it was written by {other}.py, and this is {recipe}.py. Give a " \
               f"checkpoint of {recipe}.py, or another --checkpoint-dir."
    return None


def start_refusal(path, manifest, now, recipe):
    """Main process, at start-up: None, or why the checkpoint at `path` cannot be this run's, from its manifest
    alone: another recipe wrote it, or another engine (its files differ); `now`: this run's layout."""
    problem = _written_by_another(path, manifest, recipe)
    if problem:
        return problem
    if checkpoint_kind(manifest["layout"]) != checkpoint_kind(now):
        return f"cannot resume from {path}: {incompatibility(manifest, now, {})}. Use the original config, or start " \
               f"fresh with another --checkpoint-dir."
    return None


class Chooser:
    def __init__(self, scope, frozen):
        """scope: the run's (checkpointer.Scope); frozen: its frozen-weights rule (formats.FrozenRule), whose
        model-file check a candidate passes too."""
        self.scope, self.frozen = scope, frozen

    def choose(self, spec):
        """Collective. The checkpoint `spec` names (auto: the newest usable one; the directory of step-*
        checkpoints: its newest usable one), checked by every rank for compatibility, checksums and loadability,
        as (path, manifest, held: its files held open until the load has read them); None to start fresh."""
        scope = self.scope
        acc, result = scope.accelerator, (None, None)
        where = scope.directory if spec == "auto" else spec
        if acc.is_main_process:
            problem = distrust(scope.directory, spec)
            result = (None, problem) if problem else (
                self._refuse_fresh_start() if spec == "none" else self._candidates(spec))
            scope.passed.close(where)
        candidates, held, fall_back = main_process_result(acc, result) or ([], 0, False)
        for path, manifest in candidates:
            self._check_compatible(path, manifest)
            checkpoint = HeldCheckpoint(path, manifest["files"], follow=spec != "auto")
            also = self.frozen.model_file_problem if acc.is_main_process and self.frozen.frozen else None
            damage, unsafe = checked_by_every_rank(acc, checkpoint, also)
            if unsafe:  # not damage: a file this code never writes. Stop, whatever --resume says.
                checkpoint.close()
                fail(acc, f"checkpoint {path} cannot be used: {unsafe}. This code never writes such a file: find "
                          f"out who did, and do not load it by other means.")
            if not damage:
                if os.path.dirname(path) == scope.directory:
                    scope.verified.add(path)
                return path, manifest, checkpoint
            checkpoint.close()
            if not fall_back:
                fail(acc, f"checkpoint {path} cannot be used: {damage}. Pick another one, or --resume auto "
                          f"for the newest complete one.")
            if acc.is_main_process:
                scope.passed.add(path, damage)
        if acc.is_main_process:
            scope.passed.close(where)
        if held:  # this user's checkpoints: starting fresh would rotate them away
            fail(acc, f"--resume {spec}: none of the {held} checkpoint(s) in {where} can be used (the warnings above "
                      f"say why). Give another --checkpoint-dir, or remove them.")
        return None

    def _check_compatible(self, path, manifest):
        """Collective (every rank has the same manifest): refuse a checkpoint this run cannot continue."""
        scope = self.scope
        problem = _written_by_another(path, manifest, scope.recipe)
        if problem:
            fail(scope.accelerator, problem)
        problem = incompatibility(manifest, scope.layout, scope.must_match)
        if problem:
            fail(scope.accelerator, f"cannot resume from {path}: {problem}. Use the original settings, or start "
                                    f"fresh with another --checkpoint-dir.")

    def _refuse_fresh_start(self):
        """Main process: --resume none into a directory that holds this user's checkpoints would rotate them away."""
        directory = self.scope.directory
        held = [os.path.basename(p) for _, p in own_steps(directory, self.scope.passed)] if directory else []
        if not held:
            return None, None
        return None, (f"--resume none, but --checkpoint-dir {directory} already holds {len(held)} "
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
            if os.path.lexists(os.path.join(spec, MANIFEST)) or not steps(spec):
                try:
                    return ([(spec, self._usable(spec, None))], 1, False), None
                except ValueError as exc:
                    return None, (f"checkpoint {spec} cannot be used: {exc}. Pick another one, or --resume auto "
                                  f"for the newest complete one.")
            print(f"--resume {spec}: a directory of checkpoints; resuming from its newest complete one",
                  flush=True)
        root = self.scope.directory if spec == "auto" else spec
        if not root or not os.path.isdir(root):
            return None, None
        found, held = [], own_steps(root, self.scope.passed)
        for step, path in held:
            try:
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    raise ValueError("a symbolic link or a file, not a checkpoint directory this code writes")
                found.append((path, self._usable(path, step)))
            except (OSError, ValueError) as exc:
                self.scope.passed.add(path, str(exc))
        return (found, len(held), True), None

    def _usable(self, path, named_step):
        """Main process: the manifest of the checkpoint at `path`, or ValueError saying why this run cannot use it
        (read_manifest's checks, then manifest.run_problem's, and a step other than its name's)."""
        manifest = read_manifest(path)
        problem = self.scope.manifest_problem(manifest)
        if problem:
            raise ValueError(problem)
        if named_step is not None and manifest["step"] != named_step:
            raise ValueError(f"its {MANIFEST} says step {manifest['step']}, not the step of its name")
        return manifest
