"""What every recipe needs around its training loop, written once.

The recipes stay plain PyTorch; these helpers only report, check and tidy up:
  * fail / check_launch: one clear error from the main process, a non-zero exit everywhere;
  * engine: what accelerate really set up (DeepSpeed stage, offload, sharding);
  * stepping_optimizer: the optimizer that really steps (DeepSpeed offload swaps it);
  * deepspeed_clip_like / refuse_optimizer_offload: DeepSpeed does what the recipe's flags say, or nothing;
  * resumable_epochs: the epoch loop that a resumed run re-enters mid-epoch, exactly;
  * Window / MetricsLog: timed progress lines and metrics.jsonl (main process only);
  * footprint / write_summary / finish: the end of a run.
"""

import itertools
import json
import os
import resource
import sys
import time

import torch
from accelerate.utils import DistributedType

CPU_HINT = ("To run several processes on a CPU-only machine, set ACCELERATE_USE_CPU=1 for DDP configs; "
            "DeepSpeed and FSDP configs need the test shim, see README 'GPU configs on a CPU'.")


def fail(accelerator, message, code=2):
    """One clear message from the main process, a non-zero exit from every process."""
    if accelerator.is_main_process:
        print(f"error: {message}", file=sys.stderr, flush=True)
    accelerator.end_training()  # tear down the process group before exiting (see finish)
    sys.exit(code)


def printer(accelerator):
    """print() on the main process only: accelerator.print prints once per node."""
    def log(*message, **kwargs):
        if accelerator.is_main_process:
            print(*message, **kwargs, flush=True)
    return log


def check_launch(accelerator):
    """Refuse to train as silent independent copies or without the engine the config asked for."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != launched or (launched > 1 and accelerator.distributed_type == DistributedType.NO):
        fail(accelerator, f"the launcher started {launched} processes, but accelerate set up "
                          f"{accelerator.num_processes} ({accelerator.distributed_type}): each would train "
                          f"alone. {CPU_HINT}")
    for env, wanted in (("ACCELERATE_USE_DEEPSPEED", DistributedType.DEEPSPEED),
                        ("ACCELERATE_USE_FSDP", DistributedType.FSDP)):
        if os.environ.get(env, "false").lower() == "true" and accelerator.distributed_type != wanted:
            fail(accelerator, f"the config asks for {wanted.value} but accelerate is running "
                              f"{accelerator.distributed_type.value}. {CPU_HINT}")


def check_batch(accelerator, batch_size, grad_accum=1, eval_batch_size=None):
    world = accelerator.num_processes
    if batch_size % (world * grad_accum) or (eval_batch_size or 0) % world:
        good = world * grad_accum
        fail(accelerator, f"--batch-size {batch_size} is the global batch of one optimizer step and must divide "
                          f"by processes x --grad-accum = {good} (try {max(good, batch_size // good * good)})"
                          + (f"; --eval-batch-size {eval_batch_size} must divide by {world}" if eval_batch_size else ""))


def deepspeed_config(accelerator):
    plugin = accelerator.state.deepspeed_plugin
    return plugin.deepspeed_config if plugin else {}


def engine(accelerator):
    """What accelerate really set up, for the progress line, the summary and checkpoint layouts."""
    zero = deepspeed_config(accelerator).get("zero_optimization", {})
    return {"distributed_type": accelerator.distributed_type.value, "world_size": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision, "deepspeed_stage": zero.get("stage"),
            "offload_optimizer": zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)}


def deepspeed_clip_like(accelerator, max_grad_norm):
    """Call before prepare(). DeepSpeed clips gradients itself, and accelerate turns the config's 'auto' into
    a clipping norm of 1.0, while DDP and FSDP never clip on their own: make DeepSpeed clip like the recipe's
    flag (0: not at all), so every config runs the same optimisation."""
    ds = deepspeed_config(accelerator)
    if ds and ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = float(max_grad_norm)


def refuse_optimizer_offload(accelerator, why, instead):
    """For recipes built on SGD: under DeepSpeed optimizer offload, prepare() silently replaces whatever
    torch optimizer the recipe made by DeepSpeed's CPU Adam. Stop before that, with one line."""
    if engine(accelerator)["offload_optimizer"]:
        fail(accelerator, f"{why}: DeepSpeed optimizer offload silently replaces SGD by its CPU Adam; "
                          f"use {instead} instead.")


def check_deepspeed_flags(accelerator, grad_accum, max_grad_norm):
    """The flags decide accumulation and clipping; a DeepSpeed config that says otherwise is an error."""
    ds = deepspeed_config(accelerator)
    if ds and (accelerator.gradient_accumulation_steps != grad_accum
               or float(ds.get("gradient_clipping", 0.0)) != max_grad_norm):
        fail(accelerator, f"the DeepSpeed config sets gradient_accumulation_steps={ds.get('gradient_accumulation_steps')} "
                          f"and gradient_clipping={ds.get('gradient_clipping')}, the flags say {grad_accum} and "
                          f"{max_grad_norm}: remove those keys from the YAML so the flags decide.")


def stepping_optimizer(prepared, created, scheduler=None):
    """Name of the optimizer that really steps; points the scheduler at it.

    Under optimizer offload prepare() replaces the optimizer we created by DeepSpeedCPUAdam,
    and a scheduler would go on setting the learning rate of one that never steps.
    """
    inner = prepared
    while hasattr(inner, "optimizer"):  # accelerate's and DeepSpeed's wrappers
        inner = inner.optimizer
    if inner is not created and scheduler is not None:
        scheduler.scheduler.optimizer = prepared
    return type(inner).__name__


def cast_buffers_for_half_precision(accelerator, model):
    """DeepSpeed and FSDP compute with bf16 weights but leave buffers in fp32, and BatchNorm
    refuses running statistics of another dtype than its weights."""
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)
    if half and accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        for buffer in model.buffers():
            if buffer.is_floating_point():
                buffer.data = buffer.data.to(half)


def resumable_epochs(accelerator, loader, progress, epochs, steps_per_epoch, grad_accum=1):
    """Yield (epoch, steps already done in it, micro-batch iterator), resuming mid-epoch exactly.

    set_epoch makes the shuffle depend on (seed, epoch) only, so a resumed run sees the same
    order, and skip_first_batches fast-forwards through what the checkpoint already holds.
    islice stops at a whole number of optimizer steps: --grad-accum never makes a short step.
    """
    for epoch in range(progress["epoch"], epochs):
        loader.set_epoch(epoch)
        done = progress["step_in_epoch"] if epoch == progress["epoch"] else 0
        batches = accelerator.skip_first_batches(loader, done * grad_accum) if done else loader
        yield epoch, done, itertools.islice(batches, (steps_per_epoch - done) * grad_accum)


class Window:
    """Loss and the time split between waiting for data and computing, since the last progress line.

    total_data / total_compute keep the whole run's split (seeded from a checkpoint on resume).
    """

    def __init__(self, accelerator, total_data=0.0, total_compute=0.0):
        self.accelerator = accelerator
        self.total_data, self.total_compute = total_data, total_compute
        self.reset()

    def reset(self):
        self.data = self.compute = 0.0
        self.micro = 0
        self.loss = torch.zeros((), dtype=torch.float64, device=self.accelerator.device)
        self.mark = time.perf_counter()

    def data_ready(self):
        """Call when the loader has handed over a batch: the time since the last mark was spent waiting."""
        now = time.perf_counter()
        self.data += now - self.mark
        self.total_data += now - self.mark
        self.mark = now

    def step_done(self, loss):
        now = time.perf_counter()
        self.compute += now - self.mark
        self.total_compute += now - self.mark
        self.mark = now
        self.micro += 1
        self.loss += loss.detach()

    def record(self, samples_per_micro, **extra):
        """Collective (the loss is averaged over ranks): this window's metrics; then a new window starts."""
        elapsed, micro = max(self.data + self.compute, 1e-9), max(self.micro, 1)
        record = {**extra, "loss": self.accelerator.reduce(self.loss / micro, "mean").item(),
                  "samples_per_s": self.micro * samples_per_micro / elapsed,
                  "data_ms": 1000 * self.data / micro, "compute_ms": 1000 * self.compute / micro,
                  "data_fraction": self.data / elapsed}
        self.reset()
        return record


class MetricsLog:
    """metrics.jsonl on the main process; after a resume it keeps exactly the steps the checkpoint holds."""

    def __init__(self, accelerator, output_dir, resumed_step):
        os.makedirs(output_dir, exist_ok=True)
        self.file = None
        if accelerator.is_main_process:
            path = os.path.join(output_dir, "metrics.jsonl")
            kept = ([line for line in open(path) if json.loads(line)["step"] <= resumed_step]
                    if resumed_step and os.path.exists(path) else [])
            self.file = open(path, "w")
            self.file.writelines(kept)

    def write(self, record):
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self):
        if self.file:
            self.file.close()


def peak_memory_mb(accelerator):
    if accelerator.device.type == "cuda":
        return torch.cuda.max_memory_allocated(accelerator.device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def held_parameters(model):
    """(elements, checksum) of the parameters this rank really holds: a shard under ZeRO-3 and FSDP."""
    elements, checksum = 0, 0.0
    for p in model.parameters():
        held = getattr(p, "ds_tensor", None)  # ZeRO-3 keeps this rank's partition here
        if held is None and hasattr(p, "to_local"):  # FSDP2 parameters are DTensors
            held = p.to_local()
        held = p if held is None else held
        elements += held.numel()
        checksum += held.detach().double().sum().item()
    return elements, checksum


def footprint(accelerator, model):
    """Collective: peak memory and the parameters every rank holds, for the summary."""
    world = accelerator.num_processes
    per_rank = accelerator.gather(torch.tensor([peak_memory_mb(accelerator), *held_parameters(model)],
                                               dtype=torch.float64, device=accelerator.device)).view(world, 3)
    return {"peak_memory_mb": per_rank[:, 0].max().item(),
            "peak_memory_kind": "cuda_allocated" if accelerator.device.type == "cuda" else "cpu_max_rss",
            "param_elements_per_rank": [int(n) for n in per_rank[:, 1].tolist()],
            "param_checksum_per_rank": per_rank[:, 2].tolist()}  # equal on every rank unless sharded


def write_summary(output_dir, summary):
    """Main process: summary.json, and the same as one SUMMARY line that scripts can grep."""
    with open(os.path.join(output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print("SUMMARY " + json.dumps({k: v for k, v in summary.items() if k != "args"}), flush=True)


def finish(accelerator):
    """Destroy the process group while the interpreter is alive. Call after dropping the recipe's own
    references to model, optimizer and loaders (del): left to interpreter shutdown, gloo's C++ side is
    torn down after Python and can abort a run that succeeded ("terminate called without an active exception")."""
    accelerator.free_memory()
    accelerator.end_training()
