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
import time

import torch

from . import float8, results
from .cadence import Cadence, Progress
from .checkpoint import NoCheckpoints
from .checkpoint.rules import must_match_settings
from .engines import Engine, name_the_cpu_for_deepspeed, quiet_deprecated_collectives
from .epochs import resumable_epochs
from .exits import fail, teardown
from .finishing import Report, finish_run
from .flags import RUN_FLAGS
from .launcher import die_with_launcher
from .optimizers import implementation, optimizer_name, repoint_scheduler
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
    first_line,
    peaks_at_start,
    progress_line,
    quiet_progress_bars,
    start_tracking,
)
from .run_parts import Batch, Clock, Evaluation, Lines, Throughput, compile_again
from .run_parts import eager_if_compiled as eager_if_compiled  # where it was: a recipe or test may import it from here
from .sharded_model import BUILT_WHOLE
from .starting import already_complete, keeps_checkpoints, place_again, settle
from .stopping import GracefulStop, how_to_stop, stopped
from .timing import StepTimer


class Run:
    """The façade: each attribute is a part that owns its state (run_parts.py, starting.Settled, cadence.Cadence, the
    checkpointer, the logs), handed explicitly to the module that needs it; no other module reads or sets Run's."""

    def __init__(self, name, args, unit="samples", may_change=None, sequence_parallel=False):
        """Call first in main(): from here on a stop signal is remembered instead of killing the process.
        may_change: {flag: why} for the recipe's flags that a resumed run may change (checkpoint/rules.py).
        sequence_parallel: whether the recipe runs under a config with sequence parallelism (refused here, before
        Accelerator() and anything DeepSpeed compiles, if not)."""
        missing = [flag for flag in (*RUN_FLAGS, *(may_change or {})) if not hasattr(args, flag)]
        if missing:
            raise TypeError(f"Run({name!r}): the parsed flags lack {missing}; call add_run_args(parser, ...)")
        self.name, self.args, self.may_change = name, args, dict(may_change or {})
        self.clock, self.sequence_parallel = Clock(), sequence_parallel
        self.throughput = Throughput(unit)  # start() adds what it counts
        die_with_launcher()
        check_gpus_before_start(sequence_parallel)
        name_the_cpu_for_deepspeed()
        quiet_progress_bars()
        self.stopper, self.stopping = GracefulStop(args.stop_signals, args.checkpoint_dir), False
        # What summary.json says of the run itself, gathered as the run learns it (setup()'s engine facts, how the
        # model was built, then start()'s gradient sync, resume and memory peaks; finish() adds the rest).
        self.facts = {"model_init": BUILT_WHOLE}

    # ---- before prepare() -------------------------------------------------------------------------
    def setup(self, accelerator, *, batch_size, max_grad_norm=0.0, eval_batch_size=None, refuse_offload=None,
              default_output_dir=None):
        """Launch checks (no rank trains alone, the global batch divides), DeepSpeed clipping like
        max_grad_norm, --checkpoint-dir's lock, and the output directory (results.py: the one rule; a run that
        continues its --checkpoint-dir writes where that run wrote). refuse_offload: (why, instead) for SGD recipes.
        default_output_dir: where the results go without --output-dir (runs/<name>/<how it runs> if None). The
        accumulation steps are the Accelerator's, read here, before prepare(): a DeepSpeed config that says
        otherwise is refused in start()."""
        self.accelerator, self.lines = accelerator, Lines(accelerator)
        self.engine = Engine.of(accelerator)  # the way this run runs, asked once (engines/)
        self.batch = Batch(batch_size, accelerator.gradient_accumulation_steps, max_grad_norm)
        grad_accum = self.batch.grad_accum
        check_launch(accelerator)
        check_sequence_parallel(accelerator, self.sequence_parallel)
        quiet_deprecated_collectives()
        if refuse_offload:
            refuse_optimizer_offload(accelerator, *refuse_offload)
        check_batch(accelerator, batch_size, grad_accum, eval_batch_size, self.args)
        self.engine.clip_like(max_grad_norm)
        check_deepspeed_flags(accelerator, grad_accum, max_grad_norm, prepared=False)
        self.engine.reduce_in_fp32()
        self.float8 = self._float8(accelerator)
        self.facts["engine"] = self.engine.facts()  # start() adds how gradients sync: engine_facts
        default_output_dir = default_output_dir or os.path.join("runs", self.name, self.engine.label())
        # The lock, the checkpoint to resume, where results go, a finished run: before any loading (starting.py).
        self.settled = settle(accelerator, self.args, self.name, default_output_dir, self.may_change, self.print)

    def _float8(self, accelerator):
        """Under mixed precision fp8: the engine's refusal, or the choice of layers installed (float8.py); else None."""
        if not float8.asked(accelerator):
            return None
        backend = getattr(accelerator.fp8_backend, "value", accelerator.fp8_backend)  # accelerate's choice, made now
        if problem := float8.backend_problem(backend):
            self.fail(f"mixed precision fp8 with accelerate's backend {backend}: {problem}: install torchao "
                      f"(requirements.txt)")
        if problem := self.engine.float8_problem(self.engine.compiles):
            self.fail(problem)
        return float8.install(accelerator)

    @property
    def output_dir(self):
        """Where the results go: settled by setup(), final from start() on (a continued run moves it to its
        checkpoint's)."""
        return self.settled.output_dir

    @property
    def engine_facts(self):
        """What accelerate set up (engines/: Engine.facts), from start() on with how gradients sync, as the first line
        and the summary say it: the recipe's to read (gpt.py sizes its optimizer state by the DeepSpeed stage)."""
        return self.facts["engine"]

    def print(self, *message, **kwargs):
        """print() on the main process only."""
        self.lines.print(*message, **kwargs)

    @contextlib.contextmanager
    def sharded_init(self, from_pretrained=False, quantized=False):
        """`with run.sharded_init(): model = ...`: under ZeRO-3 and FSDP no process holds it whole
        (sharded_model.py). from_pretrained: a Hugging Face from_pretrained() inside; quantized: loading it quantised
        (every process loads it whole; prepare() shards it)."""
        with self.engine.building(from_pretrained, quantized) as how:
            self.facts["model_init"] = how
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
        acc, args, batch = self.accelerator, self.args, self.batch
        self.seed = torch.initial_seed()  # the recipe's set_seed(); a checkpoint's RNG state keeps it too
        check_deepspeed_flags(acc, batch.grad_accum, batch.max_grad_norm)
        repoint_scheduler(optimizer, scheduler)
        self.optimizer = optimizer
        self.engine.cast_buffers(model)
        self.facts["engine"].update(self.engine.gradient_sync(model))
        if self.float8:
            self.facts["engine"].update(float8.facts(model, self.float8, acc.device.type))
        # Global samples (or tokens) per forward pass, and what a unit costs, for the throughput and MFU.
        self.throughput = Throughput(self.throughput.unit, batch.size // batch.grad_accum * units_per_sample,
                                     batch.grad_accum, flops_per_unit, peak_tflops, acc.num_processes)
        self.cadence = Cadence(steps_per_epoch, total_steps, evaluates=evaluate is not None, eval_every=eval_every,
                               saves=bool(args.checkpoint_dir), checkpoint_every=args.checkpoint_every)
        chosen = self._resume(model, data_facts, total_steps)
        self.lines.print(first_line(acc, self.engine_facts, (batch.size, batch.grad_accum), optimizer, describe,
                                    total_steps, how_to_stop(args.checkpoint_dir)))
        self.state = {"epoch": 0, "step_in_epoch": 0, "step": 0, "epochs_run": 0, "first_loss": None,
                      "final_loss": None, "last_eval": None, "train_time": 0.0, "window": None}
        if chosen:
            self.state.update(self.checkpointer.load(*chosen))  # the log window as this run's ranks carry it
        self._open_logs(chosen, evaluate, total_steps)
        self.clock.start_training(self.state["train_time"])  # the training time of the runs before this one
        self.stopper.begin()  # a stop signal from here on saves a checkpoint; before, it ended the run at once
        self.stopper.on_interrupt(lambda: (self.state["step"], self.checkpointer.newest))

    def _resume(self, model, data_facts, total_steps):
        """The checkpointer, and the checkpoint every rank verified ((path, manifest), or None): the results placed
        again when the manifests alone pointed elsewhere, the run ended (exit 0) when it holds the last step."""
        acc, args, settled = self.accelerator, self.args, self.settled
        must_match = must_match_settings(args, self.may_change, data_facts or {})
        if keeps_checkpoints(args):
            from .checkpoint import Checkpointer
            self.checkpointer = Checkpointer(acc, args.checkpoint_dir, args.keep_last, must_match, model,
                                             settled.lock, self.name)
        else:
            self.checkpointer = NoCheckpoints()
        chosen = self.checkpointer.choose(args.resume)
        if (chosen and chosen[0]) != (settled.peeked and settled.peeked[0]):  # the manifests alone pointed elsewhere
            self.settled = place_again(acc, args, self.name, settled, chosen)
        if chosen and chosen[1]["train_state"]["step"] >= total_steps:
            already_complete(acc, self.print, chosen, self.output_dir, self.checkpointer)
        return chosen

    def _open_logs(self, chosen, evaluate, total_steps):
        """After the checkpoint's state is loaded: the results note, run.json, what the summary says of the start,
        the step timer, metrics.jsonl and eval.jsonl, the trackers, the profiler, the progress bar."""
        acc, args, step = self.accelerator, self.args, self.state["step"]
        if self.settled.results_note:
            self.lines.print(self.settled.results_note)
        if acc.is_main_process:
            results.mark(self.output_dir, self.settled.run_id, self.name)
        layout = chosen[1]["layout"] if chosen else None
        self.facts.update(resumed_from_step=step or None, resumed_from_world_size=layout and layout["world_size"],
                          peaks_at_start=peaks_at_start(acc))  # building, preparing and loading: collective
        self.timer = StepTimer(acc)
        if self.state["window"]:
            self.timer.load_window_state(self.state["window"])
        self.metrics = MetricsLog(acc, self.output_dir, step)
        evals = MetricsLog(acc, self.output_dir, step, "eval.jsonl") if evaluate else None
        self.evaluation = Evaluation(evaluate, self.cadence, evals, self.state, self.lines, self.clock, self.timer)
        start_tracking(acc, args)
        self.profiler = StepProfiler(acc, args.profile, self.output_dir)
        self.lines.open_bar(acc, total_steps, step)

    # ---- the loop ---------------------------------------------------------------------------------
    def epochs(self, loader):
        """Yield each epoch's micro-batches, from where a resumed run left off. After each epoch's body (its
        last step, the run's last step, or a stop): its evaluation, the stop agreement and its checkpoint."""
        s, cadence = self.state, self.cadence
        # The epochs the loader is restarted for: as many as the steps need (none when an epoch has no step).
        epoch_count = math.ceil(cadence.total_steps / cadence.steps_per_epoch) if cadence.steps_per_epoch else 0
        for epoch, done, batches in resumable_epochs(self.accelerator, loader, s, epoch_count,
                                                     cadence.steps_per_epoch, self.batch.grad_accum, self.seed):
            if s["step"] >= cadence.total_steps or self.stopping:
                return
            s["epoch"], s["step_in_epoch"] = epoch, done
            s["epochs_run"] += 0 if done else 1
            yield self._timed(batches)
            if self.evaluation.due("epoch", self.stopping):
                self.evaluation.run(f"epoch {epoch} done")
            if s["step_in_epoch"] == cadence.steps_per_epoch:
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
        s, args, total_steps = self.state, self.args, self.cadence.total_steps
        s["step"] += 1
        s["step_in_epoch"] += 1
        step = s["step"]
        if step >= total_steps:
            self._training_done()
        self.lines.bar.update(1)
        self.profiler.step()
        logged = step % args.log_every == 0 or step in (1, total_steps)
        if logged:
            record = self._log(step, fields)
        else:
            record = {"step": step, "epoch": s["epoch"], **fields} if fields else None
        if self.evaluation.due("step", self.stopping):
            record = {**(record or {}), **self.evaluation.run(f"step {step}")}
        if record is not None:
            self.metrics.write(record)
        # The ranks agree on stopping where they synchronise anyway (a progress line), or every
        # --stop-check-every steps: no host sync in the other steps.
        if logged or (args.stop_check_every and step % args.stop_check_every == 0):
            self.stopping = self.stopper.agreed(self.accelerator)
        if self._checkpoint_due("step"):
            self._save()
        self.timer.bookkeeping_done()
        return self.stopping or step >= total_steps

    # ---- when to save (cadence.py; when to evaluate is the Evaluation's) ----------------------------
    def _checkpoint_due(self, where):
        at = Progress(self.state["step"], self.state["step_in_epoch"], self.stopping)
        return self.cadence.checkpoint_due(where, at, self.checkpointer.last_saved_step)

    # ---- what the decisions trigger -----------------------------------------------------------------
    def _log(self, step, fields):
        s, throughput = self.state, self.throughput
        record = self.timer.record(throughput.per_micro, step=step, epoch=s["epoch"],
                                   lr=self.optimizer.param_groups[0]["lr"], train_time_s=self.clock.train_time(),
                                   **fields)
        rate = throughput.log_key
        record[rate] = record.pop("samples_per_s")
        if throughput.counts_mfu():
            record["mfu"] = throughput.mfu(record[rate])
        s["first_loss"] = record["loss"] if s["first_loss"] is None else s["first_loss"]
        s["final_loss"] = record["loss"]
        self.lines.say(progress_line(record, fields, self.cadence.total_steps, throughput.unit))
        return record

    def mfu(self, units_per_s):
        return self.throughput.mfu(units_per_s)

    def _training_done(self):
        """The last step has ended. From here on a compiled model runs eagerly (the final evaluation, the recipe's
        own use of the model after its loop, the export): one graph, the training one, is all a run compiles."""
        self.clock.training_done()
        if hasattr(torch.compiler, "set_stance"):
            torch.compiler.set_stance("force_eager")

    def _save(self):
        started = time.perf_counter()
        s = self.state
        s["window"] = self.timer.window_state()  # collective
        # "stopped": a checkpoint saved for a stop (the stop command, stop.py, reads it).
        with self.lines.above():
            self.checkpointer.save(s["step"], {**s, "train_time": self.clock.train_time(),
                                               "output_dir": self.output_dir, "run_id": self.settled.run_id,
                                               "stopped": self.stopping, "total_steps": self.cadence.total_steps})
        self.clock.after_training("checkpoint_s", started)

    # ---- the end ----------------------------------------------------------------------------------
    def finish(self, model, exclude=(), export=None, **summary):
        """Collective. After a stop: the message and exit code 75 (1 without checkpoints). Otherwise
        model.safetensors (ZeRO-3 and FSDP shards gathered; or export(weights) on the main process, returning
        its path), summary.json with the SUMMARY line, and where every result went (finishing.py). Returns the exit
        code (a run of several processes ends in it with that code: exits.teardown)."""
        acc, args = self.accelerator, self.args
        self.clock.finish_begins()
        self.profiler.stop()
        self.lines.bar.close()
        if self.stopping:
            compile_again()
            return teardown(acc, stopped(acc, self.stopper, self.state["step"], args.checkpoint_dir))
        self.stopper.ignore_from_now()
        if self.clock.trained_at is None:  # no step left to train (--epochs 0): the end starts here
            self._training_done()
        try:
            finish_run(acc, model, (exclude, export), self.evaluation, self.clock, self._report(summary))
        finally:
            compile_again()
        self.checkpointer.release()
        return teardown(acc, 0)

    def _report(self, recipe_fields):
        """What the end writes the results from (finishing.Report): the run's facts for the summary among them."""
        optimizer = self.optimizer
        facts = {**self.facts, "recipe": self.name, "output_dir": self.output_dir,
                 "optimizer": optimizer_name(optimizer), "optimizer_implementation": implementation(optimizer),
                 "resume_changes": self.checkpointer.reshaped, "args": vars(self.args)}
        return Report(self.output_dir, self.name, self.args.report_to, facts, self.state, self.metrics, self.timer,
                      self.throughput, self.checkpointer.times, self.print, recipe_fields)
