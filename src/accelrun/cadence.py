"""When a run evaluates and when it saves a checkpoint: Run's two decisions, as a small object of pure functions.

Owns the rules docs/writing-a-recipe.md states, and nothing else (no accelerator, no file, no clock):
  * evaluate every `eval_every` steps and at the last step; or, with eval_every 0, at each epoch's end; and at the
    end of a run whose last evaluation is not of its last step (--epochs 0 evaluates the initial model); never
    after a stop, so that the resumed run evaluates where the uninterrupted one would have;
  * save at a stop and at the last step, always; otherwise every --checkpoint-every steps when it is given, else
    at each epoch's end; a step that ends an epoch's body is saved at the epoch boundary, after its evaluation, so
    that the checkpoint holds it; never the same step twice.
Where is "step" (after an optimizer step), "epoch" (at the epoch boundary, after the epoch's body) or "end".
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """Where the run is: its optimizer steps, those of the current epoch, and whether it is stopping."""
    step: int
    step_in_epoch: int
    stopping: bool = False


@dataclass(frozen=True)
class Cadence:
    steps_per_epoch: int
    total_steps: int
    evaluates: bool = False  # the recipe gave an evaluate()
    eval_every: int = 0
    saves: bool = False  # --checkpoint-dir was given
    checkpoint_every: int = 0

    def ends_epoch_body(self, at):
        """This step is followed by the epoch boundary: the epoch's last step, the run's, or a stop."""
        return at.stopping or at.step_in_epoch == self.steps_per_epoch or at.step >= self.total_steps

    def evaluation_due(self, where, at, last_eval_step=None):
        """Whether to evaluate at `where`, `at` this progress; last_eval_step: the step of the last evaluation."""
        if not self.evaluates or at.stopping:
            return False
        if where == "end":
            return last_eval_step != at.step
        if where == "step":
            return bool(self.eval_every) and (at.step % self.eval_every == 0 or at.step >= self.total_steps)
        return not self.eval_every

    def checkpoint_due(self, where, at, last_saved_step=None):
        """Whether to save at `where`, `at` this progress; last_saved_step: the step of the newest checkpoint."""
        every = self.checkpoint_every
        if not self.saves or at.step == last_saved_step:
            return False
        if where == "step":
            return bool(every) and at.step % every == 0 and not self.ends_epoch_body(at)
        if at.stopping or at.step >= self.total_steps:
            return True
        return at.step % every == 0 if every else True
