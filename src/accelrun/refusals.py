"""Launches that would train wrongly, refused before they start, each with one clear message.

Owns the checks that end a run at start-up:
  * before Accelerator(), from the launch's environment alone: more processes on a node than it has GPUs (CUDA
    set-up would fail a minute later), a DeepSpeed or FSDP config on a machine without a GPU that is not on the
    CPU route (DeepSpeed would first compile a CPU op for minutes, then every process would train alone), and a
    config with sequence parallelism for a recipe that has no use for it (before DeepSpeed compiles anything);
  * processes that would each train alone, or without the engine the config asked for;
  * a global batch that does not split evenly over processes (under sequence parallelism: groups of them) and
    accumulation steps;
  * a DeepSpeed config that contradicts the flags, and optimizer offload under an SGD recipe.
"""

import os
import sys

import torch

from . import float8
from .checkpoint.rules import processes_hint
from .engines import Engine
from .exits import fail, report, teardown

ON_A_CPU = "docs/configs.md, 'On a CPU'"
CPU_HINT = ("To run several processes on a CPU-only machine, set ACCELERATE_USE_CPU=1 for DDP configs; "
            f"DeepSpeed and FSDP configs need PYTHONPATH=cpu_route ({ON_A_CPU}).")


def check_gpus_before_start(sequence_parallel=False):
    """Before Accelerator(), before any library is imported for the engine: a config with sequence parallelism for a
    recipe without it (sequence_parallel False: sequence_parallel_refusal); more processes on this node than it has
    GPUs would die in CUDA set-up with 'invalid device ordinal' a minute later; a DeepSpeed or FSDP config without a
    GPU needs the CPU route (engine_without_gpu); float8 on a GPU without it (float8.launch_problem). Every rank
    refuses at once, the first one saying why."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    first = os.environ.get("LOCAL_RANK", "0") == "0"
    if not sequence_parallel and (size := Engine.launched_sequence_parallel()) > 1:
        report(sequence_parallel_refusal(size), first)
        sys.exit(2)
    if problem := float8.launch_problem():
        report(problem, first)
        sys.exit(2)
    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    if not torch.cuda.is_available() and (problem := engine_without_gpu(use_cpu)):
        report(problem, first)
        sys.exit(2)
    if use_cpu or not torch.cuda.is_available():
        return  # a CPU run, or the CPU route: no GPU to count
    gpus = torch.cuda.device_count()
    if local > gpus:
        world = os.environ.get("WORLD_SIZE", str(local))
        report(f"this node has {gpus} GPU(s) and the launch starts {local} processes on it (num_processes "
               f"{world}): pass --num_processes {gpus} to accelerate launch, or use accelerate_configs/1gpu.yaml, "
               f"or set ACCELERATE_USE_CPU=1 for a run on the CPU.", first)
        sys.exit(2)


def sequence_parallel_refusal(size):
    """The one line for a recipe that has no use for sequence parallelism under a config that asks for it."""
    return (f"this recipe does not run under sequence parallelism (parallelism_config_sp_size {size} in the config): "
            f"it is finetune_lm.py's, for Hugging Face models. Use the config without it (deepspeed_zero3.yaml)")


def engine_without_gpu(use_cpu):
    """On a machine without a GPU: None, or why the DeepSpeed or FSDP engine the launch asks for (accelerate launch
    sets ACCELERATE_USE_DEEPSPEED or ACCELERATE_USE_FSDP from the config) would not run. ACCELERATE_USE_CPU=1 turns
    either off; without the CPU route accelerate sets up no process group, and DeepSpeed, imported by Accelerator(),
    would first compile its shared-memory op for minutes. Decided from the environment, before that import."""
    wanted = [kind.accelerate_type.value for kind in Engine.kinds if kind.asked_by(os.environ)]
    if not wanted:
        return None
    if use_cpu:
        return (f"the config asks for {wanted[0]}, and ACCELERATE_USE_CPU=1 turns it off (accelerate would run "
                f"MULTI_CPU): on a CPU, launch DeepSpeed and FSDP configs with PYTHONPATH=cpu_route instead of "
                f"ACCELERATE_USE_CPU=1 ({ON_A_CPU}).")
    if not on_cpu_route():
        return (f"the config asks for {wanted[0]} and this machine has no GPU: launch it as PYTHONPATH=cpu_route "
                f"accelerate launch ... ({ON_A_CPU}); without the CPU route every process would train alone, after "
                f"minutes of DeepSpeed compiling a CPU op.")
    return None


def on_cpu_route():
    """Whether cpu_route/sitecustomize.py set this worker up: it marks the backend choice it replaces."""
    from accelerate.state import PartialState
    return getattr(PartialState._prepare_backend, "cpu_route", False)


def check_launch(accelerator):
    """Refuse to train as silent independent copies, or without the engine the config asked for. Said once, by the
    launch's rank 0 (RANK): processes that each set up alone are each accelerate's main process."""
    launched, engine = int(os.environ.get("WORLD_SIZE", "1")), Engine.of(accelerator)
    if accelerator.num_processes != launched or (launched > 1 and not engine.in_process_group):
        _refuse_launch(accelerator, f"the launcher started {launched} processes, but accelerate set up "
                                    f"{accelerator.num_processes} ({engine.running}): each would train "
                                    f"alone. {CPU_HINT}")
    wanted = engine.asked_otherwise(os.environ)
    if wanted:
        _refuse_launch(accelerator, f"the config asks for {wanted.accelerate_type.value} but accelerate is running "
                                    f"{engine.running.value}. {CPU_HINT}")


def _refuse_launch(accelerator, message):
    """fail() for a launch accelerate did not set up as launched: the line from the launch's rank 0 only (each
    process alone was its own main process, and the line came once per rank), exit 2 from every one."""
    report(message, os.environ.get("RANK", "0") == "0")
    sys.exit(teardown(accelerator, 2))


def check_sequence_parallel(accelerator, supported):
    """A config with sequence parallelism (parallelism_config_sp_size > 1) for a recipe that has no use for it:
    DeepSpeed's Ulysses works on Hugging Face models only, and accelerate would stop in prepare() with a traceback.
    A launched run was refused before Accelerator() (check_gpus_before_start); this holds for one built otherwise."""
    size = Engine.of(accelerator).sequence_parallel
    if size > 1 and not supported:
        fail(accelerator, sequence_parallel_refusal(size), everyone=True)


def check_batch(accelerator, batch_size, grad_accum=1, eval_batch_size=None, args=None):
    """The global batch of one optimizer step must split evenly over the processes that read different data (all
    of them, or under sequence parallelism each group of them) x accumulation steps. args: the run's flags, which
    say whether it resumes a checkpoint (resumed_from)."""
    readers = Engine.of(accelerator).readers  # the processes that read different data (processes / sp size)
    problem = batch_problem(readers, batch_size, grad_accum, eval_batch_size, resumed_from(args))
    if problem:
        fail(accelerator, problem, everyone=True)


def resumed_from(args):
    """None for a new run; else what the run resumes, for batch_problem's hint: --resume PATH, or the
    --checkpoint-dir that holds checkpoints (step-* entries; which one, and whether it is usable, is settled later)."""
    if args is None or args.resume == "none":
        return None
    if args.resume != "auto":
        return args.resume
    if args.checkpoint_dir:
        from .checkpoint.layout import steps
        return args.checkpoint_dir if steps(args.checkpoint_dir) else None
    return None


def batch_problem(world, batch_size, grad_accum=1, eval_batch_size=None, resuming=None):
    """None, or why the batches do not split over `world` processes, with the way out: another --batch-size for a new
    run; for a resume (`resuming`: the checkpoint or the --checkpoint-dir holding some), which keeps its checkpoint's
    --batch-size, only a number of processes that divides it (another --batch-size would be refused next)."""
    good = world * grad_accum
    problems = []
    if batch_size % good and resuming:
        problems.append(f"--batch-size {batch_size} is the global batch of one optimizer step and must divide by "
                        f"processes x --grad-accum = {good}: this run resumes {resuming}, which keeps its "
                        f"--batch-size, so {processes_hint(batch_size, grad_accum, world)}")
    elif batch_size % good:
        problems.append(f"--batch-size {batch_size} is the global batch of one optimizer step and must divide by "
                        f"processes x --grad-accum = {good}: give --batch-size {max(good, batch_size // good * good)} "
                        f"for a new run; a resume keeps its checkpoint's --batch-size, so "
                        f"{processes_hint(batch_size, grad_accum, world)}")
    if (eval_batch_size or 0) % world:
        problems.append(f"--eval-batch-size {eval_batch_size} must divide by the {world} processes")
    return "; ".join(problems) or None


def refuse_optimizer_offload(accelerator, why, instead):
    """For recipes built on SGD: under DeepSpeed optimizer offload, prepare() silently replaces whatever
    torch optimizer the recipe made by DeepSpeed's CPU Adam. Stop before that, with one line."""
    if Engine.of(accelerator).offloads_optimizer:
        fail(accelerator, f"{why}: DeepSpeed optimizer offload silently replaces SGD by its CPU Adam; "
                          f"use {instead} instead.", everyone=True)


def check_deepspeed_flags(accelerator, grad_accum, max_grad_norm, prepared=True):
    """The flags decide accumulation and clipping; an engine's config that says otherwise (DeepSpeed's JSON) is an
    error (Engine.flags_problem). Before prepare() (prepared=False) the JSON's own numbers are compared, so that the
    refusal comes before any data or model loads; after it, what accelerate made of them ('auto' filled in)."""
    problem = Engine.of(accelerator).flags_problem(grad_accum, max_grad_norm, prepared)
    if problem:
        fail(accelerator, problem, everyone=True)
