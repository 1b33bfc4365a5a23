"""The run services behind one object, so that a recipe's loop stays the plain PyTorch loop.

Run owns, for every training recipe alike: the launch checks, the epoch loop that a resumed run
re-enters mid-epoch, the step timing, progress lines and metrics.jsonl, when to evaluate and
eval.jsonl, when to save a checkpoint, the profiler, the stop agreement, the exported model
(model.safetensors, or the recipe's own export: finetune_lm.py's save_pretrained), the summary and
the exit code. docs/writing-a-recipe.md is the contract; in short:

    run = Run("mnist", args)                        # first: stop signals are caught from here on
    accelerator = Accelerator(...)
    run.setup(accelerator, batch_size=..., ...)     # launch and batch checks, the output and checkpoint dirs
    with run.sharded_init():                        # optional: built sharded under ZeRO-3 and FSDP
        model = Net()
    ...                                             # data, optimizer, accelerator.prepare
    run.start(model, optimizer, scheduler, ...)     # resume, logs, the first line
    for batches in run.epochs(train_loader):
        for inputs, targets in batches:
            ...                                     # forward, backward, clip, step, zero_grad
            if run.step(loss):                      # timing, logging, evaluation, checkpoint, stop
                break
    return run.finish(model)                        # model.safetensors, summary, exit code

Run reads from the recipe's namespace only the flags add_run_args() adds (RUN_FLAGS, flags.py); everything
else it needs is passed explicitly, or read from the accelerator (its accumulation steps). Checkpoints hold
the step, the position in the epoch, the open log window and the last evaluation: a resumed run writes the
same metrics, line for line (timings aside).
"""

import contextlib
import math
import os
import sys
import time

import torch
from tqdm import tqdm

from . import results
from .cadence import Cadence, Progress
from .checkpoint import NoCheckpoints
from .checkpoint.rules import must_match_settings
from .engines import Engine, name_the_cpu_for_deepspeed, quiet_deprecated_collectives
from .epochs import resumable_epochs
from .exits import fail, main_print, teardown
from .finishing import finish_run
from .flags import RUN_FLAGS
from .launcher import die_with_launcher
from .optimizers import repoint_scheduler
from .refusals import (
    check_batch,
    check_deepspeed_flags,
    check_gpus_before_start,
    check_launch,
    check_sequence_parallel,
    refuse_optimizer_offload,
)
from .reporting import (
    MetricsLog,
    StepProfiler,
    evaluation_line,
    first_line,
    peaks_at_start,
    progress_line,
    quiet_progress_bars,
    start_tracking,
)
from .sharded_model import BUILT_WHOLE
from .starting import already_complete, keeps_checkpoints, place_results, settle
from .stopping import GracefulStop, how_to_stop, stopped
from .timing import StepTimer


class Run:
    def __init__(self, name, args, unit="samples", may_change=None, sequence_parallel=False):
        """Call first in main(): from here on a stop signal is remembered instead of killing the process.
        may_change: {flag: why} for the recipe's flags that a resumed run may change (checkpoint/rules.py).
        sequence_parallel: whether the recipe runs under a config with sequence parallelism (refused here, before
        Accelerator() and anything DeepSpeed compiles, if not)."""
        missing = [flag for flag in (*RUN_FLAGS, *(may_change or {})) if not hasattr(args, flag)]
        if missing:
            raise TypeError(f"Run({name!r}): the parsed flags lack {missing}; call add_run_args(parser, ...)")
        self.name, self.args, self.unit, self.may_change = name, args, unit, dict(may_change or {})
        self.t_start, self.sequence_parallel = time.perf_counter(), sequence_parallel
        die_with_launcher()
        check_gpus_before_start(sequence_parallel)
        name_the_cpu_for_deepspeed()
        quiet_progress_bars()
        self.stopper, self.stopping = GracefulStop(args.stop_signals, args.checkpoint_dir), False
        self.model_init = BUILT_WHOLE

    # ---- before prepare() -------------------------------------------------------------------------
    def setup(self, accelerator, *, batch_size, max_grad_norm=0.0, eval_batch_size=None, refuse_offload=None,
              default_output_dir=None):
        """Launch checks (no rank trains alone, the global batch divides), DeepSpeed clipping like
        max_grad_norm, --checkpoint-dir's lock, and the output directory (results.py: the one rule; a run that
        continues its --checkpoint-dir writes where that run wrote). refuse_offload: (why, instead) for SGD recipes.
        default_output_dir: where the results go without --output-dir (runs/<name>/<how it runs> if None). The
        accumulation steps are the Accelerator's, read here, before prepare(): a DeepSpeed config that says
        otherwise is refused in start()."""
        self.accelerator, self.print = accelerator, main_print(accelerator)
        self.engine = Engine.of(accelerator)  # the way this run runs, asked once (engines/)
        self.batch_size, self.max_grad_norm = batch_size, max_grad_norm
        self.grad_accum = accelerator.gradient_accumulation_steps
        check_launch(accelerator)
        check_sequence_parallel(accelerator, self.sequence_parallel)
        quiet_deprecated_collectives()
        if refuse_offload:
            refuse_optimizer_offload(accelerator, *refuse_offload)
        check_batch(accelerator, batch_size, self.grad_accum, eval_batch_size, self.args)
        self.engine.clip_like(max_grad_norm)
        check_deepspeed_flags(accelerator, self.grad_accum, max_grad_norm, prepared=False)
        self.engine.reduce_in_fp32()
        self.engine_facts = self.engine.facts()
        self.default_output_dir = default_output_dir or os.path.join("runs", self.name, self.engine.label())
        settle(self)  # the lock, the checkpoint to resume, where results go, a finished run: before any loading

    @contextlib.contextmanager
    def sharded_init(self, from_pretrained=False, quantized=False):
        """`with run.sharded_init(): model = ...`: under ZeRO-3 and FSDP no process holds it whole
        (sharded_model.py). from_pretrained: a Hugging Face from_pretrained() inside; quantized: loading it quantised
        (every process loads it whole; prepare() shards it)."""
        with self.engine.building(from_pretrained, quantized) as how:
            self.model_init = how
            yield

    def check_whole_model_fits(self, n_params):
        """Before loading a pretrained model of n_params parameters (and its data): under ZeRO-3 without
        zero3_init_flag every process loads it whole first; stop if they cannot hold it (engines/zero.py)."""
        self.engine.check_whole_model_fits(n_params)

    def fail(self, message):
        """One clear line from the main process; every rank exits 2. Call it on every rank."""
        fail(self.accelerator, message)

    # ---- after prepare() --------------------------------------------------------------------------
    def start(self, model, optimizer, scheduler, *, steps_per_epoch, total_steps, units_per_sample=1,
              data_facts=None, describe="", evaluate=None, eval_every=0, flops_per_unit=0, peak_tflops=0.0):
        """Check what prepare() built, resume from a checkpoint if there is one, open the logs and print
        the run's first line. units_per_sample: how many of the run's units one sample holds (a sequence's
        tokens), for the throughput. data_facts: what the flags do not say about the data (its source, its
        size), which a resumed run must share. evaluate() returns a dict of metrics; it runs every eval_every
        steps and at the last, or (eval_every 0) at each epoch's end, and always on every rank."""
        acc, args = self.accelerator, self.args
        self.seed = torch.initial_seed()  # the recipe's set_seed(); a checkpoint's RNG state keeps it too
        check_deepspeed_flags(acc, self.grad_accum, self.max_grad_norm)
        repoint_scheduler(optimizer, scheduler)
        self.optimizer = optimizer
        self.engine.cast_buffers(model)
        self.engine_facts.update(self.engine.gradient_sync(model))
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps
        # The epochs the loader is restarted for: as many as the steps need (none when an epoch has no step).
        self.epoch_count = math.ceil(total_steps / steps_per_epoch) if steps_per_epoch else 0
        # Global samples (or tokens) per forward pass, for the throughput.
        self.samples_per_micro = self.batch_size // self.grad_accum * units_per_sample
        self.flops_per_unit, self.peak_tflops = flops_per_unit, peak_tflops
        self.evaluate_fn = evaluate
        self.cadence = Cadence(steps_per_epoch, total_steps, evaluates=evaluate is not None, eval_every=eval_every,
                               saves=bool(args.checkpoint_dir), checkpoint_every=args.checkpoint_every)
        must_match = must_match_settings(args, self.may_change, data_facts or {})
        if keeps_checkpoints(args):
            from .checkpoint import Checkpointer
            self.checkpointer = Checkpointer(acc, args.checkpoint_dir, args.keep_last, must_match, model, self.lock,
                                             self.name)
        else:
            self.checkpointer = NoCheckpoints()
        chosen = self.checkpointer.choose(args.resume)
        if (chosen and chosen[0]) != (self.peeked and self.peeked[0]):  # the manifests alone pointed elsewhere
            place_results(self, chosen)
        if chosen and chosen[1]["train_state"]["step"] >= total_steps:
            already_complete(self, *chosen)
        self.print(first_line(acc, self.engine_facts, (self.batch_size, self.grad_accum), optimizer, describe,
                              total_steps, how_to_stop(args.checkpoint_dir)))
        self.state = {"epoch": 0, "step_in_epoch": 0, "step": 0, "epochs_run": 0, "first_loss": None,
                      "final_loss": None, "last_eval": None, "train_time": 0.0, "window": None}
        if chosen:
            self.state.update(self.checkpointer.load(*chosen))  # the log window as this run's ranks carry it
        if self.results_note:
            self.print(self.results_note)
        if acc.is_main_process:
            results.mark(self.output_dir, self.run_id, self.name)
        self.resumed_from = self.state["step"] or None
        self.resumed_layout = chosen[1]["layout"] if chosen else None
        self.peaks_at_start = peaks_at_start(acc)  # building, preparing and loading the model: collective
        self.resumed_time = self.state["train_time"]  # training time of the runs before this one
        self.timer = StepTimer(acc)
        if self.state["window"]:
            self.timer.load_window_state(self.state["window"])
        self.metrics = MetricsLog(acc, self.output_dir, self.state["step"])
        self.evals = MetricsLog(acc, self.output_dir, self.state["step"], "eval.jsonl") if evaluate else None
        start_tracking(acc, args)
        self.profiler = StepProfiler(acc, args.profile, self.output_dir)
        self.bar = tqdm(total=total_steps, initial=self.state["step"],
                        disable=not (acc.is_main_process and sys.stdout.isatty()))
        self.train_start = time.perf_counter()
        self.trained_at = None  # when the last step ended: what follows it is timed by part (end_of_run)
        self.end_of_run = {"evaluation_s": 0.0, "checkpoint_s": 0.0}
        self.stopper.begin()  # a stop signal from here on saves a checkpoint; before, it ended the run at once
        self.stopper.on_interrupt(lambda: (self.state["step"], self.checkpointer.newest))

    def _train_time(self):
        return self.state["train_time"] + time.perf_counter() - self.train_start

    # ---- the loop ---------------------------------------------------------------------------------
    def epochs(self, loader):
        """Yield each epoch's micro-batches, from where a resumed run left off. After each epoch's body (its
        last step, the run's last step, or a stop): its evaluation, the stop agreement and its checkpoint."""
        s = self.state
        for epoch, done, batches in resumable_epochs(self.accelerator, loader, s, self.epoch_count,
                                                     self.steps_per_epoch, self.grad_accum, self.seed):
            if s["step"] >= self.total_steps or self.stopping:
                return
            s["epoch"], s["step_in_epoch"] = epoch, done
            s["epochs_run"] += 0 if done else 1
            yield self._timed(batches)
            if self._evaluation_due("epoch"):
                self._evaluate(f"epoch {epoch} done")
            if s["step_in_epoch"] == self.steps_per_epoch:
                s["epoch"], s["step_in_epoch"] = epoch + 1, 0
            if not self.stopping:  # the ranks synchronise here anyway
                self.stopping = self.stopper.agreed(self.accelerator)
            if self._checkpoint_due("epoch"):
                self._save()
            if self.stopping:
                return

    def _timed(self, batches):
        self.timer.restart()
        for batch in batches:
            self.timer.data_ready()
            yield batch

    def step(self, loss, **fields):
        """After zero_grad, every micro-batch: returns True when the loop must end (a stop or the last step).
        fields: this step's own values (e.g. linear_regression's m and n), written to metrics.jsonl for every
        optimizer step and shown in the progress lines."""
        self.timer.step_done(loss)
        if not self.accelerator.sync_gradients:  # inside an accumulation: not an optimizer step yet
            self.timer.bookkeeping_done()
            return False
        s, args = self.state, self.args
        s["step"] += 1
        s["step_in_epoch"] += 1
        step = s["step"]
        if step >= self.total_steps:
            self._training_done()
        self.bar.update(1)
        self.profiler.step()
        logged = step % args.log_every == 0 or step in (1, self.total_steps)
        if logged:
            record = self._log(step, fields)
        else:
            record = {"step": step, "epoch": s["epoch"], **fields} if fields else None
        if self._evaluation_due("step"):
            record = {**(record or {}), **self._evaluate(f"step {step}")}
        if record is not None:
            self.metrics.write(record)
        # The ranks agree on stopping where they synchronise anyway (a progress line), or every
        # --stop-check-every steps: no host sync in the other steps.
        if logged or (args.stop_check_every and step % args.stop_check_every == 0):
            self.stopping = self.stopper.agreed(self.accelerator)
        if self._checkpoint_due("step"):
            self._save()
        self.timer.bookkeeping_done()
        return self.stopping or step >= self.total_steps

    # ---- the two decisions: when to evaluate, when to save (cadence.py) ----------------------------
    def _at(self):
        return Progress(self.state["step"], self.state["step_in_epoch"], self.stopping)

    def _evaluation_due(self, where):
        last = self.state["last_eval"]
        return self.cadence.evaluation_due(where, self._at(), last and last["step"])

    def _checkpoint_due(self, where):
        return self.cadence.checkpoint_due(where, self._at(), self.checkpointer.last_saved_step)

    # ---- what the decisions trigger -----------------------------------------------------------------
    def _log(self, step, fields):
        s = self.state
        record = self.timer.record(self.samples_per_micro, step=step, epoch=s["epoch"],
                                   lr=self.optimizer.param_groups[0]["lr"], train_time_s=self._train_time(),
                                   **fields)
        rate = f"{self.unit}_per_s" if self.unit == "tokens" else "samples_per_s"
        record[rate] = record.pop("samples_per_s")
        if self.flops_per_unit and self.peak_tflops:
            record["mfu"] = self.mfu(record[rate])
        s["first_loss"] = record["loss"] if s["first_loss"] is None else s["first_loss"]
        s["final_loss"] = record["loss"]
        self._say(progress_line(record, fields, self.total_steps, self.unit))
        return record

    def _say(self, line):
        """Main process: a line printed while the progress bar may be on the terminal goes above it (tqdm.write), not
        onto its end, and the bar is drawn again below it."""
        if self.bar.disable:
            self.print(line)
        else:
            tqdm.write(line)

    @contextlib.contextmanager
    def _above_the_bar(self):
        """While active, what other code prints mid-epoch (the checkpoint's lines, a recipe's evaluate()) goes above
        the progress bar as _say's lines do: the bar is cleared first, so a line does not start at its end
        (`...| 50/468 [00:07<01:02, 6.66it/s]checkpoint saved: ...`), and drawn again below them."""
        if self.bar.disable:
            yield
            return
        self.bar.clear()
        try:
            yield
        finally:
            self.bar.refresh()

    def mfu(self, units_per_s):
        return self.flops_per_unit * units_per_s / (self.peak_tflops * 1e12 * self.accelerator.num_processes)

    def _training_done(self):
        """The last step has ended. From here on a compiled model runs eagerly (the final evaluation, the recipe's
        own use of the model after its loop, the export): one graph, the training one, is all a run compiles."""
        self.trained_at = time.perf_counter()
        if hasattr(torch.compiler, "set_stance"):
            torch.compiler.set_stance("force_eager")

    def _after_training(self, part, started):
        """Add the time since `started` to an end_of_run part, when the last step has ended."""
        if self.trained_at is not None:
            self.end_of_run[part] += time.perf_counter() - started

    def _evaluate(self, when):
        """Collective: run the recipe's evaluate(), log it to eval.jsonl and print one line. A compiled model is
        evaluated eagerly: a second graph (no_grad, eval mode, the evaluation's batch shapes) would cost more to
        compile than the evaluation saves (docs/measuring.md, "The end of a run")."""
        started = time.perf_counter()
        with eager_if_compiled(), self._above_the_bar():
            result = self.evaluate_fn()
        self._after_training("evaluation_s", started)
        s = self.state
        s["last_eval"] = {"step": s["step"], **result}
        self.evals.write({"step": s["step"], "epoch": s["epoch"], **result, "train_time_s": self._train_time()})
        self._say(evaluation_line(when, result))
        self.timer.restart()  # evaluation is not data wait
        return result

    def _save(self):
        started = time.perf_counter()
        s = self.state
        s["window"] = self.timer.window_state()  # collective
        # "stopped": a checkpoint saved for a stop (the stop command, stop.py, reads it).
        with self._above_the_bar():
            self.checkpointer.save(s["step"], {**s, "train_time": self._train_time(), "output_dir": self.output_dir,
                                               "run_id": self.run_id, "stopped": self.stopping,
                                               "total_steps": self.total_steps})
        self._after_training("checkpoint_s", started)

    # ---- the end ----------------------------------------------------------------------------------
    def finish(self, model, exclude=(), export=None, **summary):
        """Collective. After a stop: the message and exit code 75 (1 without checkpoints). Otherwise
        model.safetensors (ZeRO-3 and FSDP shards gathered; or export(weights) on the main process, returning
        its path), summary.json with the SUMMARY line, and where every result went (finishing.py). Returns the exit
        code (a run of several processes ends in it with that code: exits.teardown)."""
        acc, args = self.accelerator, self.args
        train_time, finishing = self._train_time(), time.perf_counter()
        self.profiler.stop()
        self.bar.close()
        if self.stopping:
            return teardown(acc, stopped(acc, self.stopper, self.state["step"], args.checkpoint_dir))
        self.stopper.ignore_from_now()
        if self.trained_at is None:  # no step left to train (--epochs 0): the end starts here
            self._training_done()
        finish_run(self, model, exclude, export, summary, (train_time, finishing))
        self.checkpointer.release()
        return teardown(acc, 0)


def eager_if_compiled():
    """A context in which a torch.compile'd model runs its original eager code (torch >= 2.6; a no-op before)."""
    if hasattr(torch.compiler, "set_stance"):
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()
