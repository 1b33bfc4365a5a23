"""The model built sharded from the start under ZeRO-3 and FSDP, never whole on every process.

Owns what run.sharded_init() does. ZeRO-3 with zero3_init_flag: DeepSpeed's zero.Init partitions each
module's weights as its constructor returns, so no process ever holds the whole model. FSDP:
only the main process writes real weights, the others allocate theirs without touching them,
and prepare() sends each rank its shards (accelerate's cpu_ram_efficient_loading, switched on
for this model). A Hugging Face model from from_pretrained (sharded_init(from_pretrained=True)) is
loaded partitioned by transformers itself under ZeRO-3; under FSDP every process maps the weight
files (safetensors, shared page cache) and prepare() shards the main process's values. A quantised
from_pretrained (sharded_init(from_pretrained=True, quantized=True): finetune_lm's QLoRA) is loaded whole and
quantised by every process, as transformers loads a quantised model outside zero.Init and accelerate shards each
process's own copy of 4-bit weights under FSDP2; prepare() then shards or partitions it. Anything else, and any model
built outside sharded_init(): built whole.

Also owns the one refusal that follows from it: ZeRO-3 with zero3_init_flag off loads a pretrained model whole on
every process before partitioning it, which is stopped when the processes cannot hold it (check_whole_model_fits).
"""

import contextlib
import math
import os

import torch
from accelerate.utils import DistributedType, broadcast

from .exits import fail

BUILT_WHOLE = "built whole on every process"  # any model built outside sharded_init(), too


@contextlib.contextmanager
def sharded_building(accelerator, from_pretrained=False, quantized=False):
    """Build the model inside; yields how it is built (the summary's model_init). from_pretrained: a Hugging
    Face model loaded inside, which enters zero.Init itself (transformers reads the Accelerator's ZeRO-3
    settings) and writes its own weights; quantized: loaded quantised (see the module's docstring)."""
    plugin = accelerator.state.deepspeed_plugin
    zero3 = accelerator.distributed_type == DistributedType.DEEPSPEED and plugin.zero_stage == 3
    if from_pretrained and quantized:
        sharded = zero3 or accelerator.distributed_type == DistributedType.FSDP
        yield "loaded whole and quantised by every process, sharded by prepare()" if sharded else BUILT_WHOLE
    elif zero3 and plugin.zero3_init_flag:
        import deepspeed
        how = "loaded (transformers, zero.Init)" if from_pretrained else "built (zero.Init)"
        with contextlib.nullcontext() if from_pretrained else deepspeed.zero.Init(
                config_dict_or_path=plugin.dschf.config):  # the JSON, 'auto's resolved
            yield "partitioned while " + how
    elif accelerator.distributed_type == DistributedType.FSDP:
        # For this model only: accelerate's broadcast in prepare() handles parameters only, and fails on
        # buffers (BatchNorm's statistics: mnist, resnet) and on modules without Hugging Face's helpers.
        accelerator.state.fsdp_plugin.cpu_ram_efficient_loading = True
        how = ("weight files mapped by every process, sharded by prepare() from the main process's copy"
               if from_pretrained else "initialised on the main process only, sharded by prepare()")
        writes_weights = accelerator.is_main_process or from_pretrained
        with contextlib.nullcontext() if writes_weights else _allocated_not_written():
            yield how
    else:
        yield BUILT_WHOLE


@contextlib.contextmanager
def _allocated_not_written():
    """torch.nn.init does nothing inside: the weights are allocated but never written, so the operating
    system never maps their pages and they take no memory; prepare() fills in the main process's values.
    (Not the meta device: accelerate matches the optimizer's parameters by address, and meta has none.)"""
    init = torch.nn.init
    saved = {name: getattr(init, name) for name in dir(init) if name.endswith("_") and not name.startswith("_")}
    for name in saved:
        setattr(init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(init, name, function)


def check_whole_model_fits(accelerator, n_params):
    """Collective: ZeRO-3 with zero3_init_flag off loads the whole fp32 model on every process: stop, on every
    rank, if they cannot hold it (host memory for this node's processes, or one GPU's memory)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3 or plugin.zero3_init_flag:
        return
    whole_gb, local = 4 * n_params / 1e9, int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    with open("/proc/meminfo") as f:
        free_gb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) * 1024 / 1e9
    gpu_gb = math.inf
    if torch.cuda.is_available():
        gpu_gb = torch.cuda.get_device_properties(accelerator.device).total_memory / 1e9
    if broadcast(torch.tensor([float(whole_gb * local > free_gb or whole_gb > gpu_gb)], device=accelerator.device)):
        fail(accelerator, f"ZeRO-3 with zero3_init_flag off loads the whole model on every process first: "
                          f"{whole_gb:.1f} GB in fp32 x {local} processes here, with {free_gb:.1f} GB of host memory "
                          f"free and {gpu_gb:.0f} GB per GPU. Set zero3_init_flag: true in the config "
                          f"(deepspeed_zero3.yaml has it) or pass --zero3_init_flag true")
