"""Rotation: --keep-last K, the older checkpoints deleted once a new one is published.

Owns which entries of --checkpoint-dir a run may delete (docs/checkpoints.md, the threat model: "delete real
checkpoints"): only checkpoints this run family wrote, of an older step, that verify; newest first, as many as
--keep-last keeps are checked file by file (each once per run), the older ones by their manifest and sizes. A
step-* link is unlinked, never followed; another user's entries are never touched (owners.py); anything else (a
planted or damaged look-alike, another engine's or recipe's checkpoint, a later step) is left alone and reported
once, so that it never takes the place of a real checkpoint, which would then be deleted. Nothing is deleted in a
directory that has become one others could rename entries in (accelrun/trust.py's rule, asked at each rotation).
"""

import os
import shutil
import stat
import sys

from ..trust import refusal
from .held import HeldCheckpoint
from .manifest import another_recipe, read_manifest
from .owners import SHOWN, own_steps, theirs
from .rules import incompatibility


class Rotation:
    def __init__(self, scope, keep_last):
        """scope: the run's (checkpointer.Scope); keep_last: --keep-last (0: all kept, never called)."""
        self.scope, self.keep_last = scope, keep_last
        self.left_alone = set()  # step-* entries rotation left alone, each reported once

    def rotate(self, step, final):
        """Main process, after `final` (step `step`) is published: delete the oldest checkpoints this run family
        wrote beyond --keep-last. Newest first, a checkpoint counts only if it verifies (_problem); a step-* link is
        unlinked, never followed; anything else is left alone and reported once."""
        problem = refusal(self.scope.directory, "--checkpoint-dir")
        if problem:  # it became a directory others could rename entries in: nothing there is deleted
            print(f"warning: --keep-last {self.keep_last}: nothing rotated: {problem}", file=sys.stderr, flush=True)
            return
        counted, strange = [], []
        for named_step, path in own_steps(self.scope.directory, self.scope.passed):
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
            problem = self._problem(path, st, named_step, step, checksums=kept)
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

    def _problem(self, path, st, named_step, step, checksums):
        """Main process: None if the directory at `path` (lstat `st`) is a checkpoint of this run family older than
        `step`, which verifies: this user's directory, its manifest valid for this run and its name, its files
        exactly those listed at their sizes, and (checksums) every file's checksum and format."""
        scope = self.scope
        if not stat.S_ISDIR(st.st_mode) or theirs(st):
            return "not a directory of this user's"
        try:
            manifest = read_manifest(path)
        except (OSError, ValueError) as exc:
            return str(exc)
        problem = scope.manifest_problem(manifest) or (
            "another recipe wrote it" if another_recipe(manifest, scope.recipe)
            else incompatibility(manifest, scope.layout, scope.must_match))
        if problem or not manifest["step"] == named_step < step or not checksums or path in scope.verified:
            return problem or (None if manifest["step"] == named_step < step else "not an older step")
        with HeldCheckpoint(path, manifest["files"], follow=False) as held:
            damage, unsafe = held.share_problems(0, 1)
        if not (damage or unsafe):
            scope.verified.add(path)
        return damage or unsafe
