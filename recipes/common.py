"""What every recipe needs around its training loop, written once.

The recipes stay plain PyTorch; these helpers only report, check and tidy up:
  * fail / check_launch: one clear error from the main process, a non-zero exit everywhere;
  * engine: what accelerate really set up (DeepSpeed stage, offload, sharding);
  * stepping_optimizer: the optimizer that really steps (DeepSpeed offload swaps it);
  * deepspeed_clip_like / refuse_optimizer_offload: DeepSpeed does what the recipe's flags say, or nothing;
  * resumable_epochs: the epoch loop that a resumed run re-enters mid-epoch, exactly;
  * Window / MetricsLog: timed progress lines (data / forward+backward / optimizer) and metrics.jsonl;
  * --report-to / --profile: accelerate's TensorBoard tracker, curves.png, a torch.profiler trace;
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
    """Loss and the time split between waiting for data, forward+backward, the optimizer step and the
    recipe's own per-step bookkeeping ('other': stop agreement, logging, checkpoints), since the last
    progress line.

    total_data / total_compute keep the whole run's split (seeded from a checkpoint on resume).
    timing() is the steady state of this process for benchmarks: everything after its first
    micro-batch (which pays for lazy initialisation). On a GPU each mark synchronises the device,
    or asynchronous kernels would be counted in whichever phase happens to wait for them.
    Under DeepSpeed the optimizer step runs inside accelerator.backward(), so it is counted there.
    """

    def __init__(self, accelerator, total_data=0.0, total_compute=0.0):
        self.accelerator = accelerator
        self.total_data, self.total_compute = total_data, total_compute
        cuda = accelerator.device.type == "cuda"
        self.sync = (lambda: torch.cuda.synchronize(accelerator.device)) if cuda else (lambda: None)
        self.first_step_at = None  # wall-clock time of this process's first finished micro-batch
        self.steady = {"micro_batches": 0, "data": 0.0, "forward_backward": 0.0, "optimizer": 0.0, "other": 0.0}
        self.counted = False  # whether the last micro-batch belongs to the steady state
        self.reset()

    def reset(self):
        self.data = self.forward_backward = self.optimizer = self.other = 0.0
        self.micro = 0
        self.loss = torch.zeros((), dtype=torch.float64, device=self.accelerator.device)
        self.mark = time.perf_counter()
        self.phases = {}

    def _lap(self, phase):
        self.sync()
        now = time.perf_counter()
        self.phases[phase] = now - self.mark
        self.mark = now
        return self.phases[phase]

    def data_ready(self):
        """Call when the loader has handed over a batch: the time since the last mark was spent waiting."""
        waited = self._lap("data")
        self.data += waited
        self.total_data += waited

    def backward_done(self):
        """Call after accelerator.backward(): the time since data_ready was forward + backward."""
        self.forward_backward += self._lap("forward_backward")

    def step_done(self, loss):
        """Call after optimizer.zero_grad(): the time since backward_done was the optimizer step."""
        self.optimizer += self._lap("optimizer")
        self.total_compute += self.phases["forward_backward"] + self.phases["optimizer"]
        self.counted = self.first_step_at is not None
        if self.first_step_at is None:
            self.first_step_at = time.time()
        else:
            self.steady["micro_batches"] += 1
            for phase in ("data", "forward_backward", "optimizer"):
                self.steady[phase] += self.phases[phase]
        self.phases = {}
        self.micro += 1
        self.loss += loss.detach()

    def bookkeeping_done(self):
        """Call after the step's own bookkeeping (stop agreement, logging, checkpoint): its time is 'other',
        not data wait."""
        spent = self._lap("other")
        self.other += spent
        self.total_compute += spent
        if self.counted:
            self.steady["other"] += spent
        self.phases = {}

    def record(self, samples_per_micro, **extra):
        """Collective (the loss is averaged over ranks): this window's metrics; then a new window starts."""
        compute = self.forward_backward + self.optimizer + self.other
        elapsed, micro = max(self.data + compute, 1e-9), max(self.micro, 1)
        record = {**extra, "loss": self.accelerator.reduce(self.loss / micro, "mean").item(),
                  "samples_per_s": self.micro * samples_per_micro / elapsed,
                  "data_ms": 1000 * self.data / micro, "compute_ms": 1000 * compute / micro,
                  "forward_backward_ms": 1000 * self.forward_backward / micro,
                  "optimizer_ms": 1000 * self.optimizer / micro, "other_ms": 1000 * self.other / micro,
                  "data_fraction": self.data / elapsed}
        self.reset()
        return record

    def timing(self, samples_per_micro, unit="samples"):
        """This process's steady state (after its first micro-batch), for the summary and bench/."""
        n = max(self.steady["micro_batches"], 1)
        phases = ("data", "forward_backward", "optimizer", "other")
        total = sum(self.steady[phase] for phase in phases)
        return {"micro_batches": self.steady["micro_batches"], "first_step_at": self.first_step_at,
                **{f"{phase}_ms": 1000 * self.steady[phase] / n for phase in phases},
                f"{unit}_per_s": self.steady["micro_batches"] * samples_per_micro / max(total, 1e-9),
                "data_fraction": self.steady["data"] / max(total, 1e-9),
                "optimizer_in_backward": self.accelerator.distributed_type == DistributedType.DEEPSPEED}


def add_observability_args(parser):
    parser.add_argument("--report-to", choices=["none", "png", "tensorboard"], default="none",
                        help="tensorboard: log the metrics with accelerate's TensorBoard tracker into "
                             "OUTPUT_DIR/tensorboard and draw OUTPUT_DIR/curves.png; png: only curves.png")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="record a torch.profiler trace of STEPS optimizer steps (after 2 warm-up steps) into "
                             "OUTPUT_DIR/profile, one file per rank, for Perfetto or TensorBoard")


def tracking(args):
    """Accelerator(**tracking(args)): accelerate's own tracker for --report-to tensorboard."""
    return {"log_with": "tensorboard" if args.report_to == "tensorboard" else None, "project_dir": args.output_dir}


def start_tracking(accelerator, args):
    """Collective-free; the tracker lives on the main process. Hyper-parameters are the scalar flags."""
    if args.report_to == "tensorboard":
        accelerator.init_trackers("tensorboard", config={k: v for k, v in vars(args).items()
                                                         if isinstance(v, (int, float, str, bool))})


class StepProfiler:
    """--profile STEPS: torch.profiler over STEPS optimizer steps, after one skipped and one warm-up step.

    Every rank writes its own trace (OUTPUT_DIR/profile/rank<R>.*.pt.trace.json): open it in
    https://ui.perfetto.dev or chrome://tracing, or in TensorBoard with the torch-tb-profiler plugin.
    """

    def __init__(self, accelerator, steps, output_dir):
        self.profiler, self.directory = None, os.path.join(output_dir, "profile")
        if steps > 0:
            from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if accelerator.device.type == "cuda" else [])
            self.profiler = profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=steps, repeat=1),
                                    on_trace_ready=tensorboard_trace_handler(
                                        self.directory, worker_name=f"rank{accelerator.process_index}"))
            self.profiler.start()

    def step(self):
        """Call once per optimizer step."""
        if self.profiler:
            self.profiler.step()

    def stop(self):
        if self.profiler:
            self.profiler.stop()  # a trace still recording is written now
            self.profiler = None


class MetricsLog:
    """A JSON-lines log on the main process (metrics.jsonl, eval.jsonl), mirrored to the tracker of
    --report-to; after a resume it keeps exactly the steps the checkpoint holds."""

    def __init__(self, accelerator, output_dir, resumed_step, name="metrics.jsonl"):
        os.makedirs(output_dir, exist_ok=True)
        self.accelerator, self.file = accelerator, None
        if accelerator.is_main_process:
            path = os.path.join(output_dir, name)
            kept = ([line for line in open(path) if json.loads(line)["step"] <= resumed_step]
                    if resumed_step and os.path.exists(path) else [])
            self.file = open(path, "w")
            self.file.writelines(kept)

    def write(self, record):
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            if self.accelerator.trackers:
                self.accelerator.log({k: v for k, v in record.items()
                                      if isinstance(v, (int, float)) and k not in ("step", "epoch")}, step=record["step"])

    def close(self):
        if self.file:
            self.file.close()
            self.file = None


def plot_curves(output_dir, title):
    """Main process: OUTPUT_DIR/curves.png, the loss and accuracy curves drawn from the JSON logs,
    for those who do not run TensorBoard."""
    import matplotlib
    matplotlib.use("Agg")  # no display on a compute node
    import matplotlib.pyplot as plt

    def read(name):
        path = os.path.join(output_dir, name)
        return [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    train, evals = read("metrics.jsonl"), read("eval.jsonl")
    loss_key = next((k for k in ("loss", "batch_loss") if train and k in train[0]), None)
    accuracy_keys = [k for k in ("test_accuracy", "val_accuracy") if any(k in e for e in evals)]
    eval_loss_keys = [k for k in ("test_loss", "val_loss") if any(k in e for e in evals + train)]
    fig, axes = plt.subplots(1, 2 if accuracy_keys else 1, figsize=(11 if accuracy_keys else 6, 4), squeeze=False)
    ax = axes[0][0]
    if loss_key:
        ax.plot([r["step"] for r in train], [r[loss_key] for r in train], label=f"train {loss_key}")
    for key in eval_loss_keys:
        points = [(r["step"], r[key]) for r in evals + train if key in r]
        ax.plot(*zip(*sorted(points)), "o-", label=key.replace("_", " "))
    ax.set(xlabel="optimizer step", ylabel="loss", title=title)
    ax.legend()
    for key in accuracy_keys:
        points = [(r["step"], 100 * r[key]) for r in evals if key in r]
        axes[0][1].plot(*zip(*points), "o-", label=key.replace("_", " "))
        axes[0][1].set(xlabel="optimizer step", ylabel="accuracy (%)", title=title)
        axes[0][1].legend()
    fig.tight_layout()
    path = os.path.join(output_dir, "curves.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


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
            "peak_memory_mb_per_rank": per_rank[:, 0].tolist(),
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
