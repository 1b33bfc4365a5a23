"""The checkpoint side of the engines: which engine's format a layout names, the files a save of it writes, and what
a save keeps of a model with frozen parameters (LoRA).

Each engine (engines/) owns its own format: the ZeRO stage a layout of its family records (writes_stage), its own
files in a save (engine_files), how its model file's keys read back through the held descriptor (model_keys), and
what its saves leave out of a model with frozen parameters (frozen_kwargs). This module owns what is common to them:
* the catalogue (FORMATS, of): a layout's family ("full", "deepspeed" or "fsdp", as Engine.layout records it) ->
  the engine class that writes it;
* the files a save of a layout writes, so that a manifest must list exactly those (expected_files, files_problem):
  the engine's own, each rank's RNG state and done marker, the schedulers;
* LoRA's frozen-weights rule (FrozenRule): frozen parameters are loaded again from the model the run starts from,
  which the resume rules pin, so a save leaves them out (the engine's frozen_kwargs says how), the load is then not
  strict, and a checkpoint's model file must hold exactly what trains: the adapters, no frozen weight.
A new engine is one more Engine class (docs/writing-a-recipe.md, "Adding a way of running"), nothing here. What a
save of each format writes and keeps, as plain data: fingerprint (tests/test_format_version.py holds it to the format
version).
"""

import re

from ..engines import Engine
from ..engines.base import numbered, uncompiled_name
from .layout import MANIFEST, done_marker

# A layout's family -> the engine class whose format it is (its class methods: writes_stage, engine_files, kind).
FORMATS = {kind.family: kind for kind in Engine.kinds}


def of(layout):
    """The engine class of a layout's family (one Engine.layout writes, or one manifest.read_manifest accepted)."""
    return FORMATS[layout["family"]]


def expected_files(layout, models=1, optimizers=1, schedulers=1, files=()):
    """(needed, optional) for a checkpoint of this layout and run (how many models, optimizers and schedulers it
    prepared): needed, the patterns of which each must name exactly one listed file; optional, those a listed file
    may also match (DeepSpeed's own extras). files: the listed ones (FSDP's full or sharded state dict)."""
    world = layout["world_size"]
    needed = [re.escape(f"random_states_{r}.pkl") for r in range(world)]
    needed += [re.escape(done_marker(r)) for r in range(world)]
    needed += [re.escape(numbered("scheduler", i, ".bin")) for i in range(schedulers)]
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
_SAMPLES = [(kind.family, stage, listed) for kind in Engine.kinds for stage in (None, 0, 1, 2, 3)
            if kind.writes_stage(stage) for listed in kind.sample_listings]


class _Probe:
    """An accelerator as an engine's frozen_kwargs sees it, recording what the engine asks of it."""

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
        save, load, checked = FORMATS[family](probe).frozen_kwargs({"base.weight"})
        frozen = {"save": save, "load": load, "save_hooks": probe.hooks, "model_file_checked": bool(checked),
                  "save_and_load_replaced": [probe.save_state != probe._state, probe.load_state != probe._state]}
        kind = f"{family}{'' if stage is None else f'-zero{stage}'}{'-sharded' if listed else ''}"
        found[kind] = {"needed": needed, "optional": optional, "frozen": frozen}
    return found


class FrozenRule:
    """LoRA's frozen-weights rule for one run: what its saves leave out and its loads allow (save_kwargs,
    load_kwargs), and whether a checkpoint's model file holds exactly what this run trains (model_file_problem)."""

    def __init__(self, engine, model):
        """engine: the run's (engines.Engine.of), whose checkpoint format this is; model: the prepared model."""
        plain = engine.accelerator.unwrap_model(model, keep_torch_compile=False)
        frozen = {name for name, p in plain.named_parameters() if not p.requires_grad}
        self.format, self.saved_keys = engine, set(plain.state_dict()) - frozen
        self.save_kwargs, self.load_kwargs, self.frozen = engine.frozen_kwargs(frozen) if frozen else ({}, {}, set())

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
