"""The parts Run (run.py) is a façade over, each owning its own state, and passed explicitly to whoever needs it:

    Batch        the batch setup() was given: its global size, the accumulation steps, the clipping
    Throughput   what the throughput counts: the run's unit, the units per micro-batch, FLOPs and peak for MFU
    Lines        the terminal: lines from the main process only, and the progress bar with every mid-epoch line above it
    Clock        the run's times: wall time since Run(), training time across resumed runs, the end's parts
    Evaluation   the recipe's evaluate(): when it is due (cadence.py's rule), run eagerly above the bar, eval.jsonl

None of them reads another's attributes: what one needs of another is given to it when it is built.
"""

import contextlib
import dataclasses
import sys
import time

import torch
from tqdm import tqdm

from .cadence import Progress
from .exits import main_print
from .reporting import evaluation_line


@dataclasses.dataclass(frozen=True)
class Batch:
    """The batch as setup() was given it: samples per optimizer step over all processes, the accumulation steps (the
    Accelerator's), and the clipping norm (0: none)."""
    size: int
    grad_accum: int
    max_grad_norm: float = 0.0


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What the throughput counts (Run(unit=...), then start()'s units_per_sample, flops_per_unit, peak_tflops): the
    run's unit, the global units one micro-batch holds, and for the model FLOPs utilisation the FLOPs per unit and
    one GPU's peak TFLOP/s over all processes."""
    unit: str = "samples"
    per_micro: int = 0
    micro_per_step: int = 1
    flops_per_unit: float = 0
    peak_tflops: float = 0.0
    processes: int = 1

    @property
    def log_key(self):
        """metrics.jsonl's rate field: tokens_per_s for tokens, samples_per_s for every other unit."""
        return f"{self.unit}_per_s" if self.unit == "tokens" else "samples_per_s"

    def counts_mfu(self):
        return bool(self.flops_per_unit and self.peak_tflops)

    def mfu(self, units_per_s):
        return self.flops_per_unit * units_per_s / (self.peak_tflops * 1e12 * self.processes)

    def rates(self, steps, seconds):
        """summary.json's rates for `steps` optimizer steps in `seconds`: {unit}_per_s, and mfu where the recipe counts
        FLOPs (None without a peak)."""
        rate = steps * self.per_micro * self.micro_per_step / max(seconds, 1e-9)
        rates = {f"{self.unit}_per_s": rate}
        if self.flops_per_unit:
            rates["mfu"] = self.mfu(rate) if self.peak_tflops else None
        return rates


class Lines:
    """The terminal: print() on the main process only, and from start() on the progress bar, with every line printed
    mid-epoch above it (say, above) rather than glued onto its end."""

    def __init__(self, accelerator):
        self.print = main_print(accelerator)
        self.bar = None  # start() opens it

    def open_bar(self, accelerator, total, initial):
        self.bar = tqdm(total=total, initial=initial, disable=not (accelerator.is_main_process and sys.stdout.isatty()))

    def _bar_shown(self):
        return self.bar is not None and not self.bar.disable

    def say(self, line):
        """Main process: a line printed while the progress bar may be on the terminal goes above it (tqdm.write), not
        onto its end, and the bar is drawn again below it."""
        if self._bar_shown():
            tqdm.write(line)
        else:
            self.print(line)

    @contextlib.contextmanager
    def above(self):
        """While active, what other code prints mid-epoch (the checkpoint's lines, a recipe's evaluate()) goes above
        the progress bar as say's lines do: the bar is cleared first, so a line does not start at its end
        (`...| 50/468 [00:07<01:02, 6.66it/s]checkpoint saved: ...`), and drawn again below them."""
        if not self._bar_shown():
            yield
            return
        self.bar.clear()
        try:
            yield
        finally:
            self.bar.refresh()


class Clock:
    """The run's times: its wall time since Run(), its training time (that of the runs it resumed included), and
    after the last step what the end spends, by part (summary.json's end_of_run; docs/measuring.md)."""

    def __init__(self):
        self.started = time.perf_counter()
        self.before = 0.0  # training time of the runs before this one (a resumed checkpoint's)
        self.train_start = self.trained_at = None  # when this run's training began; when its last step ended
        self.final_train_time = self.finish_began = None  # set when finish() begins
        self.end_of_run = {"evaluation_s": 0.0, "checkpoint_s": 0.0}

    def start_training(self, before):
        self.before, self.train_start = before, time.perf_counter()

    def train_time(self):
        return self.before + time.perf_counter() - self.train_start

    def wall_time(self):
        return time.perf_counter() - self.started

    def training_done(self):
        self.trained_at = time.perf_counter()

    def after_training(self, part, started):
        """Add the time since `started` to an end_of_run part, when the last step has ended."""
        if self.trained_at is not None:
            self.end_of_run[part] += time.perf_counter() - started

    def finish_begins(self):
        """finish() was called: the training time is final, and what follows is the end's."""
        self.final_train_time, self.finish_began = self.train_time(), time.perf_counter()


class Evaluation:
    """The recipe's evaluate() (None: the run evaluates nothing): whether it is due (cadence.py's rule, at the training
    state's progress), and running it on every rank, eagerly and above the progress bar, into eval.jsonl (log) and
    one line; the evaluation is recorded in the training state (last_eval), which a checkpoint keeps."""

    def __init__(self, evaluate, cadence, log, state, lines, clock, timer):
        self.evaluate, self.cadence, self.log = evaluate, cadence, log
        self.state, self.lines, self.clock, self.timer = state, lines, clock, timer

    def due(self, where, stopping=False):
        s, last = self.state, self.state["last_eval"]
        return self.cadence.evaluation_due(where, Progress(s["step"], s["step_in_epoch"], stopping),
                                           last and last["step"])

    def run(self, when):
        """Collective: run the recipe's evaluate(), log it to eval.jsonl and print one line. A compiled model is
        evaluated eagerly: a second graph (no_grad, eval mode, the evaluation's batch shapes) would cost more to
        compile than the evaluation saves (docs/measuring.md, "The end of a run")."""
        started = time.perf_counter()
        with eager_if_compiled(), self.lines.above():
            result = self.evaluate()
        self.clock.after_training("evaluation_s", started)
        s = self.state
        s["last_eval"] = {"step": s["step"], **result}
        self.log.write({"step": s["step"], "epoch": s["epoch"], **result, "train_time_s": self.clock.train_time()})
        self.lines.say(evaluation_line(when, result))
        self.timer.restart()  # evaluation is not data wait
        return result

    def close(self):
        if self.log:
            self.log.close()


def eager_if_compiled():
    """A context in which a torch.compile'd model runs its original eager code (torch >= 2.6; a no-op before)."""
    if hasattr(torch.compiler, "set_stance"):
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


def compile_again():
    """After a run's end: torch.compile compiles again (its training ended with set_stance('force_eager'), which
    holds for the whole process: a notebook's or a test's next model would otherwise never compile)."""
    if hasattr(torch.compiler, "set_stance"):
        torch.compiler.set_stance("default")
