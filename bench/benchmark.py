"""Which config is fastest for my model on my machine, and what does it cost in memory?

    python bench/benchmark.py                                  # MNIST: DDP baselines + every multi-process config
    python bench/benchmark.py --repeats 3 --steps 300          # the table in docs/measuring.md
    python bench/benchmark.py --recipe gpt --preset tiny --configs 2gpu.yaml deepspeed_zero3.yaml
    python bench/benchmark.py --recipe resnet --recipe-args "--data-dir my_images --image-size 32"
    python bench/benchmark.py --recipe gpt --preset 124M --mixed-precision bf16 --configs 1gpu_compile.yaml
    python bench/benchmark.py --recipe finetune_lm --configs 1gpu.yaml --batch-size 8 \
        --recipe-args "--model my-llama --data-files chat.jsonl --block-size 1024"
    python bench/benchmark.py --recipe dpo --configs 1gpu.yaml --batch-size 8 \
        --recipe-args "--model my-llama --data-files prefs.jsonl --lora-r 16"   # DPO: --batch-size counts pairs
    python bench/benchmark.py --gpu-table                      # on a GPU: python gpu_check/gpu_table.py

Every run has the same global batch, seed, step count and precision (--mixed-precision, fp32 by
default, like the baselines). On a machine with GPUs every run uses all of them; without, it runs
2 processes over gloo through the CPU route (cpu_route/, docs/configs.md "On a CPU").
For the MNIST recipe the same report holds two hand-written DDP baselines (bench/ddp_baseline.py):
the course-style per-sample pipeline and the recipe's tensor pipeline.
For MNIST and GPT it also runs the lean-loop ceiling (bench/lean_loop.py): the recipe's model in a
minimal single-process loop with the same global batch, precision and compile setting, compared with
the recipe's 1-process run(s) in the list (a config with num_processes 1); when the list has none,
the benchmark adds one (1gpu_compile.yaml if a config of the list compiles, else 1gpu.yaml on a GPU
machine, cpu.yaml without GPU) so that the recipe / lean ratio is always there. --no-lean skips both.

Each run's own timer (src/accelrun/timing.py StepTimer, and the same code in the baseline) gives the
steady state after its first step: samples/s, the step split into data wait / forward+backward /
optimizer, and peak memory per process. The benchmark adds the start-up time (launch to end of the
first step) and the training time to --target-loss and --target-accuracy.

Writes OUT/results.json, OUT/results.md (the table and the ratios, with their goals) and
OUT/results.png; each run's log is in OUT/logs/. A run that fails is reported as failed, and the
benchmark then exits 1. It measures; it asserts nothing.
"""

import argparse
import json
import math
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "launch"))
from precision import deepspeed_json_in  # noqa: E402  (launch/: the one copy of a DeepSpeed JSON in a precision)

CONFIGS = REPO / "accelerate_configs"
CPU_SHIM = REPO / "cpu_route"
MULTI_PROCESS_CONFIGS = ["2gpu.yaml", "deepspeed_zero1.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml",
                         "deepspeed_zero3_offload.yaml", "fsdp.yaml"]
DEFAULT_TARGET_LOSS = {"mnist": 0.3, "gpt": 3.0, "resnet": 0.5, "finetune_lm": 1.0, "dpo": 0.5}
# Global; resnet below its recipe's 256, for CPUs; finetune_lm: the GPU table's fine-tune, 8 blocks of 1024; dpo: 8
# pairs (16 sequences).
DEFAULT_BATCH = {"mnist": 128, "gpt": 32, "resnet": 64, "finetune_lm": 8, "dpo": 8}
BASELINES = {"ddp-by-hand (per-sample ToTensor)": "per-sample", "ddp-by-hand (tensor pipeline)": "tensor"}
DDP = "2gpu.yaml"
# CONFIG+VARIANT in --configs: a shipped config with one change, for the comparisons of --gpu-table.
VARIANTS = {"deepspeed_zero2.yaml+no-overlap": "ZeRO-2 with overlap_comm false",
            "fsdp.yaml+one-unit": "FSDP with the whole model as one unit (fsdp_auto_wrap_policy NO_WRAP)",
            "fsdp_fp8.yaml+bf16": "fsdp_fp8.yaml launched with --mixed_precision bf16: no float8, the rest the same "
                                  "(regional compilation included), the float8 run's peer"}
LEAN = "lean loop"  # bench/lean_loop.py's rows: "lean loop", "lean loop (compiled)", "lean loop (CPU)" ...
# recipe throughput / lean-loop throughput: (goal, when it applies). GPU goals; on a CPU the ratio is shown, not judged.
LEAN_GOALS = {"mnist": (0.80, "MNIST at global batch 512, on a GPU"), "gpt": (0.90, "GPT-124M compiled, on a GPU")}
# Recipe flags that shape the model or its optimizer the same way in bench/lean_loop.py: forwarded from
# --recipe-args, with their number of values.
LEAN_SHARED_FLAGS = {"--block-size": 1, "--dropout": 1, "--no-batchnorm": 0, "--lr": 1, "--weight-decay": 1,
                     "--max-grad-norm": 1, "--peak-tflops": 1}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", choices=["mnist", "gpt", "resnet", "finetune_lm", "dpo"], default="mnist")
    p.add_argument("--configs", nargs="+", default=MULTI_PROCESS_CONFIGS, help="files in accelerate_configs/")
    p.add_argument("--no-baselines", action="store_true", help="MNIST only: skip the two hand-written DDP runs")
    p.add_argument("--no-lean", action="store_true",
                   help="MNIST, GPT: skip the lean-loop ceiling (bench/lean_loop.py) and the 1-process run it "
                        "adds when --configs has none")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    p.add_argument("--batch-size", type=int, default=0,
                   help="GLOBAL batch (0: mnist 128, gpt 32, resnet 64, finetune_lm 8, dpo 8 pairs)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--mixed-precision", choices=["no", "bf16", "fp16", "fp8"], default="no",
                   help="override every config's precision (the baselines are fp32); fp8 only for the configs "
                        "that are float8's (mixed_precision: fp8, as fsdp_fp8.yaml; its +bf16 variant runs bf16)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each, interleaved; the report takes medians")
    p.add_argument("--log-every", type=int, default=10, help="loss records per run, for the time to --target-loss")
    p.add_argument("--target-loss", type=float, default=None,
                   help="default: mnist 0.3, gpt 3.0, resnet 0.5, finetune_lm 1.0, dpo 0.5")
    p.add_argument("--target-accuracy", type=float, default=0.95, help="test accuracy (mnist, resnet), 0..1")
    p.add_argument("--train-size", type=int, default=20000, help="mnist: synthetic training digits")
    p.add_argument("--test-size", type=int, default=2000, help="mnist: synthetic test digits")
    p.add_argument("--preset", default="tiny", help="gpt: model preset")
    p.add_argument("--recipe-args", default="", help="extra arguments for every recipe run, one string")
    p.add_argument("--num-processes", type=int, default=0, help="0: every GPU here, or 2 CPU processes")
    p.add_argument("--data-dir", default="data", help="mnist: where MNIST or the synthetic digits live")
    p.add_argument("--out", default="bench/results", help="report folder")
    args = p.parse_args(argv)
    missing = [c for c in args.configs if not (CONFIGS / c.split("+")[0]).is_file()]
    if missing:
        p.error(f"no such config in accelerate_configs/: {', '.join(missing)}")
    wrong = [c for c in args.configs if "+" in c and c not in VARIANTS]
    if wrong:
        p.error(f"no such variant: {', '.join(wrong)} (there are {', '.join(VARIANTS)})")
    not_fp8 = [c for c in args.configs if args.mixed_precision == "fp8" and "+" not in c
               and load_config(c).get("mixed_precision") != "fp8"]
    if not_fp8:
        p.error(f"--mixed-precision fp8 is for float8's configs (mixed_precision: fp8, as fsdp_fp8.yaml); "
                f"not {', '.join(not_fp8)}")
    args.batch_size = args.batch_size or DEFAULT_BATCH[args.recipe]
    if args.steps < 3 or args.repeats < 1:
        p.error("--steps must be at least 3 (the first step is start-up) and --repeats at least 1")
    return args


def hardware():
    import torch
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    label = (f"{len(gpus)} x {gpus[0]}" if gpus else f"CPU only: {os.cpu_count()} cores of {cpu}")
    return {"label": label, "gpus": gpus, "cpu": cpu, "cores": os.cpu_count(), "host": socket.gethostname(),
            "torch": torch.__version__, "python": platform.python_version(),
            **{pkg: _version(pkg) for pkg in ("accelerate", "deepspeed")}}


def _version(package):
    try:
        from importlib.metadata import version
        return version(package)
    except Exception:
        return None


def load_config(config):
    """The YAML of a config of accelerate_configs/, a variant (CONFIG+VARIANT) read as its base config."""
    return yaml.safe_load(open(CONFIGS / config.split("+")[0]))


def variant_config(config, out_dir):
    """(config file, DeepSpeed JSON overrides) that run `config`: the shipped file, or for CONFIG+VARIANT
    (VARIANTS) a copy of it in out_dir with the variant's one change, or the JSON change to make."""
    base, _, variant = config.partition("+")
    if not variant or variant == "bf16":  # bf16: the shipped file, its precision set by config_launch
        return CONFIGS / base, {}
    if variant == "no-overlap":  # the ZeRO reduction after backward instead of overlapping it
        return CONFIGS / base, {"zero_optimization": {"overlap_comm": False}}
    cfg = load_config(base)
    cfg["fsdp_config"]["fsdp_auto_wrap_policy"] = "NO_WRAP"  # one-unit: the whole model one FSDP unit
    copy = Path(out_dir) / f"{Path(base).stem}.{variant}.yaml"
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return copy, {}


def single_process(config):
    """A config that runs the recipe as one process (1gpu.yaml, 1gpu_compile.yaml, cpu.yaml): the lean loop's peer."""
    cfg = load_config(config)
    return cfg.get("num_processes", 1) == 1 and cfg.get("num_machines", 1) == 1


def compiled(config):
    """A config whose model accelerate wraps in torch.compile (a dynamo_config: the *_compile.yaml)."""
    return str((load_config(config).get("dynamo_config") or {}).get("dynamo_backend", "NO")).upper() != "NO"


def lean_enabled(args):
    return args.recipe in ("mnist", "gpt") and not args.no_lean


def add_single_process_run(args, on_gpu):
    """The lean loop is single-device: it is compared with the recipe's 1-process run. When --configs has none,
    add one in front (compiled if any config in the list is). Returns the added configs."""
    if not lean_enabled(args) or any(single_process(c) for c in args.configs):
        return []
    added = "1gpu_compile.yaml" if any(compiled(c) for c in args.configs) else ("1gpu.yaml" if on_gpu else "cpu.yaml")
    args.configs = [added, *args.configs]
    return [added]


def lean_key(config, on_gpu):
    """(compiled, device) of the lean loop that a 1-process config is compared with: its compile setting, and the
    CPU where the config keeps the recipe there (cpu.yaml's use_cpu) or there is no GPU."""
    return compiled(config), "cpu" if not on_gpu or load_config(config).get("use_cpu") else "cuda"


def lean_name(key, on_gpu):
    compile_it, device = key
    qualifiers = ["compiled"] * compile_it + ["CPU"] * (on_gpu and device == "cpu")
    return LEAN + (f" ({', '.join(qualifiers)})" if qualifiers else "")


def lean_variants(configs, on_gpu):
    """Which lean loops to run: one per (compile, device) among the 1-process configs, in the order they come."""
    keys = [lean_key(c, on_gpu) for c in configs if single_process(c)]
    return list(dict.fromkeys(keys)) or [(False, "cuda" if on_gpu else "cpu")]


def shared_recipe_args(recipe_args):
    """The flags of --recipe-args that bench/lean_loop.py takes too (they shape the model the same way)."""
    tokens, kept, i = recipe_args.split(), [], 0
    while i < len(tokens):
        flag = tokens[i].split("=", 1)[0]
        if flag in LEAN_SHARED_FLAGS:
            width = 0 if "=" in tokens[i] else LEAN_SHARED_FLAGS[flag]
            kept += tokens[i:i + 1 + width]
            i += 1 + width
        else:
            i += 1
    return kept


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def turned_off_by_use_cpu(distributed_type):
    """Whether a config of this distributed type runs on a CPU through cpu_route/ only: its engine is one accelerate
    launch turns on by a variable of its own (DeepSpeed, FSDP2), which ACCELERATE_USE_CPU=1 would turn off. The
    engines say which (accelrun.engines), as the recipes' launch checks ask them."""
    from accelrun.engines import Engine  # here: the benchmark's --help and its plan stay quick
    return any(kind.launch_env and kind.accelerate_type.value == distributed_type for kind in Engine.kinds)


def config_launch(config, processes, on_gpu, mixed_precision, out):
    """accelerate launch arguments and environment that run `config` here with `processes` processes."""
    cfg = load_config(config)
    config_file, overrides = variant_config(config, out)
    mixed_precision = "bf16" if config.endswith("+bf16") else mixed_precision
    args, env = ["--config_file", str(config_file), "--main_process_port", str(free_port()),
                 "--mixed_precision", mixed_precision], {}
    copy = deepspeed_json_in(config, mixed_precision, out, overrides)
    if copy:
        args += ["--deepspeed_config_file", str(copy)]
    if cfg.get("num_processes", 1) > 1:
        args += ["--num_processes", str(processes)]
    if cfg.get("num_machines", 1) > 1:  # one machine here
        args += ["--num_machines", "1", "--machine_rank", "0", "--main_process_ip", "127.0.0.1"]
    if not on_gpu:  # the CPU route: see cpu_route/sitecustomize.py
        if turned_off_by_use_cpu(cfg["distributed_type"]):
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CPU_SHIM), os.environ.get("PYTHONPATH")]))
        else:
            env["ACCELERATE_USE_CPU"] = "1"
    return args, env


def plan_runs(args, processes, on_gpu, data_root):
    """[(name, command, environment)], one per run, repeats interleaved so drift hits every run alike."""
    common = ["--seed", str(args.seed), "--batch-size", str(args.batch_size), "--log-every", str(args.log_every)]
    if args.recipe == "mnist":
        epochs = math.ceil(args.steps / (args.train_size // args.batch_size))
        data = "synthetic" if "synthetic-" in str(data_root) else "mnist"
        recipe_args = ["--data", data, "--data-dir", args.data_dir,
                       "--synthetic-train-size", str(args.train_size), "--synthetic-test-size", str(args.test_size),
                       "--epochs", str(epochs), "--max-steps", str(args.steps), *common]
    elif args.recipe == "gpt":
        recipe_args = ["--preset", args.preset, "--max-steps", str(args.steps), "--sample-tokens", "0",
                       "--eval-every", str(args.steps), *common]
    elif args.recipe == "finetune_lm":  # --model and --data-files come in --recipe-args
        recipe_args = ["--max-steps", str(args.steps), "--sample-tokens", "0", "--eval-every", str(args.steps), *common]
    elif args.recipe == "dpo":  # --model and --data-files (preference pairs) come in --recipe-args
        recipe_args = ["--max-steps", str(args.steps), "--eval-every", str(args.steps), *common]
    else:
        recipe_args = ["--max-steps", str(args.steps), "--epochs", "1000", *common]
    recipe_args += args.recipe_args.split()
    # The lean loop: the same model, global batch, seed, precision and step count (a few of them untimed warm-up).
    warmup = min(10, max(1, args.steps // 10))
    lean_args = [sys.executable, str(REPO / "bench" / "lean_loop.py"), "--recipe", args.recipe,
                 "--batch-size", str(args.batch_size), "--seed", str(args.seed),
                 "--mixed-precision", args.mixed_precision,
                 "--warmup-steps", str(warmup), "--steps", str(args.steps - warmup),
                 *(["--preset", args.preset] if args.recipe == "gpt" else []), *shared_recipe_args(args.recipe_args)]
    runs = []
    for repeat in range(args.repeats):
        if args.recipe == "mnist" and not args.no_baselines:
            for name, pipeline in BASELINES.items():
                runs.append((name, repeat, ["torchrun", "--standalone", "--nproc_per_node", str(processes),
                                            str(REPO / "bench" / "ddp_baseline.py"), "--data-root", str(data_root),
                                            "--pipeline", pipeline, "--max-steps", str(args.steps),
                                            "--epochs", str(epochs), *common], {}))
        for config in args.configs:
            launch, env = config_launch(config, processes, on_gpu, args.mixed_precision, Path(args.out).resolve())
            runs.append((config, repeat, ["accelerate", "launch", *launch, str(REPO / "recipes" / f"{args.recipe}.py"),
                                          *recipe_args], env))
        if lean_enabled(args):
            for key in lean_variants(args.configs, on_gpu):
                runs.append((lean_name(key, on_gpu), repeat,
                             lean_args + ["--device", key[1]] + ["--compile"] * key[0], {}))
    return runs


def read_jsonl(path):
    return [json.loads(line) for line in open(path)] if path.exists() else []


def measure(name, repeat, cmd, env, out, threads):
    """Run one, return its figures (or its failure)."""
    run_dir = out / "runs" / f"{re.sub(r'[^A-Za-z0-9]+', '-', name.replace('.yaml', '')).strip('-')}-{repeat}"
    log_path = out / "logs" / f"{run_dir.name}.log"
    full_env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", **env)
    started = time.time()
    with open(log_path, "w") as log:
        log.write(" ".join(cmd + ["--output-dir", str(run_dir)]) + "\n")
        log.flush()
        code = subprocess.run(cmd + ["--output-dir", str(run_dir)], cwd=REPO, env=full_env, stdout=log,
                              stderr=subprocess.STDOUT).returncode
    result = {"name": name, "repeat": repeat, "log": str(log_path), "exit_code": code}
    if code != 0 or not (run_dir / "summary.json").exists():
        tail = log_path.read_text().strip().splitlines()[-3:]
        return {**result, "failed": " | ".join(tail)}
    summary = json.loads((run_dir / "summary.json").read_text())
    timing = summary["timing"]
    unit = next(k for k in timing if k.endswith("_per_s"))
    # The lean loop times its steps as one region (its phases are null) and gives the step time itself.
    step_ms = timing["step_ms"] if "step_ms" in timing else (
        timing["data_ms"] + timing["forward_backward_ms"] + timing["optimizer_ms"] + timing["other_ms"])
    return {**result, "engine": summary.get("distributed_type"), "zero_stage": summary.get("deepspeed_stage"),
            "processes": summary["world_size"], "unit": unit, "throughput": timing[unit],
            "startup_s": timing["first_step_at"] - started, "step_ms": step_ms, "data_ms": timing["data_ms"],
            "forward_backward_ms": timing["forward_backward_ms"], "optimizer_ms": timing["optimizer_ms"],
            "other_ms": timing["other_ms"],
            "data_fraction": timing["data_fraction"], "optimizer_in_backward": timing["optimizer_in_backward"],
            "peak_memory_mb_per_rank": summary["peak_memory_mb_per_rank"],
            "peak_memory_kind": summary["peak_memory_kind"],
            # MFU of the steady state: the summary's is over the whole run, start-up included
            "mfu": summary["mfu"] * timing[unit] / summary[unit] if summary.get("mfu") and unit in summary
            else summary.get("mfu"), "fsdp_units": summary.get("fsdp_units"),
            "padding_share": summary.get("padding_share"),  # finetune_lm: positions that are padding
            "metrics": read_jsonl(run_dir / "metrics.jsonl"), "evals": read_jsonl(run_dir / "eval.jsonl"),
            "final_accuracy": summary.get("test_accuracy", summary.get("val_accuracy")),
            "final_loss": summary.get("final_loss", summary.get("val_loss"))}


def time_to(records, key, reached):
    return next((r["train_time_s"] for r in records if key in r and reached(r[key])), None)


def aggregate(results, target_loss, target_accuracy):
    """Medians over repeats, per name, in the order of the plan."""
    rows = {}
    for r in results:
        rows.setdefault(r["name"], []).append(r)
    table = []
    for name, runs in rows.items():
        good = [r for r in runs if "failed" not in r]
        if not good:
            table.append({"name": name, "failed": runs[0]["failed"], "log": runs[0]["log"]})
            continue
        med = lambda key: None if good[0][key] is None else statistics.median(r[key] for r in good)  # noqa: E731
        loss_times = [time_to(r["metrics"], "loss", lambda v: v <= target_loss) for r in good]
        acc_times = [time_to(r["evals"], "test_accuracy", lambda v: v >= target_accuracy)
                     or time_to(r["evals"], "val_accuracy", lambda v: v >= target_accuracy) for r in good]
        table.append({
            "name": name, "runs": len(good), "processes": good[0]["processes"], "unit": good[0]["unit"],
            "engine": good[0]["engine"], "zero_stage": good[0]["zero_stage"],
            **{key: med(key) for key in ("throughput", "startup_s", "step_ms", "data_ms", "forward_backward_ms",
                                         "optimizer_ms", "other_ms", "data_fraction")},
            "optimizer_in_backward": good[0]["optimizer_in_backward"],
            "mfu": med("mfu") if good[0].get("mfu") is not None else None, "fsdp_units": good[0].get("fsdp_units"),
            "padding_share": good[0].get("padding_share"),  # the data's, the same in every repeat
            "peak_memory_mb_per_rank": [statistics.median(col)
                                        for col in zip(*(r["peak_memory_mb_per_rank"] for r in good))],
            "peak_memory_kind": good[0]["peak_memory_kind"],
            "time_to_target_loss_s": statistics.median(loss_times) if None not in loss_times else None,
            "time_to_target_accuracy_s": statistics.median(acc_times) if None not in acc_times else None,
            "final_accuracy": good[0]["final_accuracy"],
            "final_loss": med("final_loss") if good[0]["final_loss"] is not None else None,
        })
    return table


def paired(results, name, other, key):
    """results[name][key] / results[other][key] within each round: runs of one round ran back to back."""
    rounds = {}
    for r in results:
        if "failed" not in r:
            rounds.setdefault(r["repeat"], {})[r["name"]] = r[key]
    return [run[name] / run[other] for run in rounds.values() if name in run and other in run]


def recipe_vs_lean(table, results, settings, on_gpu):
    """recipe throughput / lean-loop throughput, for every 1-process config of the list against the lean loop
    with the same compile setting: the median over rounds of the ratio within a round, as for the overhead."""
    by = {row["name"]: row for row in table if "failed" not in row}
    recipe, batch = settings["recipe"], settings["batch_size"]
    goal, goal_for = LEAN_GOALS[recipe]
    out = {}
    for config in settings["configs"]:
        lean = lean_name(lean_key(config, on_gpu), on_gpu) if single_process(config) else None
        if lean not in by or config not in by:
            continue
        per_round = paired(results, config, lean, "throughput")
        value = statistics.median(per_round)
        # Where the goal is stated: MNIST at batch 512, GPT-124M compiled; both for a GPU.
        conditions = [("measured on CPU" if not on_gpu else None),
                      (f"global batch {batch}" if recipe == "mnist" and batch != 512 else None),
                      (f"preset {settings['preset']}" if recipe == "gpt" and settings["preset"] != "124M" else None),
                      ("not compiled" if recipe == "gpt" and not compiled(config) else None)]
        off = [c for c in conditions if c]
        out[config] = {"value": value, "per_round": per_round, "recipe": config, "lean": lean,
                       "recipe_throughput": by[config]["throughput"], "lean_throughput": by[lean]["throughput"],
                       "goal": f">= {goal:.2f}", "goal_for": goal_for, "goal_applies": not off,
                       "met": (value >= goal) if not off else None, "not_judged_because": off,
                       "measured_on": "GPU" if on_gpu else "CPU",
                       "what": f"throughput, recipe under {config} / {lean} (bench/lean_loop.py: same model, global "
                               f"batch, precision{', torch.compile' if compiled(config) else ''}; one process)"}
    return out


def ratios(table, results, settings=None, on_gpu=False):
    by = {row["name"]: row for row in table if "failed" not in row}
    ddp, course = by.get(DDP), by.get("ddp-by-hand (per-sample ToTensor)")
    out = {}
    per_round = paired(results, DDP, "ddp-by-hand (tensor pipeline)", "step_ms")
    if per_round:
        value = statistics.median(per_round)
        out["accelerate_overhead"] = {"value": value, "per_round": per_round, "goal": "<= 1.03", "met": value <= 1.03,
                                      "what": f"step time, recipe under {DDP} / DDP by hand with the same pipeline "
                                              f"(median over rounds of the ratio within a round)"}
    if ddp and course:
        out["data_wait_share"] = {"value": ddp["data_fraction"], "course_baseline": course["data_fraction"],
                                  "goal": "< 0.05", "met": ddp["data_fraction"] < 0.05,
                                  "what": "share of the step spent waiting for data: recipe vs course-style DDP"}
    if ddp:
        out["throughput_vs_ddp"] = {row["name"]: row["throughput"] / ddp["throughput"] for row in by.values()}
    lean = recipe_vs_lean(table, results, settings, on_gpu) if settings and settings["recipe"] in LEAN_GOALS else {}
    if lean:
        out["recipe_vs_lean"] = lean
    return out


def write_markdown(path, report):
    table, r, hw = report["table"], report["ratios"], report["hardware"]
    unit = next((row["unit"] for row in table if "unit" in row), "samples_per_s").replace("_per_s", "/s")
    vs = r.get("throughput_vs_ddp", {})
    s = report["settings"]
    lines = [f"Measured {report['date']} on {hw['label']} ({hw['host']}); torch {hw['torch']}, accelerate "
             f"{hw['accelerate']}, DeepSpeed {hw['deepspeed']}. Recipe `{s['recipe']}`, {s['steps']} steps, "
             f"global batch {s['batch_size']}, precision {s['mixed_precision']}, median of {s['repeats']} run(s) "
             "each.", "",
             f"| run | procs | start-up s | {unit} | vs DDP | step ms | data ms | fwd+bwd ms | optimizer ms | other ms "
             f"| data share | peak MB per proc | s to loss <= {s['target_loss']} "
             f"| s to acc >= {s['target_accuracy']} |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
    for row in table:
        if "failed" in row:
            lines.append(f"| {row['name']} | FAILED: see {row['log']} |" + " |" * 12)
            continue
        opt = "in bwd" if row["optimizer_in_backward"] else fmt(row["optimizer_ms"])
        lines.append(f"| {row['name']} | {row['processes']} | {fmt(row['startup_s'])} | {row['throughput']:.0f} | "
                     f"{fmt(vs.get(row['name']), '{:.2f}')} | {row['step_ms']:.1f} | {row['data_ms']:.1f} | "
                     f"{fmt(row['forward_backward_ms'])} | {opt} | {row['other_ms']:.1f} | "
                     f"{100 * row['data_fraction']:.1f}% | "
                     f"{' / '.join(f'{m:.0f}' for m in row['peak_memory_mb_per_rank'])} | "
                     f"{fmt(row['time_to_target_loss_s'])} | {fmt(row['time_to_target_accuracy_s'])} |")
    lines.append("")
    if "accelerate_overhead" in r:
        a = r["accelerate_overhead"]
        lines.append(f"1. {a['what']}: **{a['value']:.3f}** (goal {a['goal']}: {'met' if a['met'] else 'NOT met'}; "
                     f"rounds: {', '.join(f'{v:.3f}' for v in a['per_round'])})")
    if "data_wait_share" in r:
        d = r["data_wait_share"]
        lines.append(f"2. {d['what']}: **{100 * d['value']:.1f}%** vs {100 * d['course_baseline']:.1f}% "
                     f"(goal {d['goal']}: {'met' if d['met'] else 'NOT met'})")
    if vs:
        lines.append("3. throughput relative to DDP (" + DDP + "): " + ", ".join(f"{k} {v:.2f}" for k, v in vs.items()))
    for lean in r.get("recipe_vs_lean", {}).values():
        verdict = (("met" if lean["met"] else "NOT met") if lean["goal_applies"] else
                   f"not judged: {', '.join(lean['not_judged_because'])}")
        lines.append(f"4. {lean['what']}: **{lean['value']:.3f}** ({lean['recipe_throughput']:.0f} / "
                     f"{lean['lean_throughput']:.0f} {unit}; goal {lean['goal']} for {lean['goal_for']}: {verdict}; "
                     f"rounds: {', '.join(f'{v:.3f}' for v in lean['per_round'])})")
    added = s.get("added_for_lean") or []
    lines.append(f"\nPeak memory is {table[0].get('peak_memory_kind', '')} per process. \"in bwd\": under DeepSpeed "
                 "the optimizer step runs inside accelerator.backward() and is counted in fwd+bwd. \"other\": the "
                 "recipe's per-step bookkeeping (logging; the stop agreement rides on the progress lines)."
                 + (" \"lean loop\": bench/lean_loop.py, one process, data already on the device, no host sync; "
                    "its steps are timed as one region, so fwd+bwd and optimizer are \"-\"." if "recipe_vs_lean" in r
                    or any(row["name"].startswith(LEAN) for row in table) else "")
                 + (f" {', '.join(added)}: not in --configs, added as the 1-process run the lean loop is compared "
                    "with." if added else ""))
    path.write_text("\n".join(lines) + "\n")


def write_chart(path, report):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [row for row in report["table"] if "failed" not in row]
    names = [row["name"].replace("ddp-by-hand ", "by hand\n").replace(".yaml", "") for row in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5))
    vs = report["ratios"].get("throughput_vs_ddp", {})
    ax1.barh(names, [vs.get(row["name"], row["throughput"]) for row in rows], color="tab:blue")
    ax1.set(title="throughput relative to DDP" if vs else "throughput", xlabel="x DDP" if vs else rows[0]["unit"])
    left = [0.0] * len(rows)
    for phase, colour in (("data_ms", "tab:red"), ("forward_backward_ms", "tab:green"), ("optimizer_ms", "tab:orange"),
                          ("other_ms", "tab:grey"), ("unsplit_ms", "tab:olive")):
        # The lean loop times its steps as one region: its whole step is one bar, "unsplit".
        values = [(row["step_ms"] if row["forward_backward_ms"] is None else 0.0) if phase == "unsplit_ms"
                  else row[phase] or 0.0 for row in rows]
        label = "whole step (lean loop)" if phase == "unsplit_ms" else phase.replace("_ms", "").replace("_", "+")
        ax2.barh(names, values, left=left, color=colour, label=label)
        left = [a + b for a, b in zip(left, values)]
    ax2.set(title="time per step", xlabel="ms")
    ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=5, fontsize=8)
    ax3.barh(names, [max(row["peak_memory_mb_per_rank"]) for row in rows], color="tab:purple")
    ax3.set(title=f"peak memory per process ({rows[0]['peak_memory_kind']})", xlabel="MB")
    for ax in (ax2, ax3):
        ax.set_yticklabels([])
    fig.suptitle(f"{report['settings']['recipe']}: {report['hardware']['label']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def mnist_data_root(args):
    """The real MNIST in --data-dir if it is there; else the synthetic digits the recipe would make (written once)."""
    sys.path.insert(0, str(REPO / "recipes"))
    from accelrun.data.synthetic_mnist import write_synthetic_mnist
    real = Path(args.data_dir) / "MNIST" / "raw" / "train-images-idx3-ubyte"
    if real.exists():
        return Path(args.data_dir).resolve()
    return write_synthetic_mnist(str(Path(args.data_dir).resolve() / f"synthetic-{args.train_size}-{args.test_size}"),
                                 args.train_size, args.test_size, seed=0)


def measure_all(runs, out, threads):
    """Every run in turn. After a SIGTERM (the GPU table's time budget) the run it interrupted is reported as it
    ended and the others as not run, so that the report of the runs done is still written."""
    stopped, results = [], []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
    try:
        with tqdm(total=len(runs), desc="benchmark", unit="run") as bar:
            for name, repeat, cmd, env in runs:
                bar.set_postfix_str(f"{name} #{repeat + 1}")
                if stopped:
                    results.append({"name": name, "repeat": repeat, "log": "(not run)", "exit_code": None,
                                    "failed": "not run: the benchmark was stopped (SIGTERM)"})
                else:
                    results.append(measure(name, repeat, cmd, env, out, threads))
                if "failed" in results[-1]:
                    tqdm.write(f"{name}: FAILED (exit {results[-1]['exit_code']}), see {results[-1]['log']}")
                bar.update(1)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return results


def write_report(out, args, results, settings, on_gpu):
    """results.json, results.md and results.png in OUT; the number of failed runs."""
    table = aggregate(results, settings["target_loss"], args.target_accuracy)
    report = {"date": time.strftime("%Y-%m-%d"), "hardware": hardware(), "settings": settings,
              "table": table, "ratios": ratios(table, results, settings, on_gpu),
              "runs": [{k: v for k, v in r.items() if k not in ("metrics", "evals")} for r in results]}
    (out / "results.json").write_text(json.dumps(report, indent=2))
    write_markdown(out / "results.md", report)
    if any("failed" not in row for row in table):
        write_chart(out / "results.png", report)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'} and {out / 'results.png'}")
    failed = [row["name"] for row in table if "failed" in row]
    if failed:
        print(f"error: {len(failed)} run(s) failed ({', '.join(failed)}); their logs are in {out / 'logs'}",
              file=sys.stderr)
    return len(failed)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--gpu-table" in argv:  # handed to gpu_check/gpu_table.py with its flags: it imports this module, not back
        table = str(REPO / "gpu_check" / "gpu_table.py")
        os.execv(sys.executable, [sys.executable, table, *(a for a in argv if a != "--gpu-table")])
    args = parse_args(argv)
    import torch
    on_gpu = torch.cuda.is_available()
    processes = args.num_processes or (torch.cuda.device_count() if on_gpu else 2)
    threads = max(1, (os.cpu_count() or 2) // processes)
    out = Path(args.out).resolve()
    for sub in ("logs", "runs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    data_root = mnist_data_root(args) if args.recipe == "mnist" else None
    target_loss = args.target_loss if args.target_loss is not None else DEFAULT_TARGET_LOSS[args.recipe]
    added = add_single_process_run(args, on_gpu)
    results = measure_all(plan_runs(args, processes, on_gpu, data_root), out, threads)
    settings = {**vars(args), "added_for_lean": added, "on_gpu": on_gpu,
                "target_loss": target_loss, "processes": processes, "threads_per_process": threads}
    return 1 if write_report(out, args, results, settings, on_gpu) else 0


if __name__ == "__main__":
    sys.exit(main())
