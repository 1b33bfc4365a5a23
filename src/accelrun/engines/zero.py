"""DeepSpeed: ZeRO stages 0-3, with or without optimizer offload, and Ulysses sequence parallelism on top.

Owns what differs from the Engine defaults under DeepSpeed:
  * its facts: the ZeRO stage and optimizer offload its JSON sets (label zeroN[-offload]), and where the run's
    precision comes from (precision_source: its JSON, whatever --mixed_precision says);
  * its adjustments: it clips like the recipe's --max-grad-norm, never by a config's default (clip_like); a config
    that contradicts the flags is refused (flags_problem); buffers cast to its half precision; no autocast (its
    weights are in the compute dtype); the optimizer steps inside backward();
  * the model built partitioned under ZeRO-3 with zero3_init_flag (zero.Init), and the refusal of a pretrained model
    that ZeRO-3 without it would load whole on processes that cannot hold it (check_whole_model_fits);
  * the export: its fp32 masters rather than its half-precision copies (with_fp32_masters);
  * its checkpoint format (its module states, one file or one per rank under ZeRO-3, its optimizer states per rank,
    its extras; LoRA's frozen weights left out with exclude_frozen_parameters) and what a world-size change needs
    (the universal checkpoint: checkpoint/resharding.py converts and loads it);
  * the micro-batch it is told under sequence parallelism (tell_micro_batch: finetune/ulysses.py);
  * torch's deprecation warning for the two collectives it calls at every step, silenced, and DeepSpeed told that it
    runs on the CPU where there is no GPU (no "Setting accelerator to CPU" warning from every process).
"""

import contextlib
import math
import os
import re
import sys
import warnings

import torch
from accelerate.utils import DistributedType, broadcast

from ..checkpoint.untrusted import whole
from ..exits import fail
from ..sharded_model import BUILT_WHOLE, QUANTISED_SHARDED
from .base import Engine, dtype_name, numbered

# torch 2.14 deprecates all_gather_into_tensor and reduce_scatter_tensor (in favour of all_gather_single and
# reduce_scatter_single) with a FutureWarning at each call. DeepSpeed 0.19.8 (deepspeed/comm/torch.py) calls
# both at every ZeRO step, and Python forgets which warnings it has shown whenever the filters change (each
# warnings.catch_warnings() exit does), so the message came back at every step: a ZeRO-3 log was 97% this
# message (2,404 of 2,459 lines in a 300-step fine-tune). Only these two messages are ignored; every other
# warning still shows. Remove this once DeepSpeed calls the *_single collectives (or torch stops warning).
DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"

UNIVERSAL = ("DeepSpeed's universal checkpoint (ds_to_universal, converted once into the checkpoint's universal/ "
             "part, then load_universal) repartitions the {} onto the new ranks")


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


class DeepSpeed(Engine):
    """DeepSpeed ZeRO 0-3: its module states (one file, or one per rank under ZeRO-3), its optimizer states per rank
    (ZeRO 1-3), and its own extras (the tag file, the recovery scripts)."""

    accelerate_type = DistributedType.DEEPSPEED
    family = "deepspeed"
    launch_env = "ACCELERATE_USE_DEEPSPEED"
    world_size_change = {"deepspeed ZeRO-1": UNIVERSAL.format("optimizer state"),
                         "deepspeed ZeRO-2": UNIVERSAL.format("optimizer state"),
                         "deepspeed ZeRO-3": UNIVERSAL.format("parameters and optimizer state")}
    optimizer_in_backward = True
    autocasts = False  # its adapters and weights compute in the dtype they are in
    casts_buffers = True

    @property
    def plugin(self):
        return self.accelerator.state.deepspeed_plugin

    @property
    def config(self):
        """The DeepSpeed JSON as accelerate holds it ('auto's filled in by prepare())."""
        plugin = self.plugin
        return plugin.deepspeed_config if plugin else {}

    @property
    def stage(self):
        return self.config.get("zero_optimization", {}).get("stage")

    @property
    def offloads_optimizer(self):
        zero = self.config.get("zero_optimization", {})
        return zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)

    @property
    def partitions_parameters(self):
        return self.stage == 3

    def label_name(self):
        return f"zero{self.stage}"

    def float8_problem(self, compiled):
        """torchao's float8 runs under FSDP2, one process or DDP here; DeepSpeed's engine wraps the parameters in its
        own flat bf16 and fp32 copies, a path no test of this repository runs."""
        return ("mixed precision fp8 is not run under DeepSpeed here (torchao's float8 runs under FSDP2, one process "
                "or DDP): use accelerate_configs/fsdp_fp8.yaml")

    def optimizer_states_problem(self, kind):
        """DeepSpeed steps its own optimizer over its fp32 partitions (or DeepSpeedCPUAdam under offload), whatever the
        recipe builds: low-precision moments cannot be asked of it through the recipe."""
        return (f"--optim-states {kind} is not available under DeepSpeed, which keeps its own fp32 optimizer states: "
                f"use accelerate_configs/fsdp.yaml (FSDP2) or a DDP config, or here deepspeed_zero3_offload.yaml to "
                f"move the states to the CPU")

    def clip_like(self, max_grad_norm):
        """DeepSpeed clips gradients itself, and accelerate turns the config's 'auto' into a clipping norm of 1.0,
        while DDP and FSDP never clip on their own: make DeepSpeed clip like the recipe's flag (0: not at all), so
        every config runs the same optimisation."""
        ds = self.config
        if ds and ds.get("gradient_clipping", "auto") == "auto":
            ds["gradient_clipping"] = float(max_grad_norm)

    def flags_problem(self, grad_accum, max_grad_norm, prepared):
        """The flags decide accumulation and clipping; a DeepSpeed config that says otherwise is an error. Before
        prepare() (prepared=False) the JSON's own numbers are compared, so that the refusal comes before any data or
        model loads; after it, what accelerate made of them ('auto' filled in)."""
        ds = self.config
        if not ds:
            return None
        accum = (self.accelerator.gradient_accumulation_steps if prepared
                 else ds.get("gradient_accumulation_steps", "auto"))
        clip = ds.get("gradient_clipping", 0.0 if prepared else "auto")
        if (accum != "auto" and accum != grad_accum) or (clip != "auto" and float(clip) != max_grad_norm):
            return (f"the DeepSpeed config sets gradient_accumulation_steps={ds.get('gradient_accumulation_steps')} "
                    f"and gradient_clipping={ds.get('gradient_clipping')}, the flags say {grad_accum} and "
                    f"{max_grad_norm}: remove those keys from the YAML so the flags decide.")
        return None

    def reduction(self, model):
        return {"grad_reduce_dtype": dtype_name(model.communication_data_type),
                "overlap_comm": bool(getattr(model.optimizer, "overlap_comm", model.zero_overlap_comm()))}

    def tell_micro_batch(self, micro):
        """Under sequence parallelism (finetune/ulysses.py): the micro-batch a rank really runs, which accelerate would
        otherwise read from the loaders it prepares."""
        self.config["train_micro_batch_size_per_gpu"] = micro

    # ---- the model built, the weights exported ---------------------------------------------------------------
    def prepare_frozen(self, model):
        """ZeRO-3: a DeepSpeed engine of its own without an optimizer (inference only: the parameters gathered layer by
        layer in its forward, as TRL's DPO does), from the run's resolved config; ZeRO-1/2 hold it whole."""
        if not self.partitions_parameters:
            return super().prepare_frozen(model)
        import deepspeed
        config = {k: v for k, v in self.accelerator.deepspeed_config.items() if k not in ("optimizer", "scheduler")}
        return deepspeed.initialize(model=model, config=config)[0]

    @contextlib.contextmanager
    def building(self, from_pretrained=False, quantized=False):
        """ZeRO-3 with zero3_init_flag: DeepSpeed's zero.Init partitions each module's weights as its constructor
        returns (a from_pretrained model enters zero.Init itself: transformers reads the Accelerator's ZeRO-3
        settings); a quantised model is loaded whole by every process and partitioned by prepare()."""
        plugin = self.plugin
        zero3 = plugin.zero_stage == 3
        if from_pretrained and quantized:
            yield QUANTISED_SHARDED if zero3 else BUILT_WHOLE
        elif zero3 and plugin.zero3_init_flag:
            import deepspeed
            how = "loaded (transformers, zero.Init)" if from_pretrained else "built (zero.Init)"
            with contextlib.nullcontext() if from_pretrained else deepspeed.zero.Init(
                    config_dict_or_path=plugin.dschf.config):  # the JSON, 'auto's resolved
                yield "partitioned while " + how
        else:
            yield BUILT_WHOLE

    def check_whole_model_fits(self, n_params):
        """Collective: ZeRO-3 with zero3_init_flag off loads the whole fp32 model on every process: stop, on every
        rank, if they cannot hold it (host memory for this node's processes, or one GPU's memory)."""
        plugin, acc = self.plugin, self.accelerator
        if plugin is None or plugin.zero_stage != 3 or plugin.zero3_init_flag:
            return
        whole_gb, local = 4 * n_params / 1e9, int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        with open("/proc/meminfo") as f:
            free_gb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) * 1024 / 1e9
        gpu_gb = math.inf
        if torch.cuda.is_available():
            gpu_gb = torch.cuda.get_device_properties(acc.device).total_memory / 1e9
        if broadcast(torch.tensor([float(whole_gb * local > free_gb or whole_gb > gpu_gb)], device=acc.device)):
            fail(acc, f"ZeRO-3 with zero3_init_flag off loads the whole model on every process first: "
                      f"{whole_gb:.1f} GB in fp32 x {local} processes here, with {free_gb:.1f} GB of host memory "
                      f"free and {gpu_gb:.0f} GB per GPU. Set zero3_init_flag: true in the config "
                      f"(deepspeed_zero3.yaml has it) or pass --zero3_init_flag true")

    def with_fp32_masters(self, state_dict, model):
        """Collective: a DeepSpeed bf16/fp16 engine holds half-precision weights and keeps the fp32 masters in its
        optimizer; accelerate's get_state_dict returns the half-precision ones, so each trained parameter is replaced
        by its fp32 master (DeepSpeed's safe_get_full_fp32_param, a collective under ZeRO; state_dict None off the
        main process under ZeRO-3), as DDP and FSDP export theirs."""
        if next(model.parameters()).dtype == torch.float32:
            return
        from deepspeed.utils import safe_get_full_fp32_param

        masters = {}
        for name, param in model.module.named_parameters(remove_duplicate=False):  # the same order on every rank
            if hasattr(param, "ds_id") and not hasattr(param, "_z3_optimizer"):
                continue  # ZeRO-3, not trained: no fp32 master
            if id(param) not in masters:
                masters[id(param)] = safe_get_full_fp32_param(param)
            if state_dict is not None and masters[id(param)] is not None and name in state_dict:
                state_dict[name] = masters[id(param)]

    # ---- the checkpoint format -----------------------------------------------------------------------------------
    @classmethod
    def writes_stage(cls, stage):
        return whole(stage, 0, 3)

    @classmethod
    def engine_files(cls, layout, models, optimizers, files):
        world, stage = layout["world_size"], layout["zero_stage"]
        needed, optional = [], ["latest", "zero_to_fp32\\.py", "zero_to_torch\\.py"]
        for i in range(models):
            tag = re.escape(numbered("pytorch_model", i))
            if stage == 3:
                needed += [f"{tag}/zero_pp_rank_{r}_mp_rank_00_model_states\\.pt" for r in range(world)]
            else:
                needed.append(f"{tag}/mp_rank_00_model_states\\.pt")
            if stage:
                needed += [f"{tag}/(bf16_)?zero_pp_rank_{r}_mp_rank_00_optim_states\\.pt" for r in range(world)]
        return needed, optional

    def model_keys(self, held):
        """The module state's keys, loaded as weights only through the held descriptor (tensors memory-mapped)."""
        from ..checkpoint.safe_loading import weights_only_loading

        rel = next(r for r in sorted(held.held) if r.startswith("pytorch_model/") and r.endswith("_model_states.pt"))
        with weights_only_loading():
            states = torch.load(held.fd_path(rel), map_location="cpu", mmap=True)
        module = states.get("module") if isinstance(states, dict) else None
        return rel, list(module) if isinstance(module, dict) else ["<no module state>"]

    def frozen_kwargs(self, frozen):
        return {"exclude_frozen_parameters": True}, {"load_module_strict": False}, frozen

    @classmethod
    def kind(cls, layout):
        return f"deepspeed ZeRO-{layout['zero_stage']}"

    @classmethod
    def needs_universal(cls, saved, now):
        """DeepSpeed on another world size: the checkpoint's ZeRO state goes through the universal checkpoint."""
        return saved["world_size"] != now["world_size"]
