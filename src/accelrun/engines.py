"""What accelerate really set up, and the adjustments that make every engine run the recipe's optimisation.

Owns:
  * engine_facts / run_label: the distributed type, world size, precision, ZeRO stage and offload that run
    (the first log line, the summary, checkpoint layouts, the default output directory), and where a DeepSpeed
    run's precision comes from (precision_source: its JSON, whatever --mixed_precision says);
  * clipping: DeepSpeed clips like the recipe's --max-grad-norm, never by a config's default;
  * gradient reduction: fp32 under FSDP like DDP and the DeepSpeed JSONs, and what really runs;
  * BatchNorm buffers cast to the half precision DeepSpeed and FSDP compute in;
  * the exported weights: gathered from the shards, DeepSpeed's fp32 masters rather than its half-precision
    copies, in fp32 under the model's own names (uncompiled_name), from every engine alike;
  * torch's deprecation warning for the two collectives DeepSpeed calls at every step, silenced, and DeepSpeed told
    that it runs on the CPU where there is no GPU (no "Setting accelerator to CPU" warning from every process).
"""

import dataclasses
import os
import sys
import warnings

import torch
from accelerate.utils import DistributedType

# torch 2.14 deprecates all_gather_into_tensor and reduce_scatter_tensor (in favour of all_gather_single and
# reduce_scatter_single) with a FutureWarning at each call. DeepSpeed 0.19.8 (deepspeed/comm/torch.py) calls
# both at every ZeRO step, and Python forgets which warnings it has shown whenever the filters change (each
# warnings.catch_warnings() exit does), so the message came back at every step: a ZeRO-3 log was 97% this
# message (2,404 of 2,459 lines in a 300-step fine-tune). Only these two messages are ignored; every other
# warning still shows. Remove this once DeepSpeed calls the *_single collectives (or torch stops warning).
DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def quiet_deprecated_collectives():
    """Ignore torch's deprecation warning for DeepSpeed's two per-step collectives, in this process."""
    warnings.filterwarnings("ignore", message=DEPRECATED_COLLECTIVES, category=FutureWarning)


def name_the_cpu_for_deepspeed():
    """Before DeepSpeed is imported (accelerate imports it in unwrap_model wherever it is installed, under DDP too):
    without a GPU, DS_ACCELERATOR=cpu, what DeepSpeed would find anyway after warning "Setting accelerator to CPU. If
    you have GPU or other accelerator, we were unable to detect it." from every process. The run's first line names
    the device instead."""
    if "deepspeed" not in sys.modules and "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def deepspeed_config(accelerator):
    plugin = accelerator.state.deepspeed_plugin
    return plugin.deepspeed_config if plugin else {}


def sequence_parallel_size(accelerator):
    """Processes that share one sequence under DeepSpeed's Ulysses sequence parallelism (accelerate's
    parallelism_config: sp_size, sp_backend deepspeed); 1 without it. They read the same data: the processes that
    read different data are num_processes / this."""
    config = getattr(accelerator, "parallelism_config", None)
    return config.sp_size if config is not None and config.sp_backend == "deepspeed" and config.sp_size > 1 else 1


def engine_facts(accelerator):
    """What accelerate really set up, for the first log line, the summary and checkpoint layouts."""
    zero = deepspeed_config(accelerator).get("zero_optimization", {})
    return {"distributed_type": accelerator.distributed_type.value, "world_size": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision, "deepspeed_stage": zero.get("stage"),
            "offload_optimizer": zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None),
            "sequence_parallel": sequence_parallel_size(accelerator)}


def precision_source(facts, environ=os.environ, launch_argv=None):
    """For the first line, after the precision: under DeepSpeed, that its JSON set it, and where the launch asked for
    another with --mixed_precision, that the JSON overrode the flag (a CPU without bf16 instructions ran 4.5x slower
    than the fp32 it was asked for); in half precision, the fp32 JSON shipped beside it. "" otherwise.
    accelerate launch passes the flag on as ACCELERATE_MIXED_PRECISION, "no" when it was not given either: whether it
    was typed is read from the launcher's command line (launch_argv; None: the parent process's, where readable);
    where that cannot be told (srun, torchrun), the line says only that the JSON set the precision."""
    json_file = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "")
    if facts["distributed_type"] != DistributedType.DEEPSPEED.value or not json_file:
        return ""
    asked, precision = environ.get("ACCELERATE_MIXED_PRECISION", "").lower(), facts["mixed_precision"]
    overridden = asked not in ("", precision) and mixed_precision_flag_given(launch_argv) is True
    source = (f"--mixed_precision {asked} overridden by {json_file}" if overridden else
              f"set by {json_file}, not by --mixed_precision")
    if precision == "no":
        return f" ({source})" if overridden else ""
    fp32 = json_file.removesuffix(".json") + "_fp32.json"
    instead = f"--deepspeed_config_file {fp32}" if os.path.isfile(fp32) else f"a copy of {json_file} with it off"
    return f" ({source}; fp32: {instead})"


def mixed_precision_flag_given(launch_argv=None):
    """Whether accelerate launch's command line holds --mixed_precision: True, False, or None where it cannot be
    told (no launch_argv, and the parent process is not a readable accelerate launch: torchrun, srun)."""
    if launch_argv is None:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                launch_argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            return None
        if not any(part.endswith("accelerate") or part == "launch" for part in launch_argv):
            return None
    return any(arg == "--mixed_precision" or arg.startswith("--mixed_precision=") for arg in launch_argv)


def run_label(accelerator):
    """A short name for the way this run is launched, e.g. 'ddp-2proc-bf16' or 'zero3-offload-2proc':
    the default output directory is runs/<recipe>/<label>, so swapping configs keeps each one's results,
    and the same command finds its own directory again."""
    e = engine_facts(accelerator)
    engine = {DistributedType.NO: "", DistributedType.DEEPSPEED: f"zero{e['deepspeed_stage']}",
              DistributedType.FSDP: "fsdp"}.get(accelerator.distributed_type, "ddp")
    parts = [engine, "offload" if e["offload_optimizer"] else "", f"sp{e['sequence_parallel']}" if
             e["sequence_parallel"] > 1 else "", f"{e['world_size']}proc",
             "" if e["mixed_precision"] == "no" else e["mixed_precision"]]
    dynamo = accelerator.state.dynamo_plugin
    if dynamo is not None and dynamo.backend.value != "NO":
        parts.append("compile")
    return "-".join(p for p in parts if p)


def deepspeed_clip_like(accelerator, max_grad_norm):
    """Call before prepare(). DeepSpeed clips gradients itself, and accelerate turns the config's 'auto' into
    a clipping norm of 1.0, while DDP and FSDP never clip on their own: make DeepSpeed clip like the recipe's
    flag (0: not at all), so every config runs the same optimisation."""
    ds = deepspeed_config(accelerator)
    if ds and ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = float(max_grad_norm)


def fsdp_reduce_in_fp32(accelerator):
    """Call before prepare(). accelerate's FSDP2 policy reduces gradients in the compute dtype (bf16), while
    DDP reduces fp32 gradients and the DeepSpeed JSONs say communication_data_type fp32: sum the shards'
    gradients in fp32 under FSDP too (each bf16 reduction rounds to 8 bits; at 2 bytes more per gradient
    element on the wire). accelerate's YAML has no key for this (docs/configs.md, 'Gradient reduction')."""
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


def uncompiled_name(key):
    """A state dict key under the model's own name: torch.compile (a *_compile.yaml) puts _orig_mod. in every key."""
    return key.replace("_orig_mod.", "")


def exported_weights(accelerator, model, exclude=()):
    """Collective: the weights to export, on the main process (None elsewhere): ZeRO-3 / FSDP shards gathered,
    every floating-point tensor in fp32 on the CPU, under the model's own names, without the keys in `exclude`.
    A DeepSpeed bf16/fp16 engine holds half-precision weights and keeps the fp32 masters in its optimizer;
    accelerate's get_state_dict returns the half-precision ones, so each trained parameter is replaced by its fp32
    master (DeepSpeed's safe_get_full_fp32_param, a collective under ZeRO), as DDP and FSDP export theirs."""
    state_dict = accelerator.get_state_dict(model)
    if accelerator.distributed_type == DistributedType.DEEPSPEED and next(model.parameters()).dtype != torch.float32:
        _with_fp32_masters(state_dict, model)
    if not accelerator.is_main_process:
        return None
    named = ((uncompiled_name(k), v) for k, v in state_dict.items())
    return {k: (v.float() if v.is_floating_point() else v).contiguous().cpu() for k, v in named if k not in exclude}


def _with_fp32_masters(state_dict, ds_engine):
    """Collective: each trained parameter's fp32 master from the DeepSpeed engine's optimizer into state_dict (None
    off the main process under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    masters = {}
    for name, param in ds_engine.module.named_parameters(remove_duplicate=False):  # the same order on every rank
        if hasattr(param, "ds_id") and not hasattr(param, "_z3_optimizer"):
            continue  # ZeRO-3, not trained: no fp32 master
        if id(param) not in masters:
            masters[id(param)] = safe_get_full_fp32_param(param)
        if state_dict is not None and masters[id(param)] is not None and name in state_dict:
            state_dict[name] = masters[id(param)]


def cast_buffers_for_half_precision(accelerator, model):
    """DeepSpeed and FSDP compute with bf16 weights but leave buffers in fp32, and BatchNorm
    refuses running statistics of another dtype than its weights."""
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)
    if half and accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        for buffer in model.buffers():
            if buffer.is_floating_point():
                buffer.data = buffer.data.to(half)
