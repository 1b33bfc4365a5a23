"""Launches that would train wrongly, refused before they start, each with one clear message.

Owns the checks that end a run at start-up:
  * more processes on a node than it has GPUs (before Accelerator(): CUDA set-up would fail a minute later);
  * processes that would each train alone, or without the engine the config asked for;
  * a global batch that does not split evenly over processes and accumulation steps;
  * a DeepSpeed config that contradicts the flags, and optimizer offload under an SGD recipe.
"""

import os
import sys

import torch
from accelerate.utils import DistributedType

from .engines import deepspeed_config, engine_facts
from .exits import fail, report

CPU_HINT = ("To run several processes on a CPU-only machine, set ACCELERATE_USE_CPU=1 for DDP configs; "
            "DeepSpeed and FSDP configs need PYTHONPATH=cpu_route (docs/configs.md, 'On a CPU').")


def check_gpus_before_start():
    """Before Accelerator(): more processes on this node than it has GPUs would die in CUDA set-up with
    'invalid device ordinal' a minute later. Every rank refuses at once, the first one saying why."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not torch.cuda.is_available():
        return  # a CPU run, or the CPU route: no GPU to count
    gpus = torch.cuda.device_count()
    if local > gpus:
        world = os.environ.get("WORLD_SIZE", str(local))
        report(f"this node has {gpus} GPU(s) and the launch starts {local} processes on it (num_processes "
               f"{world}): pass --num_processes {gpus} to accelerate launch, or use accelerate_configs/1gpu.yaml, "
               f"or set ACCELERATE_USE_CPU=1 for a run on the CPU.", os.environ.get("LOCAL_RANK", "0") == "0")
        sys.exit(2)


def check_launch(accelerator):
    """Refuse to train as silent independent copies, or without the engine the config asked for."""
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
    """The global batch of one optimizer step must split evenly over processes x accumulation steps."""
    world = accelerator.num_processes
    if batch_size % (world * grad_accum) or (eval_batch_size or 0) % world:
        good = world * grad_accum
        problems = []
        if batch_size % good:
            problems.append(f"--batch-size {batch_size} is the global batch of one optimizer step and must divide "
                            f"by processes x --grad-accum = {good} (try {max(good, batch_size // good * good)})")
        if (eval_batch_size or 0) % world:
            problems.append(f"--eval-batch-size {eval_batch_size} must divide by the {world} processes")
        fail(accelerator, "; ".join(problems), everyone=True)


def refuse_optimizer_offload(accelerator, why, instead):
    """For recipes built on SGD: under DeepSpeed optimizer offload, prepare() silently replaces whatever
    torch optimizer the recipe made by DeepSpeed's CPU Adam. Stop before that, with one line."""
    if engine_facts(accelerator)["offload_optimizer"]:
        fail(accelerator, f"{why}: DeepSpeed optimizer offload silently replaces SGD by its CPU Adam; "
                          f"use {instead} instead.", everyone=True)


def check_deepspeed_flags(accelerator, grad_accum, max_grad_norm):
    """The flags decide accumulation and clipping; a DeepSpeed config that says otherwise is an error."""
    ds = deepspeed_config(accelerator)
    if ds and (accelerator.gradient_accumulation_steps != grad_accum
               or float(ds.get("gradient_clipping", 0.0)) != max_grad_norm):
        fail(accelerator, f"the DeepSpeed config sets gradient_accumulation_steps="
                          f"{ds.get('gradient_accumulation_steps')} and gradient_clipping="
                          f"{ds.get('gradient_clipping')}, the flags say {grad_accum} and {max_grad_norm}: "
                          f"remove those keys from the YAML so the flags decide.", everyone=True)
