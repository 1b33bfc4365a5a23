"""Launch and engine checks: what accelerate really set up, and one clear refusal when it is wrong.

Owns:
  * fail / main_print: one message from the main process, the same non-zero exit on every rank;
  * check_launch / check_batch: no rank trains alone, the global batch splits evenly;
  * engine: the distributed type, ZeRO stage and offload that really run;
  * gradient reduction: fp32 under FSDP like DDP and the DeepSpeed JSONs, and what really runs;
  * the DeepSpeed quirks: clipping that follows the recipe's flag, flags that win over the config,
    the optimizer offload silently swaps in, bf16 buffers for BatchNorm.
"""

import dataclasses
import json
import os
import sys
import time

import torch
from accelerate.utils import DistributedType

CPU_HINT = ("To run several processes on a CPU-only machine, set ACCELERATE_USE_CPU=1 for DDP configs; "
            "DeepSpeed and FSDP configs need PYTHONPATH=cpu_route (docs/configs.md, 'On a CPU').")


def main_print(accelerator):
    """print() on the main process only (accelerator.print prints once per node)."""
    def log(*message, **kwargs):
        if accelerator.is_main_process:
            print(*message, **kwargs, flush=True)
    return log


def fail(accelerator, message, code=2, everyone=False):
    """One clear message from the main process, and exit `code` from every process that calls it.

    Under accelerate launch / torchrun each worker also writes the line to its torch elastic error file,
    so the launcher's failure summary ends with it ("traceback : error: ...") instead of a pointer to
    the docs; a real crash writes no such file and keeps its Python traceback. everyone=True: every
    rank calls this at the same point, so they meet once more before closing their connections (a
    rank that leaves first can break a peer still setting up gloo).
    """
    _report(message, accelerator.is_main_process)
    if everyone and accelerator.num_processes > 1:
        accelerator.wait_for_everyone()
    accelerator.end_training()  # tear down the process group before exiting
    sys.exit(code)


def _report(message, main):
    line = f"error: {message}"
    if main:
        print(line, file=sys.stderr, flush=True)
    reply = os.environ.get("TORCHELASTIC_ERROR_FILE")  # one per worker, set by the launcher
    if reply:
        try:
            with open(reply + ".tmp", "w") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
            os.replace(reply + ".tmp", reply)  # the launcher reads it whole or not at all
        except OSError:
            pass  # the message is on stderr anyway


def check_gpus_before_start():
    """Before Accelerator(): more processes on this node than it has GPUs would die in CUDA set-up with
    'invalid device ordinal' a minute later. Every rank refuses at once, the first one saying why."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not torch.cuda.is_available():
        return  # a CPU run, or the CPU route: no GPU to count
    gpus = torch.cuda.device_count()
    if local > gpus:
        world = os.environ.get("WORLD_SIZE", str(local))
        _report(f"this node has {gpus} GPU(s) and the launch starts {local} processes on it (num_processes "
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


def deepspeed_config(accelerator):
    plugin = accelerator.state.deepspeed_plugin
    return plugin.deepspeed_config if plugin else {}


def engine(accelerator):
    """What accelerate really set up, for the first log line, the summary and checkpoint layouts."""
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


def fsdp_reduce_in_fp32(accelerator):
    """Call before prepare(). accelerate's FSDP2 policy reduces gradients in the compute dtype (bf16), while
    DDP reduces fp32 gradients and the DeepSpeed JSONs say communication_data_type fp32: sum the shards' gradients
    in fp32 under FSDP too (each bf16 reduction rounds to 8 bits; at 2 bytes more per gradient element on
    the wire). accelerate's YAML has no key for this (docs/configs.md, 'Gradient reduction')."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return
    plugin = accelerator.state.fsdp_plugin
    policy = getattr(plugin, "mixed_precision_policy", None)
    if policy is not None and getattr(policy, "param_dtype", None) in (torch.bfloat16, torch.float16):
        plugin.mixed_precision_policy = dataclasses.replace(policy, reduce_dtype=torch.float32)


def gradient_sync(accelerator, model):
    """After prepare(): the dtype gradients are summed across processes in, and (DeepSpeed) whether that
    overlaps with the backward pass, read from the engine that runs, for the summary."""
    if accelerator.num_processes == 1:
        return {"grad_reduce_dtype": None, "overlap_comm": None}
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return {"grad_reduce_dtype": str(model.communication_data_type).replace("torch.", ""),
                "overlap_comm": bool(getattr(model.optimizer, "overlap_comm", model.zero_overlap_comm()))}
    if accelerator.distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp import FSDPModule
        unit = next(m for m in model.modules() if isinstance(m, FSDPModule))
        policy = unit._get_fsdp_state()._mp_policy
        dtype = policy.reduce_dtype or policy.param_dtype or next(model.parameters()).dtype
        return {"grad_reduce_dtype": str(dtype).replace("torch.", ""), "overlap_comm": None}
    return {"grad_reduce_dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "overlap_comm": None}


def refuse_optimizer_offload(accelerator, why, instead):
    """For recipes built on SGD: under DeepSpeed optimizer offload, prepare() silently replaces whatever
    torch optimizer the recipe made by DeepSpeed's CPU Adam. Stop before that, with one line."""
    if engine(accelerator)["offload_optimizer"]:
        fail(accelerator, f"{why}: DeepSpeed optimizer offload silently replaces SGD by its CPU Adam; "
                          f"use {instead} instead.", everyone=True)


def check_deepspeed_flags(accelerator, grad_accum, max_grad_norm):
    """The flags decide accumulation and clipping; a DeepSpeed config that says otherwise is an error."""
    ds = deepspeed_config(accelerator)
    if ds and (accelerator.gradient_accumulation_steps != grad_accum
               or float(ds.get("gradient_clipping", 0.0)) != max_grad_norm):
        fail(accelerator, f"the DeepSpeed config sets gradient_accumulation_steps={ds.get('gradient_accumulation_steps')} "
                          f"and gradient_clipping={ds.get('gradient_clipping')}, the flags say {grad_accum} and "
                          f"{max_grad_norm}: remove those keys from the YAML so the flags decide.", everyone=True)


def innermost_optimizer(prepared):
    """The torch optimizer that really steps, inside accelerate's and DeepSpeed's wrappers."""
    inner = prepared
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return inner


def implementation(optimizer):
    """How a torch optimizer runs its update: one fused kernel, foreach kernels, or a Python loop."""
    defaults = getattr(optimizer, "defaults", {})
    return "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "default"


def stepping_optimizer(prepared, scheduler=None):
    """Name of the optimizer that really steps; points the scheduler at it.

    Under optimizer offload prepare() replaces the optimizer the recipe created by DeepSpeedCPUAdam,
    and a scheduler would go on setting the learning rate of one that never steps.
    """
    inner = innermost_optimizer(prepared)
    if scheduler is not None and getattr(scheduler, "scheduler", None) is not None \
            and innermost_optimizer(scheduler.scheduler.optimizer) is not inner:
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


def finish(accelerator):
    """Destroy the process group while the interpreter is alive: left to interpreter shutdown, gloo's C++
    side is torn down after Python and can abort a run that succeeded ("terminate called without an
    active exception")."""
    accelerator.free_memory()
    accelerator.end_training()
