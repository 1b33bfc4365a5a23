"""What a run reports: progress logs, trackers, traces, curves, memory and the summary.

Owns metrics.jsonl and eval.jsonl (MetricsLog), the libraries' progress bars kept out of log files,
--report-to (accelerate's TensorBoard tracker and curves.png), --profile (a torch.profiler trace per rank),
the peak memory and the parameters each rank holds (footprint), and summary.json with its SUMMARY line
(run_summary: its fields, in order; write_summary: the file complete, the line the figures a person reads), the
progress and evaluation lines (progress_line, evaluation_line). The fields are defined in docs/measuring.md.
"""

import io
import json
import os
import resource
import sys

import torch

from . import float8
from .results import open_log, write_file


def quiet_progress_bars():
    """Progress bars only on a terminal, as the run's own: in a log file (stderr redirected, a Slurm job) the bars
    of datasets (a split, map), transformers (loading and writing weights) and the Hub leave runs of carriage
    returns. Environment variables for the libraries not imported yet, their switches for those that are."""
    if sys.stderr.isatty():
        return
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for module, switch in (("datasets", "disable_progress_bars"), ("huggingface_hub.utils", "disable_progress_bars"),
                           ("transformers.utils.logging", "disable_progress_bar")):
        if module in sys.modules:
            getattr(sys.modules[module], switch)()


def point_trackers(accelerator, output_dir, report_to):
    """The trackers' directory: the run's output directory (a resume that continues elsewhere moves it)."""
    config = accelerator.project_configuration
    config.set_directories(output_dir)
    config.logging_dir = output_dir  # set_directories keeps a logging_dir set before: a resume moves it
    if report_to == "tensorboard":
        from accelerate.tracking import filter_trackers
        # What Accelerator(log_with=...) would do, once the output directory is known: it depends on the engine,
        # and accelerate refuses a tracker without a logging directory at construction.
        accelerator.log_with = filter_trackers("tensorboard", output_dir)


def first_line(accelerator, engine, batch, optimizer, describe, total_steps, how_to_stop):
    """A run's first line: what runs, on what, how far, and the command that stops it. batch: (the global batch,
    the accumulation steps); engine: engines.engine_facts."""
    from .engines import precision_source
    from .optimizers import implementation, optimizer_name
    (batch_size, grad_accum), world = batch, accelerator.num_processes
    sp = engine["sequence_parallel"]  # processes that share each sequence: they read the same batch
    per = f"group of {sp}, each sequence split over the group (sequence parallel)" if sp > 1 else "process"
    split = f"{grad_accum} x {batch_size // grad_accum // (world // sp)} per {per}"
    steps = f"{total_steps} step{'s' if total_steps != 1 else ''}"
    processes = f"{world} process{'es' if world != 1 else ''} on {accelerator.device.type}"
    return (f"{engine['distributed_type']} | {processes} | mixed precision {engine['mixed_precision']}"
            f"{precision_source(engine)}{float8.describe(engine)} | ZeRO stage {engine['deepspeed_stage'] or '-'} | "
            f"optimizer {optimizer_name(optimizer)} ({implementation(optimizer)}) | global batch {batch_size} "
            f"({split}) | {describe + ' | ' if describe else ''}{steps} | {how_to_stop}")


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


def _step(line):
    """The step of a metrics line; a line cut short by a killed run counts as past any checkpoint."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


class MetricsLog:
    """A JSON-lines log on the main process (metrics.jsonl, eval.jsonl), mirrored to the tracker of
    --report-to; after a resume it keeps exactly the steps the checkpoint holds."""

    def __init__(self, accelerator, output_dir, resumed_step, name="metrics.jsonl"):
        os.makedirs(output_dir, exist_ok=True)
        self.accelerator, self.file = accelerator, None
        if accelerator.is_main_process:
            path = os.path.join(output_dir, name)
            kept = ([line for line in open(path) if _step(line) <= resumed_step]
                    if resumed_step and os.path.isfile(path) and not os.path.islink(path) else [])
            self.file = open_log(path, kept)  # a new file over the name: a link planted there is not followed

    def write(self, record):
        # torchao's optimizers (--optim-states) keep the learning rate as a 0-d tensor: written as its number
        record = {k: v.item() if isinstance(v, torch.Tensor) and v.dim() == 0 else v for k, v in record.items()}
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            if self.accelerator.trackers:
                scalars = {k: v for k, v in record.items()
                           if isinstance(v, (int, float)) and k not in ("step", "epoch")}
                self.accelerator.log(scalars, step=record["step"])

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
    losses = [(r["step"], r["loss"]) for r in train if "loss" in r]  # progress lines (every step has m, n too)
    accuracy_keys = [k for k in ("test_accuracy", "val_accuracy") if any(k in e for e in evals)]
    eval_loss_keys = [k for k in ("test_loss", "val_loss") if any(k in e for e in evals + train)]
    fig, axes = plt.subplots(1, 2 if accuracy_keys else 1, figsize=(11 if accuracy_keys else 6, 4), squeeze=False)
    ax = axes[0][0]
    if losses:
        ax.plot(*zip(*losses), label="train loss")
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
    path, image = os.path.join(output_dir, "curves.png"), io.BytesIO()
    fig.savefig(image, format="png", dpi=100)
    plt.close(fig)
    write_file(path, image.getvalue())
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
        # Finite values only: QLoRA's packed 4-bit weights, stored in a float type, hold bit patterns that read as
        # NaN or infinity, which would make every checksum NaN (and two equal ranks unequal).
        checksum += held.detach().double().nan_to_num(0.0, 0.0, 0.0).sum().item()
    return elements, checksum


def compiled_graphs():
    """How many graphs torch.compile compiled in this process (dynamo's counter): 0 for an eager run, 1 where only
    the training step was compiled."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def footprint(accelerator, model):
    """Collective: peak memory and the parameters every rank holds, for the summary."""
    world, cuda = accelerator.num_processes, accelerator.device.type == "cuda"
    # What the caching allocator held at its peak (fragmentation included): what must fit on the GPU.
    reserved = torch.cuda.max_memory_reserved(accelerator.device) / 2**20 if cuda else -1
    per_rank = accelerator.gather(torch.tensor([peak_memory_mb(accelerator), *held_parameters(model), reserved],
                                               dtype=torch.float64, device=accelerator.device)).view(world, 4)
    return {"peak_memory_mb": per_rank[:, 0].max().item(),
            "peak_memory_mb_per_rank": per_rank[:, 0].tolist(),
            "peak_memory_kind": "cuda_allocated" if cuda else "cpu_max_rss",
            "peak_memory_reserved_mb_per_rank": per_rank[:, 3].tolist() if cuda else None,
            "param_elements_per_rank": [int(n) for n in per_rank[:, 1].tolist()],
            "param_checksum_per_rank": per_rank[:, 2].tolist(),  # equal on every rank unless sharded
            "fsdp_units": fsdp_units(model)}


def peaks_at_start(accelerator):
    """Collective: each rank's peak host memory so far (max RSS) and peak GPU memory allocated, in GB (None
    without a GPU). Called right after the model is built or loaded, prepared and resumed, it is what loading
    the model cost: a full copy per process, or a shard."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    gpu = torch.cuda.max_memory_allocated(accelerator.device) / 2**30 if accelerator.device.type == "cuda" else -1
    per_rank = accelerator.gather(torch.tensor([[kb / 2**20, gpu]], dtype=torch.float64, device=accelerator.device))
    host, device = ([round(v, 3) for v in column] for column in per_rank.T.tolist())
    return {"host_peak_gb_at_start_per_rank": host, "device_peak_gb_at_start_per_rank": device if gpu >= 0 else None}


def fsdp_units(model):
    """How many FSDP2 units (fully_shard calls) the model was split into: each is gathered, used and freed
    on its own. None when the model is not under FSDP2."""
    from torch.distributed.fsdp import FSDPModule
    units = sum(isinstance(module, FSDPModule) for module in model.modules())
    return units or None


# The SUMMARY line's fields, when present and not null: who ran, how far, the losses, then the recipe's figures
# (write_summary's `shown`), memory and time. summary.json holds every field.
SUMMARY_LINE = ("recipe", "distributed_type", "world_size", "mixed_precision", "deepspeed_stage", "steps",
                "resumed_from_step", "first_loss", "final_loss")
SUMMARY_LINE_END = ("peak_memory_mb", "wall_time_s")


def rounded(value, digits=4):
    """Floats (inside lists and dicts too) to `digits` significant digits, for a line a person reads."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    return value


def summary_line(summary, shown=None):
    """The SUMMARY line: JSON a script can parse, short enough to read. With `shown` (a training run's own figures):
    the SUMMARY_LINE fields, those, then SUMMARY_LINE_END, floats to 4 digits. Without it (pi.py, data_sharding.py,
    whose few fields are the result, pi to every digit): every field but args, as is."""
    if shown is None:
        return "SUMMARY " + json.dumps({k: v for k, v in summary.items() if k != "args"})
    keys = dict.fromkeys([*SUMMARY_LINE, *shown, *SUMMARY_LINE_END])
    return "SUMMARY " + json.dumps({k: rounded(summary[k]) for k in keys if summary.get(k) is not None})


def write_summary(output_dir, summary, shown=None):
    """Main process: summary.json, complete, and the SUMMARY line (summary_line) that scripts can grep."""
    write_file(os.path.join(output_dir, "summary.json"), json.dumps(summary, indent=2))
    print(summary_line(summary, shown), flush=True)


def as_figure(key, value):
    """One figure of a progress or evaluation line: an accuracy as a percentage, a float to 4 decimals."""
    name = key.replace("_", " ")
    if isinstance(value, float):
        return f"{name} {100 * value:.2f}%" if key.endswith("accuracy") else f"{name} {value:.4f}"
    return f"{name} {value}"


def progress_line(record, fields, total_steps, unit):
    """A progress line: the step, the loss and the recipe's own fields, the throughput (and MFU), and where a
    micro-batch's time went (timing.py's split)."""
    rate = record[f"{unit}_per_s" if unit == "tokens" else "samples_per_s"]
    own = "".join(f" | {as_figure(k, v)}" for k, v in fields.items())
    mfu = f" | MFU {100 * record['mfu']:.1f}%" if "mfu" in record else ""
    return (f"epoch {record['epoch']} step {record['step']}/{total_steps} | loss {record['loss']:.4f}{own} | "
            f"{rate:.0f} {unit}/s{mfu} | per micro-batch: data {record['data_ms']:.1f} ms, forward+backward "
            f"{record['forward_backward_ms']:.1f} ms, optimizer {record['optimizer_ms']:.1f} ms, other "
            f"{record['other_ms']:.1f} ms ({100 * record['data_fraction']:.0f}% waiting for data)")


def evaluation_line(when, result):
    """An evaluation's line: when it ran, and each of its figures."""
    return f"{when} | " + " | ".join(as_figure(k, v) for k, v in result.items())


def run_summary(facts, state, rates, timer, weights, measured, recipe_fields):
    """(summary.json's fields in their order, the fields the SUMMARY line shows) of a finished run: facts (the run's:
    who ran, on what, from which checkpoint), its training state, rates ({unit}_per_s, and mfu where the recipe
    counts FLOPs), timer (timing.StepTimer), the exported weights, measured (memory, the steady-state timing, the
    checkpoints' and the end's times), recipe_fields (what the recipe adds: linear_regression's m and n...)."""
    evaluation = {k: v for k, v in (state["last_eval"] or {}).items() if k != "step"}
    summary = {
        "recipe": facts["recipe"], "output_dir": facts["output_dir"], **facts["engine"],
        "optimizer": facts["optimizer"], "optimizer_implementation": facts["optimizer_implementation"],
        "steps": state["step"], "epochs": state["epochs_run"], "resumed_from_step": facts["resumed_from_step"],
        "resumed_from_world_size": facts["resumed_from_world_size"], "resume_changes": facts["resume_changes"],
        "first_loss": state["first_loss"], "final_loss": state["final_loss"], **evaluation, **rates,
        "data_time_s": timer.total_data, "compute_time_s": timer.total_compute,
        "data_fraction": timer.total_data / max(timer.total_data + timer.total_compute, 1e-9),
        "exported_dtype": "float32",
        "param_elements": sum(v.numel() for k, v in weights.items() if v.is_floating_point() and "running" not in k),
        "model_init": facts["model_init"], **facts["peaks_at_start"],
        **{k: v for k, v in measured.items() if k != "end_of_run"}, **recipe_fields,
        "checkpoints": measured["checkpoints"], "end_of_run": measured["end_of_run"],
        "compiled_graphs": compiled_graphs(), "wall_time_s": facts["wall_time_s"], "args": facts["args"]}
    # The line shows the recipe's own figures among its fields (linear_regression's m and n), not its texts.
    numbers = [k for k, v in recipe_fields.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return summary, [*evaluation, *rates, *numbers]
