"""FSDP2: accelerate's fully_shard, with the shipped config's SHARDED_STATE_DICT or a FULL_STATE_DICT; HSDP too.

Owns what differs from the Engine defaults under FSDP2:
  * HSDP as a property of the engine, as sequence parallelism is DeepSpeed's: accelerate's parallelism_config with
    dp_replicate_size copies of the model, each sharded over dp_shard_size processes (hsdp.yaml: replicate = nodes,
    shard = processes per node); its label says so (hsdp2x2-4proc). Its checkpoints are FSDP2's: the layout records
    the family and the world size, and torch.distributed.checkpoint's metadata the chunks of every tensor, which
    reshard by parameter name onto any other mesh or number of processes (FSDP2 over 2 processes and back), so a
    resume needs nothing more;
  * gradients summed in fp32 like DDP and the DeepSpeed JSONs (reduce_in_fp32: accelerate's policy reduces in the
    compute dtype, and its YAML has no key for it), and what really runs (reduction); buffers cast to its half
    precision;
  * the model built sharded: only the main process writes real weights, the others allocate theirs without touching
    them, and prepare() sends each rank its shards (accelerate's cpu_ram_efficient_loading, switched on for this
    model); a from_pretrained model is mapped by every process (safetensors, shared page cache) and prepare() shards
    the main process's values; a quantised one is loaded whole by every process and sharded by prepare(), so a 4-bit
    base left whole on a rank is a mistake (shards_4bit_base); under float8 (fsdp_fp8.yaml) every process builds or
    loads its own whole copy, which prepare() shards;
  * its checkpoint format (torch.distributed.checkpoint's folders or the full state dict, and accelrun's per-rank
    buffers: BatchNorm statistics differ per rank), LoRA's adapters only (adapters_only), and what a world-size change
    needs (torch.distributed.checkpoint reshards by parameter name; each rank's buffers by resharding.py's rule).
"""

import contextlib
import dataclasses
import functools
import re

import torch
from accelerate.utils import DistributedType

from .. import float8
from ..sharded_model import FLOAT8_WHOLE, QUANTISED_SHARDED, allocated_not_written
from .base import Engine, dtype_name, numbered


class FSDP2(Engine):
    """FSDP2: the shipped config's SHARDED_STATE_DICT (torch.distributed.checkpoint's folders, each rank writing its
    shards) or a FULL_STATE_DICT, which the listed files tell apart; and accelrun's per-rank buffers."""

    accelerate_type = DistributedType.FSDP
    family = "fsdp"
    launch_env = "ACCELERATE_USE_FSDP"
    world_size_change = {"fsdp": "torch.distributed.checkpoint reshards the model and optimizer by parameter name "
                                 "onto the new ranks"}
    keeps_rank_buffers = True
    shards_4bit_base = True
    casts_buffers = True
    sample_listings = ((), ("pytorch_model_fsdp_0/.metadata",))  # a full state dict, or a sharded one's folder

    @classmethod
    def older_format_problem(cls, version, manifest):
        """Format 1: LoRA's checkpoints went from the whole model to the adapters only while it was current (format 2
        is that change), so an FSDP2 LoRA checkpoint of version 1 cannot be told apart and is refused."""
        settings = manifest.get("must_match")
        if version == 1 and isinstance(settings, dict) and settings.get("lora_r"):
            return "records format_version 1 for an FSDP2 LoRA checkpoint, which may hold the whole model where " \
                   "format 2 holds the adapters only: this code does not load it (resume it with the code that " \
                   "wrote it, or start afresh with another --checkpoint-dir)"
        return None

    @property
    def replicas(self):
        """HSDP: the copies of the model (parallelism_config's dp_replicate_size, one per node under Slurm), each
        sharded over processes / replicas processes; 1 for FSDP2 proper, one copy sharded over every process."""
        config = getattr(self.accelerator, "parallelism_config", None)
        size = getattr(config, "dp_replicate_size", 1) if config is not None else 1
        return size if isinstance(size, int) and size > 1 else 1

    def label_name(self):
        """'fsdp', or under HSDP 'hsdpRxS' (R copies of the model, each sharded over S processes)."""
        replicas = self.replicas
        return f"hsdp{replicas}x{self.accelerator.num_processes // replicas}" if replicas > 1 else "fsdp"

    def reduce_in_fp32(self):
        """accelerate's FSDP2 policy reduces gradients in the compute dtype (bf16), while DDP reduces fp32 gradients
        and the DeepSpeed JSONs say communication_data_type fp32: sum the shards' gradients in fp32 under FSDP too
        (each bf16 reduction rounds to 8 bits; at 2 bytes more per gradient element on the wire). accelerate's YAML
        has no key for this (docs/configs.md, 'Gradient reduction')."""
        plugin = self.accelerator.state.fsdp_plugin
        policy = getattr(plugin, "mixed_precision_policy", None)
        if policy is not None and getattr(policy, "param_dtype", None) in (torch.bfloat16, torch.float16):
            plugin.mixed_precision_policy = dataclasses.replace(policy, reduce_dtype=torch.float32)

    def reduction(self, model):
        from torch.distributed.fsdp import FSDPModule
        unit = next(m for m in model.modules() if isinstance(m, FSDPModule))
        policy = unit._get_fsdp_state()._mp_policy
        dtype = policy.reduce_dtype or policy.param_dtype or next(model.parameters()).dtype
        return {"grad_reduce_dtype": dtype_name(dtype), "overlap_comm": None}

    def optimizer_problem(self, optimizer):
        """bitsandbytes' 8-bit optimizers (AdamW8bit, PagedAdamW8bit...) mix plain tensors and FSDP2's DTensors at
        their first step and crash there (bitsandbytes issues 89 and 1633); torchao's 8-bit AdamW handles them."""
        if type(optimizer).__module__.split(".")[0] == "bitsandbytes":
            return (f"{type(optimizer).__name__} (bitsandbytes) cannot step FSDP2's sharded parameters: it fails at "
                    f"its first step mixing torch.Tensor and DTensor (bitsandbytes issues 89, 1633); use "
                    f"--optim-states 8bit (torchao's AdamW8bit)")
        return None

    def prepare_frozen(self, model):
        """Sharded as prepare() shards the trained model (accelerate's fsdp2_prepare_model, the same plugin: unit
        policy, mixed precision); frozen parameters stay in their dtype (only trainable ones are upcast)."""
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model
        return fsdp2_prepare_model(self.accelerator, model)

    @contextlib.contextmanager
    def building(self, from_pretrained=False, quantized=False):
        if from_pretrained and quantized:
            yield QUANTISED_SHARDED
            return
        if float8.asked(self.accelerator):
            # accelerate's broadcast in prepare() leaves the other ranks' weights without torchao's float8 all-gather
            # (the first forward then waits forever: accelerate refuses the combination when its config asks for it)
            yield FLOAT8_WHOLE
            return
        # For this model only: accelerate's broadcast in prepare() handles parameters only, and fails on
        # buffers (BatchNorm's statistics: mnist, resnet) and on modules without Hugging Face's helpers.
        self.accelerator.state.fsdp_plugin.cpu_ram_efficient_loading = True
        how = ("weight files mapped by every process, sharded by prepare() from the main process's copy"
               if from_pretrained else "initialised on the main process only, sharded by prepare()")
        writes_weights = self.accelerator.is_main_process or from_pretrained
        with contextlib.nullcontext() if writes_weights else allocated_not_written():
            yield how

    # ---- the checkpoint format -----------------------------------------------------------------------------------
    @classmethod
    def engine_files(cls, layout, models, optimizers, files):
        world = layout["world_size"]
        needed = [re.escape(f"rank-{r}.buffers.safetensors") for r in range(world)]
        if any(rel.startswith("pytorch_model_fsdp_0/") for rel in files):  # SHARDED_STATE_DICT
            folders = [f"pytorch_model_fsdp_{i}" for i in range(models)] + [f"optimizer_{i}" for i in range(optimizers)]
            for folder in folders:
                needed += [f"{folder}/\\.metadata"] + [f"{folder}/__{r}_0\\.distcp" for r in range(world)]
        else:  # FULL_STATE_DICT
            needed += [re.escape(numbered("pytorch_model_fsdp", i, ".bin")) for i in range(models)]
            needed += [re.escape(numbered("optimizer", i, ".bin")) for i in range(optimizers)]
        return needed, []

    def frozen_kwargs(self, frozen):
        adapters_only(self.accelerator)
        return {}, {}, set()  # the model's folder is torch.distributed.checkpoint's: its keys are not read here


def adapters_only(accelerator):
    """FSDP2, a model with frozen parameters (PEFT's): this accelerator's save_state and load_state write and read the
    model's adapters only, sharded as they are (accelerate's save_fsdp_model and load_fsdp_model with adapter_only:
    PEFT's state dict of the model under SHARDED_STATE_DICT, the trainable part under FULL_STATE_DICT), where they
    took the whole model, frozen base included (a 4-bit one too); the optimizer and the rest as before. accelerate's
    save_state has no argument for it: the two functions it calls are given adapter_only while it runs."""
    import accelerate.accelerator as calls

    def adapter_only(method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            own = calls.save_fsdp_model, calls.load_fsdp_model
            calls.save_fsdp_model, calls.load_fsdp_model = (functools.partial(f, adapter_only=True) for f in own)
            try:
                return method(*args, **kwargs)
            finally:
                calls.save_fsdp_model, calls.load_fsdp_model = own
        return call

    accelerator.save_state = adapter_only(accelerator.save_state)
    accelerator.load_state = adapter_only(accelerator.load_state)
