"""How a recipe's model is built: sharded from the start under ZeRO-3 and FSDP.

Owns run.sharded_init(). ZeRO-3 with zero3_init_flag: DeepSpeed's zero.Init partitions each
module's weights as its constructor returns, so no process ever holds the whole model. FSDP
with fsdp_cpu_ram_efficient_loading: only the main process writes real weights, the others
allocate theirs without touching them, and accelerate's prepare() sends each rank its shards.
Anything else: built whole, as written (and a model built outside sharded_init() always is). Both are accelerate's own switches, honoured here for
models a recipe builds itself (transformers' from_pretrained honours them on its own).
"""

import contextlib

import torch
from accelerate.utils import DistributedType


@contextlib.contextmanager
def building_context(run):
    """Sets run.model_init to what was done."""
    acc, plugin = run.accelerator, run.accelerator.state.deepspeed_plugin
    if acc.distributed_type == DistributedType.DEEPSPEED and plugin.zero_stage == 3 and plugin.zero3_init_flag:
        import deepspeed
        run.model_init = "partitioned while built (zero.Init)"
        with deepspeed.zero.Init(config_dict_or_path=plugin.dschf.config):  # the JSON, 'auto's resolved
            yield
    elif acc.distributed_type == DistributedType.FSDP and run.efficient_loading:
        acc.state.fsdp_plugin.cpu_ram_efficient_loading = True  # held back by hold_efficient_loading
        run.model_init = "initialised on the main process only, sharded by prepare()"
        with contextlib.nullcontext() if acc.is_main_process else _allocated_not_written():
            yield
    else:
        run.model_init = "built whole on every process"
        yield


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


def hold_efficient_loading(accelerator):
    """Call before prepare(): returns whether the config asks for fsdp_cpu_ram_efficient_loading, and turns it
    off until run.sharded_init() turns it back on. accelerate then sends each rank its shards of the main
    process's state dict, but only of parameters: a model with buffers (BatchNorm's running statistics,
    mnist's and resnet's) fails in prepare(). A model built inside run.sharded_init() has none (gpt.py)."""
    plugin = accelerator.state.fsdp_plugin if accelerator.distributed_type == DistributedType.FSDP else None
    wanted = bool(plugin and plugin.cpu_ram_efficient_loading)
    if wanted:
        plugin.cpu_ram_efficient_loading = False
    return wanted
