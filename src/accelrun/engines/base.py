"""Engine: what every way of running shares, the defaults each engine overrides, and Engine.of, the one place that
reads which one accelerate set up.

Owns, for every engine alike:
  * Engine.of(accelerator): the engine of this accelerator, decided once (the same object on every later ask);
  * the facts and label: the distributed type, world size, precision, ZeRO stage and offload that run (the first log
    line, the summary, the default output directory runs/<recipe>/<label>);
  * sequence parallelism as a property of the engine: its size (accelerate's parallelism_config with DeepSpeed's
    Ulysses backend; 1 without it), and the data-parallel readers, the processes that read different data
    (processes / the size): the batch rule (refusals.check_batch) and finetune/ulysses.py ask it here;
  * the layout a checkpoint records (the family, ZeRO stage, world size, accumulation steps, sequence-parallel size)
    and, for a layout read back, the engine class that wrote it (of_layout);
  * the exported weights: gathered from the shards, in fp32 on the CPU, under the model's own names
    (uncompiled_name), from every engine alike;
  * the defaults of what an engine adjusts (clipping, gradient reduction, buffers), builds (the model sharded),
    checks (the launch, the flags) and writes (its checkpoint format: files, frozen weights, a world-size change).
"""

import contextlib
import os
import weakref

import torch
from accelerate.utils import DistributedType

from .. import float8
from ..sharded_model import BUILT_WHOLE

_DECIDED = weakref.WeakKeyDictionary()  # accelerator -> its engine: asked once, the same object after


def uncompiled_name(key):
    """A state dict key under the model's own name: torch.compile (a *_compile.yaml) puts _orig_mod. in every key."""
    return key.replace("_orig_mod.", "")


def numbered(name, index, suffix=""):
    """accelerate's names for the index-th model, optimizer or scheduler: name.bin, name_1.bin..."""
    return f"{name}{'' if index == 0 else f'_{index}'}{suffix}"


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


class Engine:
    """One way of running. Class attributes say what it is; an instance holds the accelerator and answers for it."""

    kinds = ()  # every engine class, in the order the launch checks ask them (set in engines/__init__.py)
    accelerate_type = None  # the DistributedType it runs (None: every type no other engine claims)
    family = None  # what a checkpoint's layout records for it
    launch_env = None  # the variable accelerate launch sets to "true" for a config of it
    world_size_change = {}  # {kind of checkpoint: how its state reaches another number of processes}
    keeps_rank_buffers = False  # each rank's buffers saved beside the checkpoint (resharding.save_rank_buffers)
    optimizer_in_backward = False  # the optimizer steps inside backward() (the timing's split)
    autocasts = True  # accelerate's autocast runs the forward pass in the mixed precision
    shards_4bit_base = False  # a 4-bit base left whole on a rank of several is a mistake (finetune/qlora.py)
    casts_buffers = False  # computes with half-precision weights and would leave the buffers in fp32

    def __init__(self, accelerator):
        self.accelerator = accelerator
        # the DistributedType itself, for the lines that name it (None for a stand-in: formats.fingerprint's probe)
        self.running = getattr(accelerator, "distributed_type", None)

    @classmethod
    def of(cls, accelerator):
        """The engine accelerate set up, decided once per accelerator (an object that cannot be remembered, such
        as a test's namespace, is decided at each ask)."""
        with contextlib.suppress(KeyError, TypeError):
            return _DECIDED[accelerator]
        default = next(kind for kind in Engine.kinds if kind.accelerate_type is None)
        kind = next((k for k in Engine.kinds if k.accelerate_type == accelerator.distributed_type), default)
        engine = kind(accelerator)
        with contextlib.suppress(TypeError):
            _DECIDED[accelerator] = engine
        return engine

    @staticmethod
    def of_layout(layout):
        """The engine class that writes a layout's family (one Engine.layout writes, or one a manifest's check
        accepted); None for a family no engine writes."""
        family = layout["family"] if isinstance(layout, dict) else None
        return next((kind for kind in Engine.kinds if kind.family == family), None)

    @classmethod
    def asked_by(cls, environ=os.environ):
        """Whether the launch's config asks for this engine (accelerate launch sets launch_env from it)."""
        return cls.launch_env is not None and environ.get(cls.launch_env, "false").lower() == "true"

    def asked_otherwise(self, environ=os.environ):
        """The engine class the launch's config asks for where accelerate set up another (this one), or None."""
        return next((kind for kind in Engine.kinds if kind.asked_by(environ) and not isinstance(self, kind)), None)

    @property
    def in_process_group(self):
        """Whether accelerate set up a process group (its distributed type is not NO)."""
        return self.running != DistributedType.NO

    # ---- facts, label, sequence parallelism ------------------------------------------------------------------
    stage = None  # DeepSpeed's ZeRO stage; None for the others
    offloads_optimizer = False  # DeepSpeed's optimizer offload
    partitions_parameters = False  # ZeRO-3: each parameter partitioned, gathered layer by layer in every pass

    @property
    def sequence_parallel(self):
        """Processes that share one sequence under DeepSpeed's Ulysses sequence parallelism (accelerate's
        parallelism_config: sp_size, sp_backend deepspeed); 1 without it. They read the same data."""
        config = getattr(self.accelerator, "parallelism_config", None)
        return config.sp_size if config is not None and config.sp_backend == "deepspeed" and config.sp_size > 1 else 1

    @property
    def readers(self):
        """The processes that read different data: every process, or under sequence parallelism each group of them
        (processes / the sequence-parallel size)."""
        return self.accelerator.num_processes // self.sequence_parallel

    @property
    def sequence_parallel_attention(self):
        """The attention implementation the config names for Ulysses to wrap (sdpa without one)."""
        handler = getattr(getattr(self.accelerator, "parallelism_config", None), "sp_handler", None)
        return getattr(handler, "sp_attn_implementation", None) or "sdpa"

    @staticmethod
    def launched_sequence_parallel(environ=os.environ):
        """The sequence-parallel size the launch asks for, before Accelerator(): from the environment accelerate launch
        sets from the config's parallelism_config (what Accelerator() will read); 1 without it, as sequence_parallel."""
        if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
            return 1
        if environ.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed") != "deepspeed":
            return 1
        try:
            return max(1, int(environ.get("PARALLELISM_CONFIG_SP_SIZE", "1")))
        except ValueError:
            return 1  # not a number: Accelerator() says so in its own words

    def facts(self):
        """What accelerate really set up, for the first log line, the summary and checkpoint layouts."""
        acc = self.accelerator
        return {"distributed_type": self.running.value, "world_size": acc.num_processes,
                "mixed_precision": acc.mixed_precision, "deepspeed_stage": self.stage,
                "offload_optimizer": self.offloads_optimizer, "sequence_parallel": self.sequence_parallel}

    def label_name(self):
        """The engine's part of the label ("" for one process)."""
        return ""

    @property
    def compiles(self):
        """Whether the config compiles the model (accelerate's dynamo_config: *_compile.yaml, fsdp_fp8.yaml)."""
        dynamo = self.accelerator.state.dynamo_plugin
        return dynamo is not None and dynamo.backend.value != "NO"

    def label(self):
        """A short name for the way this run is launched, e.g. 'ddp-2proc-bf16' or 'zero3-offload-2proc': the default
        output directory is runs/<recipe>/<label>, so swapping configs keeps each one's results, and the same command
        finds its own directory again."""
        e = self.facts()
        parts = [self.label_name(), "offload" if e["offload_optimizer"] else "", f"sp{e['sequence_parallel']}" if
                 e["sequence_parallel"] > 1 else "", f"{e['world_size']}proc",
                 "" if e["mixed_precision"] == "no" else e["mixed_precision"]]
        if self.compiles:
            parts.append("compile")
        return "-".join(p for p in parts if p)

    def layout(self):
        """What decides whether a checkpoint's files can be read back by this run, and how it split the batch (the
        accelerator's accumulation steps, after prepare(): the flag's, which a DeepSpeed config may not change); the
        sequence-parallel size where it is above 1, which a resume must share (checkpoint/rules.py)."""
        acc, sp = self.accelerator, self.sequence_parallel
        return {"family": self.family, "zero_stage": self.stage, "world_size": acc.num_processes,
                "grad_accum": acc.gradient_accumulation_steps, **({"sequence_parallel": sp} if sp > 1 else {})}

    # ---- adjustments that make every engine run the recipe's optimisation (defaults: nothing to adjust) -------
    def clip_like(self, max_grad_norm):
        """Call before prepare(): an engine that clips by itself is made to clip like the recipe's flag."""

    def reduce_in_fp32(self):
        """Call before prepare(): gradients summed across processes in fp32, as DDP sums them."""

    def flags_problem(self, grad_accum, max_grad_norm, prepared):
        """None, or why the engine's own config contradicts the flags that decide accumulation and clipping."""
        return None

    def cast_buffers(self, model):
        """After prepare(): BatchNorm refuses running statistics of another dtype than its weights, so an engine that
        computes with half-precision weights but leaves buffers in fp32 has them cast (casts_buffers)."""
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.accelerator.mixed_precision)
        if half and self.casts_buffers:
            for buffer in model.buffers():
                if buffer.is_floating_point():
                    buffer.data = buffer.data.to(half)

    def gradient_sync(self, model):
        """After prepare(): the dtype gradients are summed across processes in, and (DeepSpeed) whether that overlaps
        with the backward pass, read from the engine that runs, for the summary."""
        if self.accelerator.num_processes == 1:
            return {"grad_reduce_dtype": None, "overlap_comm": None}
        return self.reduction(model)

    def reduction(self, model):
        """gradient_sync's answer with several processes: the parameters' own dtype."""
        return {"grad_reduce_dtype": dtype_name(next(model.parameters()).dtype), "overlap_comm": None}

    # ---- the optimizer's states (--optim-states: finetune/optim_states.py) -------------------------------------
    def optimizer_states_problem(self, kind):
        """None, or why this engine cannot keep AdamW's moments in `kind` (bf16, 8bit) through the recipe's
        optimizer (one line naming what to use)."""
        return None

    def optimizer_problem(self, optimizer):
        """None, or why this engine cannot step `optimizer` (one line naming why)."""
        return None

    # ---- float8 (mixed_precision fp8: float8.py) --------------------------------------------------------------
    def float8_problem(self, compiled):
        """None, or why this way of running does not compute in float8 (one line naming what to use); compiled:
        whether the config compiles the model."""
        return None

    # ---- the model built, the weights exported ---------------------------------------------------------------
    def prepare_frozen(self, model):
        """A frozen model that only runs forward passes beside the trained one (DPO's reference), placed as this engine
        holds a model, outside accelerator.prepare() (which would save it in every checkpoint and, under DeepSpeed, tie
        the backward to it): here whole on the device."""
        return model.to(self.accelerator.device)

    @contextlib.contextmanager
    def building(self, from_pretrained=False, quantized=False):
        """Build the model inside; yields how it is built (the summary's model_init, sharded_model.py's words).
        from_pretrained: a Hugging Face model loaded inside; quantized: loaded quantised."""
        yield BUILT_WHOLE

    def check_whole_model_fits(self, n_params):
        """Collective: before a pretrained model of n_params parameters loads, stop where the engine would load it
        whole on every process and they cannot hold it."""

    def export(self, model, exclude=()):
        """Collective: the weights to export, on the main process (None elsewhere): ZeRO-3 / FSDP shards gathered,
        every floating-point tensor in fp32 on the CPU, under the model's own names, without the keys in `exclude`."""
        acc = self.accelerator
        state_dict = acc.get_state_dict(model)
        self.with_fp32_masters(state_dict, model)
        if not acc.is_main_process:
            return None
        named = ((uncompiled_name(k), float8.plain(v)) for k, v in state_dict.items())
        return {k: (v.float() if v.is_floating_point() else v).contiguous().cpu() for k, v in named if k not in exclude}

    def with_fp32_masters(self, state_dict, model):
        """Collective where the engine keeps fp32 masters apart from the weights it computes with: put them in."""

    # ---- the checkpoint format and the rules of resuming it ----------------------------------------------------
    @classmethod
    def writes_stage(cls, stage):
        """Whether a layout of this family may record ZeRO stage `stage` (None: no ZeRO)."""
        return stage is None

    # The kinds of file list a save of this engine may have, for formats.fingerprint (FSDP2: full or sharded state).
    sample_listings = ((),)

    @classmethod
    def older_format_problem(cls, version, manifest):
        """None, or why a checkpoint of this engine in an older, still readable format `version` is not one this
        code loads: what this engine's saves hold changed while that version was current."""
        return None

    @classmethod
    def engine_files(cls, layout, models, optimizers, files):
        """(needed, optional): the patterns of the engine's own files in a save of `layout` (each needed one names
        exactly one listed file; an optional one a listed file may also match); files: the listed ones."""
        raise NotImplementedError

    def model_keys(self, held):
        """(the model file's name, the keys it holds) of a held checkpoint, or (None, None) where they are not read."""
        return None, None

    def frozen_kwargs(self, frozen):
        """(save_state kwargs, load_state kwargs, the frozen names a checkpoint's model file must not hold) for a
        model whose parameters `frozen` do not train."""
        raise NotImplementedError

    @classmethod
    def kind(cls, layout):
        """The world_size_change key of a layout of this family."""
        return cls.family

    @classmethod
    def needs_universal(cls, saved, now):
        """Whether a checkpoint of layout `saved` goes through DeepSpeed's universal checkpoint for a run of `now`."""
        return False


def run_label(accelerator):
    """Engine.label() of the engine accelerate set up (a recipe names its own output directory with it)."""
    return Engine.of(accelerator).label()


def exported_weights(accelerator, model, exclude=()):
    """Collective: Engine.export() of the engine accelerate set up."""
    return Engine.of(accelerator).export(model, exclude)
