#!/usr/bin/env python3
"""Check an accelerate config before any process starts: a mistake costs seconds here, not a queue wait.

    python launch/check_config.py accelerate_configs/deepspeed_zero3.yaml
    python launch/check_config.py my_zero2.yaml --recipe recipes/resnet.py   # also: does it suit this recipe?

First accelerate's own loader reads the file (unknown keys, a wrong distributed_type, a bad
value). Then, for DeepSpeed, the traps that otherwise show up only after the job has started, or
never (accelerate 1.15, DeepSpeed 0.19):
  * "auto" sizes that accelerate fills from model.config.hidden_size: the recipes' models are plain
    nn.Modules without a config, so prepare() fails;
  * an optimizer or scheduler block in a DeepSpeed JSON: it needs DummyOptim/DummyScheduler in the
    script, and prepare() refuses the torch optimizer and scheduler the recipes build;
  * optimizer offload with a torch optimizer: accelerate silently replaces ANY torch optimizer by
    DeepSpeedCPUAdam, SGD too (with --recipe the recipe's optimizer is read from its source);
  * stage-3 options on stage 1 or 2: DeepSpeed ignores them without a word;
  * mixed precision in the YAML next to a DeepSpeed JSON (accelerate refuses it at start-up, and
    the error names both values when they disagree); with a JSON only the JSON decides;
  * YAML DeepSpeed keys next to deepspeed_config_file: accelerate refuses the mix at start-up;
  * (a warning) top-level keys accelerate launch never applies, because their command-line
    options have defaults that win (rdzv_backend, same_network, ...).
And for FSDP's mesh (parallelism_config: HSDP's dp_replicate_size x dp_shard_size, hsdp.yaml):
  * a product of the sizes that is not the number of processes, named in one line (accelerate refuses it only
    once every process has started);
  * dp_replicate_size above 1 with dp_shard_size 1: FSDP has nothing to shard over (accelerate refuses it too).
And for float8 (mixed_precision fp8, fsdp_fp8.yaml):
  * torchao missing, or a backend other than torchao's (AO): Transformer Engine and MS-AMP are not what accelrun
    installs or tests;
  * the ways of running that refuse it, in their engine's words (DeepSpeed; torch.compile under DDP);
  * fsdp_cpu_ram_efficient_loading true under FSDP: accelerate refuses it with torchao's float8 at start-up.
Exit 0 when the config is usable (notes are printed), 2 with one line per problem otherwise.
launch/slurm_launch.py runs this check in every task before it launches anything.
"""

import argparse
import importlib.util
import json
import math
import os
import re
import sys

import yaml

HIDDEN_SIZE_KEYS = {  # accelerate fills these from model.config.hidden_size when they are "auto"
    "reduce_bucket_size": "5e8 (DeepSpeed's default)",
    "stage3_prefetch_bucket_size": "5e7",
    "stage3_param_persistence_threshold": "1e5",
}
STAGE3_YAML_KEYS = {"offload_param_device": ("none", None), "zero3_init_flag": (False, None),
                    "zero3_save_16bit_model": (False, None)}
# accelerate's own list (DeepSpeedPlugin._deepspeed_config_checks); zero3_init_flag is accelerate's, not DeepSpeed's,
# and stays in the YAML.
FILE_EXCLUSIVE_YAML_KEYS = ("zero_stage", "offload_optimizer_device", "offload_param_device",
                            "gradient_accumulation_steps", "gradient_clipping", "zero3_save_16bit_model",
                            "offload_optimizer_nvme_path", "offload_param_nvme_path")

# FSDP's mesh in an accelerate YAML (accelerate >= 1.10): the sizes whose product is the number of processes.
DP_REPLICATE, DP_SHARD = "parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size"
MESH_SIZES = (DP_REPLICATE, DP_SHARD, "parallelism_config_tp_size", "parallelism_config_cp_size")


class Problems:
    def __init__(self, config):
        self.config, self.errors, self.notes = config, [], []

    def error(self, key, problem, fix):
        self.errors.append(f"{self.config}: {key}: {problem}. Fix: {fix}")

    def note(self, text):
        self.notes.append(f"{self.config}: note: {text}")

    def warn(self, key, problem, fix):
        self.notes.append(f"warning: {self.config}: {key}: {problem}. Fix: {fix}")


def load_with_accelerate(path, problems):
    """accelerate's own loader: the same errors `accelerate launch` would give, before anything starts."""
    from accelerate.commands.config.config_args import load_config_from_file
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as exc:
        problems.error("file", f"cannot be read ({exc.strerror})",
                       "give the path of a YAML file in accelerate_configs/")
        return None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
        problems.error("YAML", f"not valid YAML{line}: {getattr(exc, 'problem', exc)}",
                       "correct the indentation or quoting there")
        return None
    if not isinstance(raw, dict) or "distributed_type" not in raw:
        problems.error("distributed_type", "missing: this is not an accelerate config",
                       "start from a file in accelerate_configs/")
        return None
    try:
        load_config_from_file(path)
    except Exception as exc:  # accelerate raises ValueError/TypeError/KeyError with its own text
        message = " ".join(str(exc).split())
        problems.error("accelerate", f"accelerate's loader rejects it ({type(exc).__name__}: {message})",
                       "remove or correct the key it names; `accelerate config` writes a valid file")
        return None
    return raw


def check_ignored_keys(raw, problems):
    """Top-level keys accelerate launch never applies: it copies one from the YAML only when its command-line
    option is still None, and these options have defaults of their own (e.g. rdzv_backend, same_network)."""
    from accelerate.commands.launch import launch_command_parser
    defaults = {action.dest: action.default for action in launch_command_parser()._actions}
    for key, value in raw.items():
        if isinstance(value, dict) or key in ("compute_environment", "mixed_precision", "distributed_type"):
            continue  # nested sections and these three are applied by accelerate's own code
        if defaults.get(key) is not None:
            problems.warn(key, f"accelerate launch ignores it: the command-line option --{key} has its own default "
                               f"({defaults[key]!r}), which wins over the YAML", f"remove it, or pass --{key} "
                               f"on the command line")


def load_deepspeed_json(raw, config_path, problems):
    """The DeepSpeed JSON the YAML points to (deepspeed_config_file), or {}."""
    ds_yaml = raw.get("deepspeed_config") or {}
    name = ds_yaml.get("deepspeed_config_file")
    if not name or name == "none":
        return {}
    candidates = [name, os.path.join(os.path.dirname(config_path), name)]
    path = next((c for c in candidates if os.path.isfile(c)), None)
    if path is None:
        problems.error("deepspeed_config.deepspeed_config_file", f"{name!r} does not exist (looked in . and next to "
                       f"the YAML; accelerate resolves it from the directory you launch in)", "correct the path")
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        problems.error("deepspeed_config.deepspeed_config_file", f"{name} is not valid JSON ({exc})",
                       "correct the JSON; a trailing comma is the usual culprit")
        return None


def recipe_optimizers(recipe):
    """Names of the torch optimizers a recipe builds, read from its source."""
    with open(recipe) as f:
        return set(re.findall(r"torch\.optim\.(?!lr_scheduler)(\w+)\(", f.read()))


def enabled(section):
    value = section.get("enabled") if isinstance(section, dict) else None
    return None if value in (None, "auto") else str(value).lower() == "true"


def check_deepspeed(raw, ds_json, recipe, problems):
    """Every trap of a DeepSpeed config: the YAML and its JSON, each part checked in turn."""
    ds_yaml = raw.get("deepspeed_config") or {}
    zero = ds_json.get("zero_optimization", {}) if ds_json else {}
    if ds_json:
        check_yaml_beside_json(ds_yaml, problems)
    check_auto_sizes(zero, problems)
    if ds_json:
        check_optimizer_blocks(ds_json, problems)
    check_offload(zero, ds_yaml, ds_json, recipe, problems)
    stage = zero.get("stage", ds_yaml.get("zero_stage"))
    if isinstance(stage, int) and stage < 3:
        check_stage3_options(stage, ds_yaml, zero, problems)
    if ds_json:  # precision: with a DeepSpeed JSON, only the JSON decides
        check_precision(raw, ds_json, problems)


def check_yaml_beside_json(ds_yaml, problems):
    """Keys of the YAML that accelerate refuses next to a deepspeed_config_file."""
    mixed = [k for k in FILE_EXCLUSIVE_YAML_KEYS if k in ds_yaml]
    if mixed:
        problems.error(f"deepspeed_config.{mixed[0]}", "set in the YAML next to deepspeed_config_file; accelerate "
                       "refuses the mix when the job starts", f"move {', '.join(mixed)} into the JSON file")


def check_auto_sizes(zero, problems):
    """ZeRO sizes left "auto", which need a hidden_size the recipes' models lack."""
    for key, number in HIDDEN_SIZE_KEYS.items():
        if zero.get(key) == "auto":
            problems.error(f"zero_optimization.{key}", "is \"auto\", which accelerate computes from "
                           "model.config.hidden_size; the recipes' models are plain nn.Modules without one, so "
                           "prepare() fails", f"write a number, e.g. {number}")


def check_optimizer_blocks(ds_json, problems):
    """An optimizer or scheduler block, which replaces the recipe's torch optimizer or scheduler."""
    for block, dummy in (("optimizer", "DummyOptim"), ("scheduler", "DummyScheduler")):
        if block in ds_json:
            problems.error(block, f"a DeepSpeed {block} block makes accelerate expect accelerate.utils.{dummy} in "
                           f"the script; the recipes build a torch {block}, and prepare() refuses it",
                           f"delete the \"{block}\" block; the recipe's flags (--lr, ...) set the {block}")


def check_offload(zero, ds_yaml, ds_json, recipe, problems):
    """Optimizer offload, which swaps the recipe's torch optimizer for DeepSpeedCPUAdam."""
    offload = zero.get("offload_optimizer", {}).get("device") if zero else ds_yaml.get("offload_optimizer_device")
    if offload in (None, "none") or (ds_json or {}).get("zero_force_ds_cpu_optimizer", True) is False:
        return
    optimizers = recipe_optimizers(recipe) if recipe else set()
    foreign = sorted(optimizers - {"Adam", "AdamW"})
    if foreign:
        problems.error("offload_optimizer_device" if not zero else "zero_optimization.offload_optimizer",
                       f"optimizer offload ({offload}) makes accelerate replace {recipe}'s torch.optim."
                       f"{'/'.join(foreign)} by DeepSpeedCPUAdam, a different algorithm, without a word",
                       "use a config without optimizer offload (deepspeed_zero3.yaml), or set "
                       "\"zero_force_ds_cpu_optimizer\": false in a DeepSpeed JSON to keep the torch optimizer")
    else:
        problems.note(f"optimizer offload ({offload}): accelerate replaces the recipe's torch optimizer by "
                      f"DeepSpeedCPUAdam (the AdamW update, on the CPU); recipes built on SGD refuse it")


def check_stage3_options(stage, ds_yaml, zero, problems):
    """ZeRO-3 options under stage 1 or 2, which DeepSpeed ignores silently."""
    for key, unset in STAGE3_YAML_KEYS.items():
        if ds_yaml.get(key, None) not in unset:
            problems.error(f"deepspeed_config.{key}", f"is a ZeRO-3 option, and zero_stage is {stage}: "
                           f"DeepSpeed ignores it silently", "remove it, or set zero_stage: 3")
    for key in sorted(zero):
        if key.startswith("stage3_") or (key == "offload_param" and zero[key].get("device", "none") != "none"):
            problems.error(f"zero_optimization.{key}", f"is a ZeRO-3 option, and the stage is {stage}: DeepSpeed "
                           "ignores it silently", "remove it, or set \"stage\": 3")


def check_precision(raw, ds_json, problems):
    """mixed_precision in the YAML next to a DeepSpeed JSON, and where the precision comes from."""
    states = {dtype: enabled(ds_json.get(dtype)) for dtype in ("fp16", "bf16")}
    json_says = next((dtype for dtype, state in states.items() if state), "no")
    if "mixed_precision" in raw:
        yaml_says = raw["mixed_precision"] or "no"
        consistent = yaml_says == json_says and not (yaml_says != "no" and states.get(yaml_says) is False)
        problems.error("mixed_precision", (f"the YAML says {yaml_says} but the DeepSpeed JSON says {json_says} "
                       f"(fp16.enabled={states['fp16']}, bf16.enabled={states['bf16']})" if not consistent else
                       "set in the YAML next to deepspeed_config_file") + "; accelerate refuses "
                       "mixed_precision in the YAML next to a DeepSpeed JSON when the job starts",
                       "remove mixed_precision from the YAML and set \"bf16\" or \"fp16\" {\"enabled\": true} "
                       "in the JSON")
    if any(state is not None for state in states.values()):
        problems.note(f"precision comes from the DeepSpeed JSON ({json_says}); "
                      "`accelerate launch --mixed_precision` "
                      f"does not override it (fp16 against a bf16 JSON is an error; accelerate 1.15)")


def is_hsdp(raw):
    """Whether a config is HSDP: FSDP with a parallelism_config that names dp_replicate_size (the copies of the model;
    launch/slurm_launch.py fills it and dp_shard_size from Slurm)."""
    section = raw.get("parallelism_config") if isinstance(raw, dict) else None
    return raw.get("distributed_type") == "FSDP" and isinstance(section, dict) and DP_REPLICATE in section


def check_mesh(raw, problems, processes=None, filled=False):
    """FSDP's mesh: whole sizes, a copy of the model sharded over at least 2 processes where it is replicated, and
    (unless slurm_launch fills the two data-parallel sizes: filled) a product equal to the number of processes, the
    launch's (processes) or the YAML's num_processes."""
    section = raw.get("parallelism_config")
    if raw.get("distributed_type") != "FSDP" or not isinstance(section, dict) or not set(MESH_SIZES) & set(section):
        return
    sizes = {key: section.get(key, 1) for key in MESH_SIZES}
    wrong = [key for key, value in sizes.items() if not (isinstance(value, int) and value >= 1)]
    if wrong:
        problems.error(f"parallelism_config.{wrong[0]}", f"{sizes[wrong[0]]!r} is not a number of processes",
                       "write a whole number, 1 or more")
        return
    replicate, shard = sizes[DP_REPLICATE], sizes[DP_SHARD]
    if not filled and replicate > 1 and shard == 1 and math.prod(sizes.values()) == replicate:
        problems.error(f"parallelism_config.{DP_SHARD}", f"is 1 with dp_replicate_size {replicate}: FSDP has nothing "
                       f"to shard over (accelerate refuses it when the job starts)", "give dp_shard_size the "
                       "processes of one node (2 or more), or for a whole copy on every process use DDP "
                       "(2gpu.yaml, multinode.yaml)")
    processes = processes or raw.get("num_processes")
    if filled or not isinstance(processes, int) or math.prod(sizes.values()) == processes:
        return
    named = " x ".join(f"{key.removeprefix('parallelism_config_')} {sizes[key]}" for key in MESH_SIZES
                       if key in section)
    problems.error("parallelism_config", f"{named} = {math.prod(sizes.values())} processes, but the launch starts "
                   f"{processes} (num_processes); accelerate refuses the mismatch once every process has started",
                   "make the product the number of processes (under Slurm launch/slurm_launch.py sets "
                   "dp_replicate_size to the nodes and dp_shard_size to the processes per node)")


def check_float8(raw, problems, processes=None):
    """mixed_precision fp8: torchao's backend, and a way of running that computes in float8 (its engine decides)."""
    if raw.get("mixed_precision") != "fp8":
        return
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from accelrun import float8
    from accelrun.engines import Engine
    if importlib.util.find_spec("torchao") is None:
        problems.error("mixed_precision", "fp8 needs torchao, which is not installed (accelerate launch ends in a "
                       "traceback)", "pip install -r requirements.txt")

    def section(key):  # a section of the YAML, {} where it is missing or not a mapping
        value = raw.get(key)
        return value if isinstance(value, dict) else {}

    backend = section("fp8_config").get("backend", float8.BACKEND)
    if problem := float8.backend_problem(backend):
        problems.error("fp8_config.backend", f"{backend}: {problem}", float8.BACKEND_FIX)
    try:
        running = DistributedType(raw.get("distributed_type"))
    except ValueError:
        return  # accelerate's loader has named it
    processes = processes or raw.get("num_processes")
    if not isinstance(processes, int):  # none given (or no number: accelerate's loader says so): one without DDP
        processes = 1 if running == DistributedType.NO else 2
    engine = Engine.of(SimpleNamespace(distributed_type=running, num_processes=processes))
    compiled = str(section("dynamo_config").get("dynamo_backend", "NO")).upper() != "NO"
    if problem := engine.float8_problem(compiled):
        problems.error("mixed_precision", problem.removeprefix("mixed precision fp8 "), "see docs/configs.md, "
                       "'FP8 on H100s'")
    if running == DistributedType.FSDP and section("fsdp_config").get("fsdp_cpu_ram_efficient_loading"):
        problems.error("fsdp_config.fsdp_cpu_ram_efficient_loading", "true with mixed_precision fp8: accelerate "
                       "refuses torchao's float8 with it when the job starts", "set it to false (fsdp_fp8.yaml)")


def check(config, recipe=None, processes=None, filled=False):
    """(errors, notes) for `config`, optionally for use with `recipe`; processes: the number the launch starts
    (default: the YAML's num_processes); filled: launch/slurm_launch.py gives HSDP's two sizes itself."""
    problems = Problems(config)
    if not os.path.isfile(config):
        problems.error("file", "does not exist", "give the path of a YAML file in accelerate_configs/")
        return problems.errors, problems.notes
    raw = load_with_accelerate(config, problems)
    if raw is not None:
        check_ignored_keys(raw, problems)
        check_mesh(raw, problems, processes, filled and is_hsdp(raw))
        check_float8(raw, problems, processes)
    from accelrun.engines import DeepSpeed  # which distributed type is DeepSpeed's: its engine says (accelrun.engines)
    if raw is not None and raw.get("distributed_type") == DeepSpeed.accelerate_type.value:
        ds_json = load_deepspeed_json(raw, config, problems)
        if ds_json is not None:
            check_deepspeed(raw, ds_json, recipe, problems)
    return problems.errors, problems.notes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", help="an accelerate YAML config")
    p.add_argument("--recipe", help="the recipe it will run (checks offload against the recipe's optimizer)")
    p.add_argument("--num-processes", type=int, default=None,
                   help="the processes the launch starts, all nodes together (default: the config's num_processes); "
                        "checked against the product of parallelism_config's sizes")
    args = p.parse_args(argv)
    if args.recipe and not os.path.isfile(args.recipe):
        p.error(f"recipe {args.recipe!r} does not exist")
    errors, notes = check(args.config, args.recipe, args.num_processes)
    for line in notes:
        print(line)
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    if not errors:
        print(f"{args.config}: ok")
    return 2 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
