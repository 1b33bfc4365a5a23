"""The run services behind one object, so that a recipe's loop stays the plain PyTorch loop.

Run owns, for every training recipe alike: the launch checks, the epoch loop that a resumed run
re-enters mid-epoch, the step timing, progress lines and metrics.jsonl, evaluation cadence and
eval.jsonl, the profiler, checkpoints, the stop agreement, the exported model (model.safetensors,
or the recipe's own export: finetune_lm.py's save_pretrained), the summary and the exit code:

    run = Run("mnist", args)                        # first: stop signals are caught from here on
    accelerator = Accelerator(..., log_with=run.tracker, project_dir=args.output_dir)
    run.setup(accelerator)                          # launch and batch checks, DeepSpeed clipping
    with run.sharded_init(): model = Net()          # optional: built sharded under ZeRO-3 and FSDP
    ...                                             # data, optimizer, accelerator.prepare
    run.start(model, optimizer, scheduler, ...)     # resume, logs, the first line
    for batches in run.epochs(train_loader):
        for inputs, targets in batches:
            ...                                     # forward, backward, clip, step, zero_grad
            if run.step(loss):                      # timing, logging, eval, checkpoint, stop
                break
    return run.finish(model)                        # model.safetensors, summary, exit code

Checkpoints hold the step, the position in the epoch, the open log window and the last evaluation:
a resumed run writes the same metrics, line for line (timings aside).
"""

import itertools
import os
import sys
import time

from safetensors.torch import save_file
from tqdm import tqdm

from .building import building_context
from .checkpoints import Checkpointer, add_checkpoint_args
from .checks import (cast_buffers_for_half_precision, check_batch, check_gpus_before_start, check_deepspeed_flags, check_launch,
                     deepspeed_clip_like, engine, fail, finish, fsdp_reduce_in_fp32, gradient_sync, implementation,
                     innermost_optimizer, main_print, refuse_optimizer_offload, stepping_optimizer)
from .reporting import (MetricsLog, StepProfiler, add_observability_args, footprint, peaks_at_start, plot_curves,
                        start_tracking, write_summary)
from .stopping import GracefulStop, die_with_launcher, stopped
from .timing import StepTimer


def add_run_args(parser):
    """The flags every training recipe shares: checkpoints, stopping, --report-to and --profile."""
    add_checkpoint_args(parser)
    add_observability_args(parser)


def resumable_epochs(accelerator, loader, progress, epochs, steps_per_epoch, grad_accum=1):
    """Yield (epoch, optimizer steps already done in it, micro-batch iterator), resuming mid-epoch exactly.

    set_epoch makes the shuffle depend on (seed, epoch) only, so a resumed run sees the same order,
    and skip_first_batches fast-forwards through what the checkpoint already holds. islice stops at
    a whole number of optimizer steps: --grad-accum never makes a short step.
    """
    for epoch in range(progress["epoch"], epochs):
        loader.set_epoch(epoch)
        done = progress["step_in_epoch"] if epoch == progress["epoch"] else 0
        batches = accelerator.skip_first_batches(loader, done * grad_accum) if done else loader
        yield epoch, done, itertools.islice(batches, (steps_per_epoch - done) * grad_accum)


class Run:
    def __init__(self, name, args, unit="samples"):
        """Call first in main(): from here on a stop signal is remembered instead of killing the process."""
        self.name, self.args, self.unit = name, args, unit
        self.t_start = time.perf_counter()
        die_with_launcher()
        check_gpus_before_start()
        self.stopper, self.stopping = GracefulStop(args.stop_signals), False  # cadence: run.step's
        self.tracker = "tensorboard" if args.report_to == "tensorboard" else None  # Accelerator(log_with=...)
        self.model_init = "built whole on every process"

    # ---- before prepare() -------------------------------------------------------------------------
    def setup(self, accelerator, refuse_offload=None):
        """Launch checks (no rank trains alone, the global batch divides), and DeepSpeed clipping like the
        recipe's --max-grad-norm (0 without the flag). refuse_offload: (why, instead) for SGD recipes."""
        self.accelerator, args, self.print = accelerator, self.args, main_print(accelerator)
        check_launch(accelerator)
        if refuse_offload:
            refuse_optimizer_offload(accelerator, *refuse_offload)
        self.grad_accum = getattr(args, "grad_accum", 1)
        check_batch(accelerator, args.batch_size, self.grad_accum, getattr(args, "eval_batch_size", None))
        deepspeed_clip_like(accelerator, getattr(args, "max_grad_norm", 0.0))
        fsdp_reduce_in_fp32(accelerator)
        self.engine = engine(accelerator)
        # The directory's lock first: a second run on it stops in seconds, before it loads data or a model.
        self.checkpointer = Checkpointer(accelerator, args.checkpoint_dir, args.keep_last, must_match={})

    def sharded_init(self, from_pretrained=False):
        """`with run.sharded_init(): model = ...`: under ZeRO-3 and FSDP no process holds it whole (building.py)."""
        return building_context(self, from_pretrained)

    def fail(self, message):
        """One clear line from the main process; every rank exits 2. Call it on every rank."""
        fail(self.accelerator, message)

    # ---- after prepare() --------------------------------------------------------------------------
    def start(self, model, optimizer, scheduler, *, steps_per_epoch, total_steps, epochs, samples_per_micro,
              must_match, describe="", evaluate=None, eval_every=0, flops_per_unit=0):
        """Check what prepare() built, resume from a checkpoint if there is one, open the logs and print
        the run's first line. evaluate() returns a dict of metrics; it runs at each epoch's end, or every
        eval_every steps and at the last, and always on every rank (it may gather)."""
        acc, args = self.accelerator, self.args
        check_deepspeed_flags(acc, self.grad_accum, getattr(args, "max_grad_norm", 0.0))
        self.optimizer, self.optimizer_name = optimizer, stepping_optimizer(optimizer, scheduler)
        self.optimizer_impl = implementation(innermost_optimizer(optimizer))
        cast_buffers_for_half_precision(acc, model)
        self.engine.update(gradient_sync(acc, model))
        self.steps_per_epoch, self.total_steps, self.epoch_count = steps_per_epoch, total_steps, epochs
        self.samples_per_micro, self.flops_per_unit = samples_per_micro, flops_per_unit
        self.evaluate_fn, self.eval_every = evaluate, eval_every
        e, world = self.engine, acc.num_processes
        self.print(f"{e['distributed_type']} | {world} processes | mixed precision {e['mixed_precision']} | ZeRO stage "
                   f"{e['deepspeed_stage'] or '-'} | optimizer {self.optimizer_name} ({self.optimizer_impl}) | global batch {args.batch_size} "
                   f"({self.grad_accum} x {args.batch_size // self.grad_accum // world} per process) | "
                   f"{describe + ' | ' if describe else ''}{total_steps} steps")
        self.checkpointer.must_match, self.checkpointer.model = must_match, model
        self.state = {"epoch": 0, "step_in_epoch": 0, "step": 0, "epochs_run": 0, "first_loss": None,
                      "final_loss": None, "last_eval": None, "train_time": 0.0, "window": None}
        self.state.update(self.checkpointer.resume(args.resume) or {})
        self.resumed_from = self.state["step"] or None
        self.peaks_at_start = peaks_at_start(acc)  # building, preparing and loading the model: collective
        self._resumed_time = self.state["train_time"]  # training time of the runs before this one
        self.timer = StepTimer(acc)
        if self.state["window"]:
            self.timer.load_window_state(self.state["window"])
        self.metrics = MetricsLog(acc, args.output_dir, self.state["step"])
        self.evals = MetricsLog(acc, args.output_dir, self.state["step"], "eval.jsonl")
        start_tracking(acc, args)
        self.profiler = StepProfiler(acc, args.profile, args.output_dir)
        self.bar = tqdm(total=total_steps, initial=self.state["step"],
                        disable=not (acc.is_main_process and sys.stdout.isatty()))
        self.train_start = time.perf_counter()

    def _train_time(self):
        return self.state["train_time"] + time.perf_counter() - self.train_start

    # ---- the loop ---------------------------------------------------------------------------------
    def epochs(self, loader):
        """Yield each epoch's micro-batches, from where a resumed run left off. After each epoch's body:
        its evaluation (per-epoch recipes), its checkpoint and a stop check."""
        s = self.state
        for epoch, done, batches in resumable_epochs(self.accelerator, loader, s, self.epoch_count,
                                                     self.steps_per_epoch, self.grad_accum):
            if s["step"] >= self.total_steps or self.stopping:
                return
            s["epoch"], s["step_in_epoch"] = epoch, done
            s["epochs_run"] += 0 if done else 1
            yield self._timed(batches)
            if self.stopping:
                return
            if self.evaluate_fn and not self.eval_every:
                self._evaluate(f"epoch {epoch} done")
            if s["step_in_epoch"] == self.steps_per_epoch:
                s["epoch"], s["step_in_epoch"] = epoch + 1, 0
            self._save()
            self.stopping = self.stopper.agreed(self.accelerator, force=True)

    def _timed(self, batches):
        self.timer.restart()
        for batch in batches:
            self.timer.data_ready()
            yield batch

    def step(self, loss):
        """After zero_grad, every micro-batch: returns True when the loop must end (a stop or the last step)."""
        self.timer.step_done(loss)
        if not self.accelerator.sync_gradients:  # inside an accumulation: not an optimizer step yet
            self.timer.bookkeeping_done()
            return False
        s, args = self.state, self.args
        s["step"] += 1
        s["step_in_epoch"] += 1
        step = s["step"]
        self.bar.update(1)
        self.profiler.step()
        record = None
        if step % args.log_every == 0 or step in (1, self.total_steps):
            record = self._log(step)
        if self.evaluate_fn and self.eval_every and (step % self.eval_every == 0 or step == self.total_steps):
            result = self._evaluate(f"step {step}")
            if record is not None:
                self.metrics.write({**record, **result})
        elif record is not None:
            self.metrics.write(record)
        # The ranks agree on stopping where they synchronise anyway (a progress line), or every
        # --stop-check-every steps: no host sync in the other steps.
        if record is not None or (args.stop_check_every and step % args.stop_check_every == 0):
            self.stopping = self.stopper.agreed(self.accelerator, force=True)
        # An epoch's last step is saved at the epoch's end, after its evaluation (unless stopping now).
        epoch_ends = s["step_in_epoch"] == self.steps_per_epoch or step >= self.total_steps
        if self.stopping or (args.checkpoint_every and step % args.checkpoint_every == 0 and not epoch_ends):
            self._save()
        self.timer.bookkeeping_done()
        return self.stopping or step >= self.total_steps

    def _log(self, step):
        s = self.state
        record = self.timer.record(self.samples_per_micro, step=step, epoch=s["epoch"],
                                   lr=self.optimizer.param_groups[0]["lr"], train_time_s=self._train_time())
        rate = f"{self.unit}_per_s" if self.unit == "tokens" else "samples_per_s"
        record[rate] = record.pop("samples_per_s")
        if self.flops_per_unit and self.args.peak_tflops:
            record["mfu"] = self._mfu(record[rate])
        s["first_loss"] = record["loss"] if s["first_loss"] is None else s["first_loss"]
        s["final_loss"] = record["loss"]
        line = (f"epoch {s['epoch']} step {step}/{self.total_steps} | loss {record['loss']:.4f} | "
                f"{record[rate]:.0f} {self.unit}/s" + (f" | MFU {100 * record['mfu']:.1f}%" if "mfu" in record else "")
                + f" | per micro-batch: data {record['data_ms']:.1f} ms, forward+backward "
                  f"{record['forward_backward_ms']:.1f} ms, optimizer {record['optimizer_ms']:.1f} ms, other "
                  f"{record['other_ms']:.1f} ms ({100 * record['data_fraction']:.0f}% waiting for data)")
        tqdm.write(line) if not self.bar.disable else self.print(line)
        return record

    def _mfu(self, units_per_s):
        return self.flops_per_unit * units_per_s / (self.args.peak_tflops * 1e12 * self.accelerator.num_processes)

    def _evaluate(self, when):
        """Collective: run the recipe's evaluate(), log it to eval.jsonl and print one line."""
        result = self.evaluate_fn()
        s = self.state
        s["last_eval"] = {"step": s["step"], **result}
        self.evals.write({"step": s["step"], "epoch": s["epoch"], **result, "train_time_s": self._train_time()})
        self.print(f"{when} | " + " | ".join(_shown(k, v) for k, v in result.items()))
        self.timer.restart()  # evaluation is not data wait
        return result

    def _save(self):
        if not self.args.checkpoint_dir:
            return
        s = self.state
        s["window"] = self.timer.window_state()  # collective
        self.checkpointer.save(s["step"], {**s, "train_time": self._train_time()})

    # ---- the end ----------------------------------------------------------------------------------
    def finish(self, model, exclude=(), export=None, **summary):
        """Collective. After a stop: the message and exit code 75 (1 without checkpoints). Otherwise the
        final evaluation if the last one is stale, model.safetensors (ZeRO-3 and FSDP shards gathered; or
        export(weights) on the main process, returning its path), summary.json with the SUMMARY line, and
        where every result went. Returns the exit code."""
        acc, args, s = self.accelerator, self.args, self.state
        train_time = self._train_time()
        self.profiler.stop()
        self.bar.close()
        if self.stopping:
            code = stopped(acc, self.stopper, s["step"], args.checkpoint_dir)
            finish(acc)
            return code
        self.stopper.ignore_from_now()
        if self.evaluate_fn and (s["last_eval"] is None or s["last_eval"]["step"] != s["step"]):
            s["last_eval"] = {"step": s["step"], **self.evaluate_fn()}
        state_dict = acc.get_state_dict(model)  # collective: gathers ZeRO-3 / FSDP shards
        shards = footprint(acc, model)
        timing = self.timer.timing(self.samples_per_micro, self.unit)
        if acc.is_main_process:
            out = args.output_dir
            # torch.compile (a *_compile.yaml) prefixes every key with _orig_mod.: export the model's own names.
            # fp32 from every config: DeepSpeed's bf16 engines would otherwise export bf16, DDP and FSDP fp32.
            named = ((k.replace("_orig_mod.", ""), v) for k, v in state_dict.items())
            weights = {k: (v.float() if v.is_floating_point() else v).contiguous().cpu()
                       for k, v in named if k not in exclude}
            exported = export(weights) if export else os.path.join(out, "model.safetensors")
            if not export:
                save_file(weights, exported)
            this_run = s["step"] - (self.resumed_from or 0)
            rate = this_run * self.samples_per_micro * self.grad_accum / max(train_time - self._resumed_time, 1e-9)
            t = self.timer
            self.metrics.close(), self.evals.close()
            if args.report_to != "none":
                self.print(f"curves: {plot_curves(out, self.name)}")
            evaluation = {k: v for k, v in (s["last_eval"] or {}).items() if k != "step"}
            write_summary(out, {
                "recipe": self.name, **self.engine, "optimizer": self.optimizer_name,
                "optimizer_implementation": self.optimizer_impl, "steps": s["step"],
                "epochs": s["epochs_run"], "resumed_from_step": self.resumed_from, "first_loss": s["first_loss"],
                "final_loss": s["final_loss"], **evaluation, f"{self.unit}_per_s": rate,
                **({"mfu": self._mfu(rate) if args.peak_tflops else None} if self.flops_per_unit else {}),
                "data_time_s": t.total_data, "compute_time_s": t.total_compute,
                "data_fraction": t.total_data / max(t.total_data + t.total_compute, 1e-9), "exported_dtype": "float32",
                "param_elements": sum(v.numel() for k, v in weights.items()
                                      if v.is_floating_point() and "running" not in k),
                **shards, "model_init": self.model_init, **self.peaks_at_start,
                "checkpoints": self.checkpointer.times, "timing": timing, **summary,
                "wall_time_s": time.perf_counter() - self.t_start, "args": vars(args)})
            self.print("results: " + ", ".join([os.path.join(out, name) for name in ("summary.json", "metrics.jsonl",
                                                "eval.jsonl") if os.path.exists(os.path.join(out, name))] + [exported]))
        self.checkpointer.release()
        finish(acc)
        return 0


def _shown(key, value):
    name = key.replace("_", " ")
    if isinstance(value, float):
        return f"{name} {100 * value:.2f}%" if key.endswith("accuracy") else f"{name} {value:.4f}"
    return f"{name} {value}"
