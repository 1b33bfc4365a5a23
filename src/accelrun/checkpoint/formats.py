"""One object per engine's checkpoint format: what a save under each engine writes, and what it keeps of a model
with frozen parameters (LoRA).

Owns the engine knowledge of the checkpoint code, which the family a layout records (rules.layout: "full" for one
process and DDP, "deepspeed" for ZeRO 0-3, "fsdp" for FSDP2, sharded or full state dict) picks (of):
* the ZeRO stage a layout of the family records (writes_stage);
* the files a save of a layout writes, so that a manifest must list exactly those (expected_files, files_problem):
  the model, the optimizer, each rank's RNG state and done marker, FSDP's per-rank buffers, DeepSpeed's extras;
* how the keys of a checkpoint's model file read back, through the held descriptor (model_keys);
* LoRA's frozen-weights rule (FrozenRule): frozen parameters are loaded again from the model the run starts from,
  which the resume rules pin, so a save leaves them out (the model file without DeepSpeed or FSDP: a save hook;
  DeepSpeed's module files: exclude_frozen_parameters; FSDP2: accelerate's own adapter_only save and load of a PEFT
  model, which its save_state does not ask for: adapters_only), the load is then not strict, and a checkpoint's
  model file must hold exactly what trains: the adapters, no frozen weight.
A new engine is one more Format here. What a save of each format writes and keeps, as plain data: fingerprint
(tests/test_format_version.py holds it to the format version).
"""

import json
import os
import re

from ..engines import uncompiled_name
from .layout import MANIFEST, done_marker
from .untrusted import whole


def _numbered(name, index, suffix=""):
    """accelerate's names for the index-th model, optimizer or scheduler: name.bin, name_1.bin..."""
    return f"{name}{'' if index == 0 else f'_{index}'}{suffix}"


class Format:
    """An engine's checkpoint format; `family` is what a layout records for it."""

    family = None

    def writes_stage(self, stage):
        """Whether a layout of this family may record ZeRO stage `stage` (None: no ZeRO)."""
        return stage is None

    def engine_files(self, layout, models, optimizers, files):
        """(needed, optional): the patterns of the engine's own files in a save of `layout` (each needed one names
        exactly one listed file; an optional one a listed file may also match); files: the listed ones."""
        raise NotImplementedError

    def model_keys(self, held):
        """(the model file's name, the keys it holds) of a held checkpoint, or (None, None) where they are not read."""
        return None, None

    def frozen_kwargs(self, accelerator, frozen):
        """(save_state kwargs, load_state kwargs, the frozen names a checkpoint's model file must not hold) for a
        model whose parameters `frozen` do not train."""
        raise NotImplementedError


class Full(Format):
    """1 process and DDP: accelerate's model.safetensors and optimizer.bin, the whole state."""

    family = "full"

    def engine_files(self, layout, models, optimizers, files):
        needed = [re.escape(_numbered("model", i, ".safetensors")) for i in range(models)]
        needed += [re.escape(_numbered("optimizer", i, ".bin")) for i in range(optimizers)]
        return needed, []

    def model_keys(self, held):
        """The safetensors header, read through the held descriptor (bounded: at most the file and 100 MB)."""
        rel = "model.safetensors"
        fd, size = held.held[rel].fileno(), held.files[rel]["size"]
        length = int.from_bytes(os.pread(fd, 8, 0), "little") if size >= 8 else -1
        if not 0 <= length <= min(size - 8, 100 << 20):
            return rel, ["<a header this code does not write>"]
        try:
            header = json.loads(os.pread(fd, length, 8))
        except (ValueError, RecursionError):
            return rel, ["<a header this code does not write>"]
        return rel, [k for k in header if k != "__metadata__"] if isinstance(header, dict) else ["<no table>"]

    def frozen_kwargs(self, accelerator, frozen):
        def trainable_only(models, weights, output_dir):  # accelerate calls it with each model's state dict
            for state in weights:  # named as in the model, or behind DDP's module. and compile's _orig_mod.
                for key in [k for k in state if uncompiled_name(k.removeprefix("module.")) in frozen]:
                    del state[key]
        accelerator.register_save_state_pre_hook(trainable_only)
        return {}, {"strict": False}, frozen


class DeepSpeed(Format):
    """DeepSpeed ZeRO 0-3: its module states (one file, or one per rank under ZeRO-3), its optimizer states per rank
    (ZeRO 1-3), and its own extras (the tag file, the recovery scripts)."""

    family = "deepspeed"

    def writes_stage(self, stage):
        return whole(stage, 0, 3)

    def engine_files(self, layout, models, optimizers, files):
        world, stage = layout["world_size"], layout["zero_stage"]
        needed, optional = [], ["latest", "zero_to_fp32\\.py", "zero_to_torch\\.py"]
        for i in range(models):
            tag = re.escape(_numbered("pytorch_model", i))
            if stage == 3:
                needed += [f"{tag}/zero_pp_rank_{r}_mp_rank_00_model_states\\.pt" for r in range(world)]
            else:
                needed.append(f"{tag}/mp_rank_00_model_states\\.pt")
            if stage:
                needed += [f"{tag}/(bf16_)?zero_pp_rank_{r}_mp_rank_00_optim_states\\.pt" for r in range(world)]
        return needed, optional

    def model_keys(self, held):
        """The module state's keys, loaded as weights only through the held descriptor (tensors memory-mapped)."""
        import torch

        from .safe_loading import weights_only_loading

        rel = next(r for r in sorted(held.held) if r.startswith("pytorch_model/") and r.endswith("_model_states.pt"))
        with weights_only_loading():
            states = torch.load(held.fd_path(rel), map_location="cpu", mmap=True)
        module = states.get("module") if isinstance(states, dict) else None
        return rel, list(module) if isinstance(module, dict) else ["<no module state>"]

    def frozen_kwargs(self, accelerator, frozen):
        return {"exclude_frozen_parameters": True}, {"load_module_strict": False}, frozen


class Fsdp(Format):
    """FSDP2: the shipped config's SHARDED_STATE_DICT (torch.distributed.checkpoint's folders, each rank writing its
    shards) or a FULL_STATE_DICT, which the listed files tell apart; and accelrun's per-rank buffers."""

    family = "fsdp"

    def engine_files(self, layout, models, optimizers, files):
        world = layout["world_size"]
        needed = [re.escape(f"rank-{r}.buffers.safetensors") for r in range(world)]
        if any(rel.startswith("pytorch_model_fsdp_0/") for rel in files):  # SHARDED_STATE_DICT
            folders = [f"pytorch_model_fsdp_{i}" for i in range(models)] + [f"optimizer_{i}" for i in range(optimizers)]
            for folder in folders:
                needed += [f"{folder}/\\.metadata"] + [f"{folder}/__{r}_0\\.distcp" for r in range(world)]
        else:  # FULL_STATE_DICT
            needed += [re.escape(_numbered("pytorch_model_fsdp", i, ".bin")) for i in range(models)]
            needed += [re.escape(_numbered("optimizer", i, ".bin")) for i in range(optimizers)]
        return needed, []

    def frozen_kwargs(self, accelerator, frozen):
        adapters_only(accelerator)
        return {}, {}, set()  # the model's folder is torch.distributed.checkpoint's: its keys are not read here


def adapters_only(accelerator):
    """FSDP2, a model with frozen parameters (PEFT's): this accelerator's save_state and load_state write and read the
    model's adapters only, sharded as they are (accelerate's save_fsdp_model and load_fsdp_model with adapter_only:
    PEFT's state dict of the model under SHARDED_STATE_DICT, the trainable part under FULL_STATE_DICT), where they
    took the whole model, frozen base included (a 4-bit one too); the optimizer and the rest as before. accelerate's
    save_state has no argument for it: the two functions it calls are given adapter_only while it runs."""
    import functools

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


FORMATS = {f.family: f for f in (Full(), DeepSpeed(), Fsdp())}


def of(layout):
    """The format of a layout's family (one rules.layout writes, or one manifest.read_manifest accepted)."""
    return FORMATS[layout["family"]]


def expected_files(layout, models=1, optimizers=1, schedulers=1, files=()):
    """(needed, optional) for a checkpoint of this layout and run (how many models, optimizers and schedulers it
    prepared): needed, the patterns of which each must name exactly one listed file; optional, those a listed file
    may also match (DeepSpeed's own extras). files: the listed ones (FSDP's full or sharded state dict)."""
    world = layout["world_size"]
    needed = [re.escape(f"random_states_{r}.pkl") for r in range(world)]
    needed += [re.escape(done_marker(r)) for r in range(world)]
    needed += [re.escape(_numbered("scheduler", i, ".bin")) for i in range(schedulers)]
    engine, optional = of(layout).engine_files(layout, models, optimizers, files)
    return needed + engine, optional


def files_problem(manifest, models=1, optimizers=1, schedulers=1):
    """None, or why the manifest's file table is not exactly what a save of its layout writes for a run with this
    many models, optimizers and schedulers: a file it needs to resume left out (the RNG state of a rank included),
    or one no save writes."""
    files, layout = manifest["files"], manifest["layout"]
    needed, optional = expected_files(layout, models, optimizers, schedulers, files)
    what = f"a {layout['family']} save of {layout['world_size']} process(es)"
    for pattern in needed:
        matches = [rel for rel in files if re.fullmatch(pattern, rel)]
        if len(matches) != 1:
            shown = pattern.replace("\\", "").replace("(bf16_)?", "")
            return f"{MANIFEST} does not list {shown}, which {what} writes and a resume reads"
    for rel in sorted(files):
        if not any(re.fullmatch(p, rel) for p in needed + optional):
            return f"{MANIFEST} lists {rel}, which no {what.removeprefix('a ')} writes"
    return None


# The layouts a format's fingerprint is taken over: every family, stage and state-dict kind, on 2 processes.
_SAMPLES = [("full", None, ()), ("fsdp", None, ()), ("fsdp", None, ("pytorch_model_fsdp_0/.metadata",))] + [
    ("deepspeed", stage, ()) for stage in range(4)]


class _Probe:
    """An accelerator as a format's frozen_kwargs sees it, recording what the format asks of it."""

    def __init__(self):
        self.hooks = 0
        self.save_state = self.load_state = self._state

    def _state(self, *args, **kwargs):
        return None

    def register_save_state_pre_hook(self, hook):
        self.hooks += 1


def fingerprint():
    """{family and sample layout: what a save of it writes, and what it keeps of a model with frozen parameters}: the
    file patterns a manifest must list (expected_files, on 2 processes) and LoRA's rule (frozen_kwargs: the save and
    load arguments, a save hook, accelerate's save_state and load_state replaced, the model file's keys checked).
    manifest.format_fingerprint adds the manifest's fields; tests/test_format_version.py holds it to FORMAT_VERSION."""
    found = {}
    for family, stage, listed in _SAMPLES:
        layout = {"family": family, "zero_stage": stage, "world_size": 2, "grad_accum": 1}
        needed, optional = expected_files(layout, files=listed)
        probe = _Probe()
        save, load, checked = FORMATS[family].frozen_kwargs(probe, {"base.weight"})
        frozen = {"save": save, "load": load, "save_hooks": probe.hooks, "model_file_checked": bool(checked),
                  "save_and_load_replaced": [probe.save_state != probe._state, probe.load_state != probe._state]}
        kind = f"{family}{'' if stage is None else f'-zero{stage}'}{'-sharded' if listed else ''}"
        found[kind] = {"needed": needed, "optional": optional, "frozen": frozen}
    return found


class FrozenRule:
    """LoRA's frozen-weights rule for one run: what its saves leave out and its loads allow (save_kwargs,
    load_kwargs), and whether a checkpoint's model file holds exactly what this run trains (model_file_problem)."""

    def __init__(self, accelerator, model, fmt):
        plain = accelerator.unwrap_model(model, keep_torch_compile=False)
        frozen = {name for name, p in plain.named_parameters() if not p.requires_grad}
        self.format, self.saved_keys = fmt, set(plain.state_dict()) - frozen
        self.save_kwargs, self.load_kwargs, self.frozen = (
            fmt.frozen_kwargs(accelerator, frozen) if frozen else ({}, {}, set()))

    def model_file_problem(self, held):
        """Main process, the model's trainable part only saved (the load is not strict): None, or why the held
        checkpoint's model file does not hold exactly what this run saves, the adapters and no frozen weight (a
        frozen weight in it would replace --model's, a missing adapter would stay new)."""
        rel, keys = self.format.model_keys(held)
        if rel is None:
            return None
        names = {uncompiled_name(k.removeprefix("module.")) for k in keys}
        frozen = sorted(names & self.frozen)
        if frozen:
            return f"{rel} holds {frozen[0]}, a weight of the frozen base model: a LoRA checkpoint holds only what " \
                   f"trains, the base comes from --model"
        missing, unknown = sorted(self.saved_keys - names), sorted(names - self.saved_keys)
        if missing:
            return f"{rel} lacks {missing[0]}, which this run trains: a LoRA checkpoint holds every adapter"
        return f"{rel} holds {unknown[0]}, which this model does not have" if unknown else None
