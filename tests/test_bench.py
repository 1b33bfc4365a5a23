"""bench/: the DDP-by-hand baseline trains the recipe's model, and benchmark.py plans its runs and writes
a report whose every figure is the runs' own (tiny sizes; no timing is asserted)."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from charts import TAB_BLUE, TAB_GREEN, TAB_PURPLE, TAB_RED, assert_drawn_png
from launching import REPO, run_command


def test_baseline_trains_the_recipes_model():
    """The same weights in both ConvNets give the same outputs, in eval and in train mode (BatchNorm batch
    statistics and running-statistics update included): the same model, not just the same parameter shapes."""
    import torch
    sys.path.insert(0, str(REPO / "recipes"))
    sys.path.insert(0, str(REPO / "bench"))
    import ddp_baseline
    import mnist
    generator = torch.Generator().manual_seed(0)
    ours, theirs = mnist.ConvNet(), ddp_baseline.ConvNet()
    with torch.no_grad():  # random everything, BatchNorm's affine and running statistics too: every layer counts
        for name, tensor in ours.state_dict().items():
            if tensor.is_floating_point():
                noise = torch.rand(tensor.shape, generator=generator)
                tensor.copy_(0.5 + noise if name.endswith("running_var") else 0.2 * (noise - 0.5))
    theirs.load_state_dict(ours.state_dict())  # strict: the same names and shapes
    images = torch.randn(6, 1, 28, 28, generator=generator)
    for train in (False, True):
        ours.train(train)
        theirs.train(train)
        expected, got = ours(images), theirs(images)
        assert expected.shape == (6, 10)
        torch.testing.assert_close(got, expected, msg=lambda m: f"train={train}: {m}")
    # train mode updated BatchNorm's running statistics alike (same momentum, eps, layers)
    torch.testing.assert_close(theirs.state_dict(), ours.state_dict())



@pytest.mark.parametrize("flag", ["cuda", "auto"])
def test_lean_loop_trains_on_the_current_gpu_by_index(monkeypatch, tmp_path, flag):
    """--device cuda (what the benchmark passes on a GPU machine, and what auto picks there) is torch.device("cuda"),
    which names no GPU; torch.cuda.set_device refuses such a device (ValueError). The lean loop trains on the current
    GPU by its index. Checked with torch's own set_device down to the driver call, which is recorded instead: this
    machine has no GPU. The model is never built: the test stops where the device has been chosen."""
    import torch
    sys.path.insert(0, str(REPO / "bench"))
    import lean_loop

    class Built(Exception):
        pass

    def build(args, device):
        raise Built(device)

    selected = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # not 0: the index is the current GPU's
    monkeypatch.setattr(torch._C, "_cuda_setDevice", selected.append)
    monkeypatch.setattr(lean_loop, "build", build)
    with pytest.raises(Built) as built:
        lean_loop.main(["--recipe", "gpt", "--preset", "tiny", "--device", flag, "--output-dir", str(tmp_path)])
    assert built.value.args[0] == torch.device("cuda", 1) and selected == [1]
    assert lean_loop.chosen_device("cpu") == torch.device("cpu")


SMOKE_DDP, SMOKE_SINGLE, SMOKE_LEAN = "2gpu.yaml", "cpu.yaml", "lean loop"
SMOKE_TENSOR, SMOKE_COURSE = "ddp-by-hand (tensor pipeline)", "ddp-by-hand (per-sample ToTensor)"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One tiny benchmark, read by the three tests below: (report, runs by name, each run's summary.json). The
    config list has no 1-process run, so the benchmark adds cpu.yaml for the lean loop (bench/lean_loop.py)."""
    tmp_path = tmp_path_factory.mktemp("smoke")
    out = tmp_path / "report"
    code, output = run_command([sys.executable, "bench/benchmark.py", "--steps", "6", "--train-size", "512",
                                "--test-size", "64", "--log-every", "2", "--configs", "2gpu.yaml",
                                "deepspeed_zero2.yaml", "--data-dir", str(tmp_path / "data"), "--out", str(out)],
                               timeout=900)
    assert code == 0, output[-4000:]
    report = json.loads((out / "results.json").read_text())
    runs = {r["name"]: r for r in report["runs"]}
    summaries = {name: json.loads((out / "runs" / Path(run["log"]).stem / "summary.json").read_text())
                 for name, run in runs.items()}  # each run's own summary.json (the run folder is named after its log)
    return report, runs, summaries, out, output


@pytest.mark.slow
def test_benchmark_smoke_writes_the_report(smoke):
    """Tiny sizes; what is checked is the report, never a timing: every row is its run's own figures."""
    report, runs, summaries, _, _ = smoke
    names = [row["name"] for row in report["table"]]
    ddp, single, lean = SMOKE_DDP, SMOKE_SINGLE, SMOKE_LEAN
    assert names == [SMOKE_COURSE, SMOKE_TENSOR, single, ddp, "deepspeed_zero2.yaml", lean]
    assert report["settings"]["added_for_lean"] == [single] and report["settings"]["on_gpu"] is False
    batch = report["settings"]["batch_size"]
    assert batch == 128  # the MNIST default global batch; the recipe and the baselines take it whole per step
    # One round: every table row is one run, so it must carry that run's figures exactly (no median to blur them).
    assert sorted(runs) == sorted(names) and all(r["repeat"] == 0 for r in report["runs"])
    for row in report["table"]:
        assert "failed" not in row, row
        procs = 1 if row["name"] in (single, lean) else 2
        assert row["runs"] == 1 and row["processes"] == procs and len(row["peak_memory_mb_per_rank"]) == procs
        assert row["throughput"] > 0 and row["startup_s"] > 0 and row["unit"] == "samples_per_s"
        run = runs[row["name"]]
        # ... and that run's figures are its own summary.json "timing" block
        timing = summaries[row["name"]]["timing"]
        for key in ("throughput", "data_ms", "forward_backward_ms", "optimizer_ms", "other_ms", "data_fraction"):
            assert row[key] == run[key] == timing["samples_per_s" if key == "throughput" else key], (row, timing)
        # The timers (src/accelrun/timing.py, bench/ddp_baseline.py) define, over the same steady micro-batches
        # m and their total time T: throughput = m x global batch / T, each phase's ms = 1000 x its time / m, and
        # data_fraction = data time / T. So throughput x step time = the global batch, and data_fraction = data_ms /
        # step_ms, up to float rounding alone (1e-9 relative is a million times that): a step time or a
        # throughput taken from anything else (one rank's batch, the whole-run rate, a phase left out) breaks it.
        assert row["throughput"] * row["step_ms"] / 1000 == pytest.approx(batch, rel=1e-9), row
        assert row["data_fraction"] == pytest.approx(row["data_ms"] / row["step_ms"], rel=1e-9), row
    engines = {row["name"]: (row["engine"], row["zero_stage"]) for row in report["table"]}
    assert engines[ddp] == ("MULTI_CPU", None) and engines["deepspeed_zero2.yaml"] == ("DEEPSPEED", 2)
    assert engines[single] == ("NO", None) and engines[lean] == ("lean loop", None)
    assert runs[ddp]["other_ms"] > 0 and runs[SMOKE_TENSOR]["other_ms"] == 0  # the recipe's bookkeeping; none by hand


@pytest.mark.slow
def test_benchmark_smoke_lean_loop_ran_what_the_recipe_ran(smoke):
    """The lean loop, from its own summary.json: its timed region of m steps and T seconds gives step_ms = 1000 T / m
    and throughput = m x batch / T; the data are on the device (no wait) and the phases are one region (null).
    It ran what the recipe's 1-process run ran: the same model (parameter count), batch, precision, no compile,
    as many steps (warm-up included) on the same device."""
    report, runs, summaries, _, _ = smoke
    batch, lean = report["settings"]["batch_size"], SMOKE_LEAN
    lean_summary, lean_timing = summaries[lean], summaries[lean]["timing"]
    lean_step_ms = 1000 * lean_timing["timed_s"] / lean_timing["micro_batches"]
    assert runs[lean]["step_ms"] == pytest.approx(lean_step_ms, rel=1e-12)
    assert lean_timing["samples_per_s"] == pytest.approx(
        lean_timing["micro_batches"] * batch / lean_timing["timed_s"], rel=1e-12)
    assert lean_timing["micro_batches"] + lean_timing["warmup_steps"] == report["settings"]["steps"] == 6
    phases = ("data_ms", "forward_backward_ms", "optimizer_ms", "other_ms")
    assert [lean_timing[phase] for phase in phases] == [0.0, None, None, 0.0]
    assert lean_summary["param_elements"] == summaries[SMOKE_SINGLE]["param_elements"] > 0
    assert [lean_summary[key] for key in ("model", "batch_size", "mixed_precision", "compile", "device",
                                          "optimizer_implementation")] == ["mnist", batch, "no", False, "cpu", "fused"]


@pytest.mark.slow
def test_benchmark_smoke_ratios_come_from_their_rows(smoke):
    """The three ratios, recomputed from the rows they are built from (bench/benchmark.py ratios()), and the
    report's Markdown and chart that show them."""
    report, runs, _, out, output = smoke
    ddp, single, lean = SMOKE_DDP, SMOKE_SINGLE, SMOKE_LEAN
    names = [row["name"] for row in report["table"]]
    by = {row["name"]: row for row in report["table"]}
    ratios = report["ratios"]
    assert set(ratios) == {"accelerate_overhead", "data_wait_share", "throughput_vs_ddp", "recipe_vs_lean"}
    overhead = ratios["accelerate_overhead"]  # step time, recipe under 2gpu.yaml / DDP by hand, same pipeline
    assert overhead["per_round"] == pytest.approx([runs[ddp]["step_ms"] / runs[SMOKE_TENSOR]["step_ms"]], rel=1e-12)
    assert overhead["value"] == pytest.approx(overhead["per_round"][0], rel=1e-12)
    assert overhead["met"] == (overhead["value"] <= 1.03)
    share = ratios["data_wait_share"]  # the recipe's data wait vs the course-style pipeline's
    assert (share["value"], share["course_baseline"]) == (by[ddp]["data_fraction"], by[SMOKE_COURSE]["data_fraction"])
    assert share["met"] == (share["value"] < 0.05)
    vs_ddp = ratios["throughput_vs_ddp"]
    assert list(vs_ddp) == names
    assert vs_ddp == pytest.approx({name: by[name]["throughput"] / by[ddp]["throughput"] for name in names},
                                   rel=1e-12)
    # recipe / lean loop: the 1-process recipe run's throughput over the lean loop's, as the report says
    [vs_lean] = ratios["recipe_vs_lean"].values()
    assert list(ratios["recipe_vs_lean"]) == [single] and (vs_lean["recipe"], vs_lean["lean"]) == (single, lean)
    assert [vs_lean["recipe_throughput"], vs_lean["lean_throughput"]] == [by[single]["throughput"],
                                                                         by[lean]["throughput"]]
    assert vs_lean["per_round"] == pytest.approx([runs[single]["throughput"] / runs[lean]["throughput"]], rel=1e-12)
    assert vs_lean["value"] == pytest.approx(by[single]["throughput"] / by[lean]["throughput"], rel=1e-12)
    # a GPU goal (MNIST at batch 512): on this CPU, at batch 128, shown and not judged
    assert [vs_lean[key] for key in ("goal", "goal_applies", "met", "measured_on")] == [">= 0.80", False, None, "CPU"]
    assert vs_lean["not_judged_because"] == ["measured on CPU", "global batch 128"]
    markdown = (out / "results.md").read_text()
    assert markdown.count("\n| ") == 7 and "1. step time" in markdown and "2. share of the step" in markdown
    assert f"4. throughput, recipe under {single} / {lean} " in markdown, markdown
    assert (f"**{vs_lean['value']:.3f}** ({vs_lean['recipe_throughput']:.0f} / {vs_lean['lean_throughput']:.0f} "
            "samples/s; goal >= 0.80 for MNIST at global batch 512, on a GPU: not judged: measured on CPU, global "
            "batch 128; rounds: ") in markdown, markdown
    assert f"**{overhead['value']:.3f}**" in markdown, markdown
    assert f"**{100 * share['value']:.1f}%** vs {100 * share['course_baseline']:.1f}%" in markdown, markdown
    assert "3. throughput relative to DDP (2gpu.yaml): " + ", ".join(f"{k} {v:.2f}" for k, v in vs_ddp.items()) \
        in markdown, markdown
    # figsize (17, 5) at dpi 100: throughput bars (blue), the step split (red, green, ...), peak memory (purple)
    assert_drawn_png(out / "results.png", (1700, 500), [TAB_BLUE, TAB_RED, TAB_GREEN, TAB_PURPLE])
    assert "benchmark: 100%" in output  # the tqdm bar


def test_benchmark_plans_the_lean_loop_beside_a_1_process_run(tmp_path):
    """Which lean loops run, with which flags, against which 1-process config (planning only: nothing is launched)."""
    import argparse
    sys.path.insert(0, str(REPO / "bench"))
    import benchmark

    def plan(configs, on_gpu, recipe="gpt", recipe_args="", no_lean=False):
        args = argparse.Namespace(recipe=recipe, configs=list(configs), no_lean=no_lean, no_baselines=True, steps=30,
                                  batch_size=16, seed=3, mixed_precision="bf16", preset="tiny", repeats=2, log_every=5,
                                  recipe_args=recipe_args, out=str(tmp_path))
        added = benchmark.add_single_process_run(args, on_gpu)
        runs = benchmark.plan_runs(args, 2, on_gpu, None)
        return added, args.configs, [(name, cmd) for name, repeat, cmd, env in runs if repeat == 0]

    # no 1-process config: one is added in front (compiled when the list compiles), then the lean loop last
    added, configs, runs = plan(["2gpu.yaml"], on_gpu=False)
    assert added == ["cpu.yaml"] and configs == ["cpu.yaml", "2gpu.yaml"]
    assert [name for name, _ in runs] == ["cpu.yaml", "2gpu.yaml", "lean loop"]
    assert plan(["2gpu.yaml"], on_gpu=True)[0] == ["1gpu.yaml"]
    assert plan(["2gpu_compile.yaml", "fsdp.yaml"], on_gpu=True)[0] == ["1gpu_compile.yaml"]
    # the lean loop takes the recipe's model, batch, seed, precision and step count, and its shared flags
    lean = runs[-1][1]
    assert lean[1].endswith("bench/lean_loop.py")
    flags = lean[2:]
    for flag, value in (("--recipe", "gpt"), ("--batch-size", "16"), ("--seed", "3"), ("--mixed-precision", "bf16"),
                        ("--preset", "tiny"), ("--device", "cpu"), ("--warmup-steps", "3"), ("--steps", "27")):
        assert flags[flags.index(flag) + 1] == value, (flag, flags)
    assert "--compile" not in flags
    _, _, runs = plan(["2gpu.yaml"], on_gpu=False, recipe_args="--block-size 32 --eval-batches 2 --peak-tflops=989")
    lean = runs[-1][1]  # the model-shaping flags of --recipe-args go along; the recipe's others do not
    assert lean[lean.index("--block-size") + 1] == "32" and "--peak-tflops=989" in lean and "--eval-batches" not in lean
    # one lean loop per (compile, device) among the 1-process configs, each paired with its own
    added, _, runs = plan(["1gpu.yaml", "1gpu_compile.yaml", "cpu.yaml", "2gpu.yaml"], on_gpu=True)
    leans = {name: cmd for name, cmd in runs if name.startswith("lean loop")}
    assert added == [] and list(leans) == ["lean loop", "lean loop (compiled)", "lean loop (CPU)"]
    assert ["--compile" in cmd for cmd in leans.values()] == [False, True, False]
    assert [cmd[cmd.index("--device") + 1] for cmd in leans.values()] == ["cuda", "cuda", "cpu"]
    single_process = ("1gpu.yaml", "1gpu_compile.yaml", "cpu.yaml")
    assert [benchmark.lean_name(benchmark.lean_key(c, True), True) for c in single_process] == list(leans)
    # resnet has no lean loop, and --no-lean turns it off
    for added, configs, runs in (plan(["2gpu.yaml"], on_gpu=False, recipe="resnet"),
                                 plan(["2gpu.yaml"], on_gpu=False, no_lean=True)):
        assert added == [] and configs == ["2gpu.yaml"] and [name for name, _ in runs] == ["2gpu.yaml"]


def test_benchmark_refuses_an_unknown_config(tmp_path):
    out = subprocess.run([sys.executable, "bench/benchmark.py", "--configs", "nope.yaml", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no such config in accelerate_configs/: nope.yaml" in out.stderr


def test_gpu_table_refuses_a_machine_without_gpu(tmp_path):
    """The GPU table measures GPUs: here it says so in one line, exits 2 and writes nothing. Asked through
    bench/benchmark.py --gpu-table, which hands it to gpu_check/gpu_table.py (that module imports the benchmark,
    never the other way round)."""
    code, output = run_command([sys.executable, "bench/benchmark.py", "--gpu-table", "--out", str(tmp_path / "r"),
                                "--work", str(tmp_path / "w")], env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert code == 2, output[-3000:]
    assert output.strip().splitlines() == ["error: the GPU table measures GPUs and this machine has no CUDA device; "
                                           "run it where one is (README, 'On a GPU'), or see its plan with --dry-run"]
    assert not (tmp_path / "r").exists() and not (tmp_path / "w").exists()
    imports = {path.stem: re.findall(r"^(?:from|import) (\w+)", path.read_text(), re.M)
               for path in [*(REPO / "bench").glob("*.py"), *(REPO / "gpu_check").glob("*.py")]}
    assert "benchmark" in imports["gpu_table"] and "gpu_table" not in imports["benchmark"]
    assert not [name for name, found in imports.items() if "gpu_table" in found and name != "gpu_call"]


def gpu_table_modules():
    sys.path[:0] = [str(REPO / "bench"), str(REPO / "gpu_check")]
    import benchmark
    import gpu_table
    return benchmark, gpu_table


INPUTS = {"images": "/in/images", "llama": "/in/llama", "chats": "/in/chats.jsonl", "pairs": "/in/pairs.jsonl",
          "large": "/in/large", "large_states": "fp32"}
LONG_PARTS = [f"finetune-{form}-{block}" for block in (4096, 8192) for form in ("flex", "dense", "padded")]
TABLE = ["finetune-full", "finetune-lora", "finetune-padded", "finetune-lora-zero3", "finetune-chunked-loss",
         "finetune-qlora", *LONG_PARTS, "finetune-chunk-tokens-8192", "finetune-chunks-8-8192",  # issue 55
         "dpo-lora", *(f"optim-states-{shape}-{states}" for shape in ("1b", "largest")  # issue 50
                       for states in ("fp32", "bf16", "8bit")), "finetune-fp8",
         "gpt", "mnist", "resnet", "zero2-overlap", "fsdp-units"]


def test_gpu_table_plans_every_comparison(tmp_path):
    """Each part of the GPU table is one benchmark run whose arguments the benchmark accepts, its inputs filled in;
    the two variants differ from their shipped config in the one key they name, and with one GPU they are left out
    (one process has nothing to overlap or shard)."""
    import yaml
    benchmark, gpu_table = gpu_table_modules()
    configs = {}
    for gpus in (2, 1):
        runs = dict(gpu_table.part_commands(tmp_path, 756.0, INPUTS, gpus))
        assert list(runs) == TABLE
        for folder, cmd in runs.items():
            args = benchmark.parse_args(cmd[2:])  # exits on an unknown config, variant or flag
            assert args.mixed_precision == ("fp8" if folder == "finetune-fp8" else "bf16"), folder
            assert Path(args.out) == tmp_path / folder
            assert "{" not in args.recipe_args, args.recipe_args  # every input filled in
            configs[gpus, folder] = args.configs
            assert ("--peak-tflops 756" in args.recipe_args) == (args.recipe in ("gpt", "finetune_lm")), folder
    for gpus in (1, 2):
        assert configs[gpus, "mnist"] == configs[gpus, "gpt"] == configs[gpus, "resnet"] == ["1gpu.yaml",
                                                                                              "1gpu_compile.yaml"]
        assert configs[gpus, "finetune-full"] == configs[gpus, "finetune-lora"] == ["1gpu.yaml", "1gpu_compile.yaml"]
        assert configs[gpus, "finetune-padded"] == configs[gpus, "finetune-chunked-loss"] == \
            configs[gpus, "finetune-qlora"] == ["1gpu.yaml"]
        assert configs[gpus, "finetune-lora-zero3"] == ["deepspeed_zero3.yaml"]
    assert configs[2, "zero2-overlap"] == ["deepspeed_zero2.yaml", "deepspeed_zero2.yaml+no-overlap"]
    assert configs[2, "fsdp-units"] == ["fsdp.yaml", "fsdp.yaml+one-unit"]
    assert (configs[1, "zero2-overlap"], configs[1, "fsdp-units"]) == (["deepspeed_zero2.yaml"], ["fsdp.yaml"])
    # ZeRO-2 without overlap: the JSON copy differs in overlap_comm (and the dtype the benchmark always sets)
    launch_args, _ = benchmark.config_launch("deepspeed_zero2.yaml+no-overlap", 2, True, "bf16", tmp_path)
    shipped = json.loads((REPO / "accelerate_configs" / "deepspeed_zero2.json").read_text())
    copy = json.loads(Path(launch_args[launch_args.index("--deepspeed_config_file") + 1]).read_text())
    assert copy["zero_optimization"].pop("overlap_comm") is False and shipped["zero_optimization"].pop("overlap_comm")
    assert {k: v for k, v in copy.items() if k not in ("bf16", "fp16")} == \
        {k: v for k, v in shipped.items() if k not in ("bf16", "fp16")}
    # FSDP as one unit: the YAML copy differs in the wrap policy only
    launch_args, _ = benchmark.config_launch("fsdp.yaml+one-unit", 2, True, "bf16", tmp_path)
    copy = yaml.safe_load(Path(launch_args[launch_args.index("--config_file") + 1]).read_text())
    shipped = yaml.safe_load((REPO / "accelerate_configs" / "fsdp.yaml").read_text())
    assert copy["fsdp_config"].pop("fsdp_auto_wrap_policy") == "NO_WRAP"
    assert shipped["fsdp_config"].pop("fsdp_auto_wrap_policy") == "TRANSFORMER_BASED_WRAP" and copy == shipped
    assert gpu_table.peak_tflops_for("NVIDIA H100 PCIe") == 756 and gpu_table.peak_tflops_for("NVIDIA H100 80GB HBM3") \
        == 989
    assert [p.folder for p in gpu_table.selected(["fsdp-units", "gpt"])] == ["gpt", "fsdp-units"]  # PARTS' order
    # every part is built now (QLoRA's came last), and a part to come would be listed, never run: no command
    assert [p.folder for p in gpu_table.PARTS if p.missing] == []
    to_come = [dataclasses.replace(p, missing="not yet") if p.folder == "finetune-qlora" else p
               for p in gpu_table.PARTS]
    assert [f for f, _ in gpu_table.part_commands(tmp_path, 756.0, INPUTS, 2, to_come)] == \
        [f for f in TABLE if f != "finetune-qlora"]
    with pytest.raises(ValueError, match="no such part: nope"):
        gpu_table.selected(["nope"])


def test_gpu_table_runs_are_accepted_by_their_scripts(tmp_path, monkeypatch):
    """Every run of every part, as the benchmark will launch it on a GPU, parses with its script's own parser (the
    recipe's, or bench/lean_loop.py's): a misspelt or missing flag fails here rather than on the GPU. The fine-tune
    parts pass --packing or --no-packing, recipes/finetune_lm.py's flag of issue "Fine-tune at H100 speed"."""
    import importlib

    import torch
    benchmark, gpu_table = gpu_table_modules()
    sys.path.insert(0, str(REPO / "recipes"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # parsed as on the GPU (lean loop: --device cuda)
    scripts = set()
    for folder, cmd in gpu_table.part_commands(tmp_path, 756.0, INPUTS, 2):
        args = benchmark.parse_args(cmd[2:])
        benchmark.add_single_process_run(args, True)
        for name, _, run_cmd, _ in benchmark.plan_runs(args, 2, True, tmp_path / "synthetic-20000-2000"):
            script = next(arg for arg in run_cmd if arg.endswith(".py"))
            argv = run_cmd[run_cmd.index(script) + 1:] + ["--output-dir", str(tmp_path / "run")]
            try:
                importlib.import_module(Path(script).stem).parse_args(argv)
            except SystemExit:
                pytest.fail(f"{folder}: {name}: {Path(script).name} refuses {' '.join(argv)}")
            scripts.add(Path(script).name)
    assert scripts == {"mnist.py", "gpt.py", "resnet.py", "finetune_lm.py", "dpo.py", "lean_loop.py"}


def test_gpu_table_warms_each_compiled_run_with_its_own_command(tmp_path, monkeypatch):
    """The warm-up runs every compiled run of the table (and no other) with the command its part will measure it
    with, for fewer steps: the same model, batch, precision and config, so the same graphs in inductor's caches."""
    benchmark, gpu_table = gpu_table_modules()
    data_root = tmp_path / "synthetic-20000-2000"
    monkeypatch.setattr(benchmark, "mnist_data_root", lambda args: data_root)  # nothing written in the repository
    commands = gpu_table.part_commands(tmp_path, 756.0, INPUTS, 1)
    warms = gpu_table.warm_plan(commands, gpu_table.PARTS, tmp_path, threads=16, cores=16)
    compiled = ["1gpu_compile.yaml", "lean loop (compiled)"]
    assert [(w.part, w.name) for w in warms] == [("finetune-full", compiled[0]), ("finetune-lora", compiled[0])] + [
        (part, compiled[0]) for part in LONG_PARTS] + [("finetune-fp8", c) for c in ("fsdp_fp8.yaml",
                                                                                     "fsdp_fp8.yaml+bf16")] + [
        ("gpt", c) for c in compiled] + [
        ("mnist", c) for c in compiled] + [("resnet", compiled[0])]
    steps = {"--max-steps", "--eval-every", "--epochs", "--steps", "--warmup-steps", "--main_process_port"}

    def without_steps(cmd):  # the flags that count steps (and the launch's free port) taken out with their values
        return [arg for i, arg in enumerate(cmd) if arg not in steps and (i == 0 or cmd[i - 1] not in steps)]
    for warm in warms:
        args = benchmark.parse_args(dict(commands)[warm.part][2:])
        measured = {name: cmd for name, _, cmd, _ in benchmark.plan_runs(args, 1, True, data_root)}[warm.name]
        assert warm.cmd[-2] == "--output-dir" and Path(warm.cmd[-1]).parent == tmp_path / "warm"
        assert without_steps(warm.cmd[:-2]) == without_steps(measured), warm.name
        count = {flag: int(warm.cmd[warm.cmd.index(flag) + 1]) for flag in steps - {"--main_process_port"}
                 if flag in warm.cmd}
        assert count.get("--max-steps", count.get("--warmup-steps", 0) + count.get("--steps", 0)) == \
            gpu_table.WARM_STEPS, (warm.name, count)
        assert warm.env["OMP_NUM_THREADS"] == "16"  # the cores for 2 at a time: inductor's workers share them
        assert warm.env["TORCHINDUCTOR_COMPILE_THREADS"] == str(16 // gpu_table.WARM_AT_ONCE) == "8"
        assert warm.gb == next(p.warm_gb for p in gpu_table.PARTS if p.folder == warm.part) > 0


# A warm-up stand-in that takes a lock file for a moment: it fails if another holds it (two ran at once).
HOLD_LOCK = ("import os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); time.sleep(0.3); "
             "os.close(fd); os.unlink(sys.argv[1])")


COUNT_RUNNING = ("import os, sys, time; me = os.path.join(sys.argv[1], str(os.getpid())); open(me, 'w').close(); "
                 "time.sleep(0.4); open(sys.argv[2], 'w').write(str(len(os.listdir(sys.argv[1])))); os.unlink(me)")


def test_gpu_table_warm_up_keeps_within_the_memory_cap(tmp_path):
    """Warm-ups whose memory estimates do not fit together never run together, and never more than at_once
    (WARM_AT_ONCE: not six compiles at once); all of them run, and each one's end is reported (a failure is
    reported, not raised)."""
    _, gpu_table = gpu_table_modules()
    lock = str(tmp_path / "gpu")
    warms = [gpu_table.Warm("p", f"run {i}", [sys.executable, "-c", HOLD_LOCK, lock, str(tmp_path / f"w{i}")], {}, 30)
             for i in range(3)]
    warms.append(gpu_table.Warm("p", "broken", [sys.executable, "-c", "raise SystemExit(3)", str(tmp_path / "b")],
                                {}, 1))
    ended = gpu_table.warm_up(warms, cap_gb=50, limit_s=120, log_dir=tmp_path / "logs")
    assert ended == {"p: run 0": "warmed", "p: run 1": "warmed", "p: run 2": "warmed", "p: broken": "failed (3)"}
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["b.log", "w0.log", "w1.log", "w2.log"]
    # Small ones that would all fit: still at most WARM_AT_ONCE at a time (each counts those running beside it)
    running = tmp_path / "running"
    running.mkdir()
    warms = [gpu_table.Warm("p", f"small {i}", [sys.executable, "-c", COUNT_RUNNING, str(running),
                                                str(tmp_path / f"seen{i}")], {}, 1) for i in range(4)]
    assert set(gpu_table.warm_up(warms, cap_gb=50, limit_s=120, log_dir=tmp_path / "logs", at_once=2).values()) == \
        {"warmed"}
    assert max(int((tmp_path / f"seen{i}").read_text()) for i in range(4)) <= 2


def test_gpu_table_part_stopped_at_the_budget(tmp_path):
    """A part still running when the table's budget is spent is stopped, its whole process group with it; a part
    whose turn comes after that is not started."""
    _, gpu_table = gpu_table_modules()
    child = tmp_path / "child.pid"
    part = [sys.executable, "-c", "import subprocess, sys, time; "
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(600)"]
    log = tmp_path / "part.log"
    assert gpu_table.run_part(part, seconds_left=1, log_path=log, grace_s=1) == "not run: the table's budget was spent"
    assert gpu_table.run_part(part, seconds_left=3, log_path=log, grace_s=1).startswith("stopped at the table's budget")
    pid = int(child.read_text())

    def gone():  # exited (a zombie until its new parent reaps it) or reaped
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True
    deadline = time.monotonic() + 30  # the signal is delivered at once; this only waits for the exit to finish
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(), f"the part's child {pid} outlived the stop"


def test_benchmark_stopped_by_sigterm_reports_the_runs_done(tmp_path):
    """SIGTERM (the GPU table's budget) ends the benchmark's plan after the run it interrupted: that run is reported
    as it ended, the others as not run, so the report of what was measured is still written."""
    benchmark, _ = gpu_table_modules()
    (tmp_path / "logs").mkdir()
    stop_me = [sys.executable, "-c", "import os, signal; os.kill(os.getppid(), signal.SIGTERM)"]
    results = benchmark.measure_all([("first", 0, stop_me, {}), ("second", 0, stop_me, {})], tmp_path, 1)
    assert [r["name"] for r in results] == ["first", "second"]
    assert results[0]["exit_code"] == 0 and "failed" in results[0]  # it wrote no summary.json
    assert results[1]["failed"] == "not run: the benchmark was stopped (SIGTERM)"
    assert signal.getsignal(signal.SIGTERM) is not None  # the handler it replaced is back


def test_gpu_table_readme_compares_the_fine_tunes(tmp_path):
    """table.md's fine-tune comparisons are the ratios of the rows they name, each with its goal and whether it was
    met (issue "Fine-tune at H100 speed", issue 42 item 3); each part's time and how each part ended are listed."""
    _, gpu_table = gpu_table_modules()

    def row(name, rate, mfu, padding):
        return {"name": name, "processes": 1, "unit": "tokens_per_s", "throughput": rate, "mfu": mfu,
                "step_ms": 8192e3 / rate, "peak_memory_mb_per_rank": [30000.0], "padding_share": padding}

    def report(*rows):
        return {"table": list(rows), "ratios": {}, "hardware": {"label": "1 x H100", "host": "h", "torch": "2.11"}}
    eager, compiled = "1gpu.yaml", "1gpu_compile.yaml"
    reports = {"finetune-full": report(row(eager, 50000, 0.30, 0.01), row(compiled, 80000, 0.52, 0.01)),
               "finetune-lora": report(row(eager, 80000, 0.25, 0.01), row(compiled, 116000, 0.4, 0.01)),
               "finetune-padded": report(row(eager, 20000, 0.12, 0.72)),
               "finetune-lora-zero3": report(row("deepspeed_zero3.yaml", 60000, 0.2, 0.01))}
    progress = {"statuses": {"finetune-full": "done", "finetune-lora": "done", "finetune-padded": "done",
                             "finetune-lora-zero3": "done", "finetune-qlora": "not built yet: no QLoRA",
                             "zero2-overlap": "not reached: 10 s of the budget left, it needs about 25 s"},
                "timings": {"inputs": 12.0, "warm-up (fine-tune)": 95.0, "finetune-full": 70.4}, "gpus": 1,
                "facts": {"chats": {"conversations": 2000, "median_tokens": 199, "mean_tokens": 289.3, "longest": 2009,
                                    "over_1024": 0.015}},
                "warm": {f"finetune-full: {compiled}": "warmed", f"finetune-lora: {compiled}": "failed (1)"}}
    text = gpu_table.markdown(reports, "NVIDIA H100", "2026-11-25", 989.0, progress)
    assert "| finetune-padded | 1gpu.yaml | 1 | 20000 tokens/s | 12.0% | 409.6 | 30000 | 72% | - |" in text
    assert "LoRA / full (real tokens/s): eager 1.600 (goal >= 1.5: met), compiled 1.450 (goal >= 1.5: NOT met)" in text
    assert "packed / padded (real tokens/s, full fine-tune, eager): 2.500 (goal >= 2: met)" in text
    assert "compiled full fine-tune MFU: 52.0% (goal >= 50%: met)" in text
    assert "ZeRO-3 LoRA / LoRA without an engine (one process, eager): 0.750 (goal >= 0.8: NOT met)" in text
    assert "compile speed-up (1gpu_compile.yaml / 1gpu.yaml): full 1.600, LoRA 1.450" in text
    assert "2000 conversations, median 199 tokens, mean 289, longest 2009, 1.5% longer than the block" in text
    assert "Time (s): inputs 12, warm-up (fine-tune) 95, finetune-full 70." in text
    assert "Compile warm-up: 1 of 2 compiled runs warmed the caches; finetune-lora: 1gpu_compile.yaml: failed (1)." \
        in text
    assert "- finetune-qlora: not built yet: no QLoRA" in text
    assert "- zero2-overlap: not reached: 10 s of the budget left, it needs about 25 s" in text
    # a part not measured: its goal says so rather than passing or failing
    del reports["finetune-padded"]
    assert "packed / padded (real tokens/s, full fine-tune, eager): - (goal >= 2: not measured)" in \
        gpu_table.markdown(reports, "NVIDIA H100", "2026-11-25", 989.0, progress)


def test_gpu_table_writes_a_llama_and_uneven_chats(tmp_path):
    """The fine-tune inputs (here a tiny shape on the CPU; the table's is LLAMA_1B on the GPU): a Llama that
    from_pretrained loads with the asked shape, the tests' tokenizer with its chat template, and chats whose
    lengths spread (most short, a few over the block)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    _, gpu_table = gpu_table_modules()
    assert gpu_table.LLAMA_1B | {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                                 "num_key_value_heads": 8} == gpu_table.LLAMA_1B
    shape = {**gpu_table.LLAMA_1B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2}
    paths, facts = gpu_table.write_finetune_inputs(tmp_path, shape=shape, device="cpu")
    model = AutoModelForCausalLM.from_pretrained(paths["llama"])
    assert model.dtype == torch.bfloat16 and model.config.num_key_value_heads == 2 and model.config.hidden_size == 64
    tokenizer = AutoTokenizer.from_pretrained(paths["llama"])
    assert "{% generation %}" in tokenizer.get_chat_template() and len(tokenizer) == model.config.vocab_size
    chats = [json.loads(line) for line in paths["chats"].read_text().splitlines()]
    assert len(chats) == facts["conversations"] == gpu_table.CHATS
    assert all(m["role"] in ("system", "user", "assistant") for c in chats for m in c["messages"])
    assert 100 < facts["median_tokens"] < facts["mean_tokens"] < 1024 < facts["longest"]  # a long tail
    assert 0 < facts["over_1024"] < 0.05


def test_a_cpu_benchmark_launches_deepspeed_and_fsdp_through_the_cpu_route(tmp_path):
    """On a CPU the benchmark launches the configs whose engine ACCELERATE_USE_CPU=1 would turn off (DeepSpeed,
    FSDP2: the engines say which) with cpu_route/ on PYTHONPATH, and every other config with ACCELERATE_USE_CPU=1."""
    benchmark, _ = gpu_table_modules()
    routes = {}
    for config in ["cpu.yaml", *benchmark.MULTI_PROCESS_CONFIGS]:
        _, env = benchmark.config_launch(config, 2, False, "no", tmp_path / config)
        routes[config] = "cpu_route" if str(benchmark.CPU_SHIM) in env.get("PYTHONPATH", "").split(os.pathsep) \
            else env.get("ACCELERATE_USE_CPU")
    assert routes == {"cpu.yaml": "1", "2gpu.yaml": "1", "deepspeed_zero1.yaml": "cpu_route",
                      "deepspeed_zero2.yaml": "cpu_route", "deepspeed_zero3.yaml": "cpu_route",
                      "deepspeed_zero3_offload.yaml": "cpu_route", "fsdp.yaml": "cpu_route"}
