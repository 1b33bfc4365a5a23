"""Where a step's time goes, measured without stalling the GPU.

Owns StepTimer: the loss and the time split of each micro-batch into
  * data: the loop waiting for the loader's next batch;
  * forward_backward: from the batch to the optimizer step (clipping included);
  * optimizer: the optimizer step and zero_grad;
  * other: the run's own per-step bookkeeping (logging, checkpoints, the stop agreement).

The recipe calls nothing for this. The run object marks the batch handed over and the end of
run.step(); a global optimizer pre-step hook marks the start of the optimizer step (under
DeepSpeed that is inside accelerator.backward(), hence `optimizer_in_backward`). On a GPU each
mark is a CUDA event recorded on the stream, read only when a progress line is written, so no
step waits for the device; on a CPU each mark is the wall clock.
"""

import time

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .engines import Engine

PHASES = ("data", "forward_backward", "optimizer", "other")


class StepTimer:
    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.cuda = accelerator.device.type == "cuda"
        self.total_data = self.total_compute = 0.0  # the whole run's, across resumes (load_window_state)
        self.first_step_at = None  # wall-clock time of this process's first finished micro-batch
        self.steady = dict.fromkeys(PHASES, 0.0)  # after the first micro-batch: what bench/ compares
        self.steady_micro = 0
        self.pending = []  # (phase, start mark, end mark, counts in steady state)
        self.micro_index = 0  # micro-batches finished by this process
        self.in_step = self.optimizer_marked = False
        self.last = self._now()
        self.hook = register_optimizer_step_pre_hook(self._optimizer_starts)
        self.reset()

    def reset(self):
        """A new window: the loss and phases since the last progress line."""
        self.window = dict.fromkeys(PHASES, 0.0)
        self.micro = 0
        self.loss = torch.zeros((), dtype=torch.float64, device=self.accelerator.device)

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _lap(self, phase, finished=0):
        now = self._now()
        # The steady state leaves out this process's first micro-batch, which pays for lazy initialisation.
        self.pending.append((phase, self.last, now, self.micro_index - finished > 0))
        self.last = now

    def restart(self):
        """The time from here to the next batch counts as data wait (start of an epoch, after an evaluation)."""
        self.last = self._now()

    def data_ready(self):
        self._lap("data")
        self.in_step, self.optimizer_marked = True, False

    def _optimizer_starts(self, optimizer, args, kwargs):
        if self.in_step and not self.optimizer_marked:  # the first optimizer of a nested wrapper stack
            self._lap("forward_backward")
            self.optimizer_marked = True

    def step_done(self, loss):
        """After zero_grad: the micro-batch's compute is over."""
        self._lap("optimizer" if self.optimizer_marked else "forward_backward")
        self.in_step = False
        self.loss += loss.detach()
        self.micro += 1
        if self.first_step_at is None:
            self.first_step_at = time.time()
        self.micro_index += 1

    def bookkeeping_done(self):
        self._lap("other", finished=1)  # step_done has already counted this micro-batch

    def resolve(self):
        """Turn the pending marks into seconds. On a GPU this waits for the last mark's event: call it
        only where the run synchronises anyway (a progress line, a checkpoint, the end)."""
        if not self.pending:
            return
        if self.cuda:
            self.pending[-1][2].synchronize()
        for phase, start, end, steady in self.pending:
            seconds = start.elapsed_time(end) / 1000 if self.cuda else end - start
            self.window[phase] += seconds
            if phase == "data":
                self.total_data += seconds
            else:
                self.total_compute += seconds
            if steady:
                self.steady[phase] += seconds
                self.steady_micro += phase == "data"
        self.pending.clear()

    def record(self, samples_per_micro, **extra):
        """Collective (the loss is averaged over ranks): this window's metrics; then a new window starts."""
        self.resolve()
        w, micro = self.window, max(self.micro, 1)
        compute = w["forward_backward"] + w["optimizer"] + w["other"]
        elapsed = max(w["data"] + compute, 1e-9)
        record = {**extra, "loss": self.accelerator.reduce(self.loss / micro, "mean").item(),
                  "samples_per_s": self.micro * samples_per_micro / elapsed,
                  "data_ms": 1000 * w["data"] / micro, "compute_ms": 1000 * compute / micro,
                  "forward_backward_ms": 1000 * w["forward_backward"] / micro,
                  "optimizer_ms": 1000 * w["optimizer"] / micro, "other_ms": 1000 * w["other"] / micro,
                  "data_fraction": w["data"] / elapsed}
        self.reset()
        return record

    def window_state(self):
        """Collective: what a checkpoint keeps of the open window, so that a resumed run logs the same
        losses as an uninterrupted one (each rank's own loss sum, and the micro-batch count)."""
        self.resolve()
        sums = self.accelerator.gather(self.loss.view(1)).tolist()
        return {"loss_sums": sums, "micro": self.micro, "data_time": self.total_data,
                "compute_time": self.total_compute}

    def load_window_state(self, state):
        """A checkpoint's window, one loss sum per rank of this run (resharding.reshaped_window's rule)."""
        self.loss.fill_(state["loss_sums"][self.accelerator.process_index])
        self.micro = state["micro"]
        self.total_data, self.total_compute = state["data_time"], state["compute_time"]

    def timing(self, samples_per_micro, unit="samples"):
        """This process's steady state (after its first micro-batch), for the summary and bench/."""
        self.resolve()
        self.hook.remove()
        n = max(self.steady_micro, 1)
        total = sum(self.steady.values())
        return {"micro_batches": self.steady_micro, "first_step_at": self.first_step_at,
                **{f"{phase}_ms": 1000 * self.steady[phase] / n for phase in PHASES},
                f"{unit}_per_s": self.steady_micro * samples_per_micro / max(total, 1e-9),
                "data_fraction": self.steady["data"] / max(total, 1e-9),
                "optimizer_in_backward": Engine.of(self.accelerator).optimizer_in_backward}
