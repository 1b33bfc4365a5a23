"""bench/: the DDP-by-hand baseline trains the recipe's model, and benchmark.py plans its runs and writes
a report whose every figure is the runs' own (tiny sizes; no timing is asserted)."""

import json
import subprocess
import sys
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

@pytest.mark.slow
def test_benchmark_smoke_writes_the_report(tmp_path):
    """Tiny sizes; what is checked is the report, never a timing. The config list has no 1-process run, so the
    benchmark adds cpu.yaml for the lean loop (bench/lean_loop.py) to be compared with."""
    out = tmp_path / "report"
    code, output = run_command([sys.executable, "bench/benchmark.py", "--steps", "6", "--train-size", "512",
                                "--test-size", "64", "--log-every", "2", "--configs", "2gpu.yaml",
                                "deepspeed_zero2.yaml", "--data-dir", str(tmp_path / "data"), "--out", str(out)],
                               timeout=900)
    assert code == 0, output[-4000:]
    report = json.loads((out / "results.json").read_text())
    names = [row["name"] for row in report["table"]]
    ddp, tensor, course = "2gpu.yaml", "ddp-by-hand (tensor pipeline)", "ddp-by-hand (per-sample ToTensor)"
    single, lean = "cpu.yaml", "lean loop"
    assert names == [course, tensor, single, ddp, "deepspeed_zero2.yaml", lean]
    assert report["settings"]["added_for_lean"] == [single] and report["settings"]["on_gpu"] is False
    batch = report["settings"]["batch_size"]
    assert batch == 128  # the MNIST default global batch; the recipe and the baselines take it whole per step
    # One round: every table row is one run, so it must carry that run's figures exactly (no median to blur them).
    runs = {r["name"]: r for r in report["runs"]}
    assert sorted(runs) == sorted(names) and all(r["repeat"] == 0 for r in report["runs"])
    summaries = {name: json.loads((out / "runs" / Path(runs[name]["log"]).stem / "summary.json").read_text())
                 for name in names}  # each run's own summary.json (the run folder is named after its log)
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
        # The timers (recipes/runkit/timing.py, bench/ddp_baseline.py) define, over the same steady micro-batches
        # m and their total time T: throughput = m x global batch / T, each phase's ms = 1000 x its time / m, and
        # data_fraction = data time / T. So throughput x step time = the global batch, and data_fraction = data_ms /
        # step_ms, up to float rounding alone (1e-9 relative is a million times that): a step time or a
        # throughput taken from anything else (one rank's batch, the whole-run rate, a phase left out) breaks it.
        assert row["throughput"] * row["step_ms"] / 1000 == pytest.approx(batch, rel=1e-9), row
        assert row["data_fraction"] == pytest.approx(row["data_ms"] / row["step_ms"], rel=1e-9), row
    engines = {row["name"]: (row["engine"], row["zero_stage"]) for row in report["table"]}
    assert engines[ddp] == ("MULTI_CPU", None) and engines["deepspeed_zero2.yaml"] == ("DEEPSPEED", 2)
    assert engines[single] == ("NO", None) and engines[lean] == ("lean loop", None)
    # The lean loop, from its own summary.json: its timed region of m steps and T seconds gives step_ms = 1000 T / m
    # and throughput = m x batch / T; the data are on the device (no wait) and the phases are one region (null).
    # It ran what the recipe's 1-process run ran: the same model (parameter count), batch, precision, no compile,
    # as many steps (warm-up included) on the same device.
    lean_summary, lean_timing = summaries[lean], summaries[lean]["timing"]
    lean_step_ms = 1000 * lean_timing["timed_s"] / lean_timing["micro_batches"]
    assert runs[lean]["step_ms"] == pytest.approx(lean_step_ms, rel=1e-12)
    assert lean_timing["samples_per_s"] == pytest.approx(
        lean_timing["micro_batches"] * batch / lean_timing["timed_s"], rel=1e-12)
    assert lean_timing["micro_batches"] + lean_timing["warmup_steps"] == report["settings"]["steps"] == 6
    phases = ("data_ms", "forward_backward_ms", "optimizer_ms", "other_ms")
    assert [lean_timing[phase] for phase in phases] == [0.0, None, None, 0.0]
    assert lean_summary["param_elements"] == summaries[single]["param_elements"] > 0
    assert [lean_summary[key] for key in ("model", "batch_size", "mixed_precision", "compile", "device",
                                          "optimizer_implementation")] == ["mnist", batch, "no", False, "cpu", "fused"]
    assert runs[ddp]["other_ms"] > 0 and runs[tensor]["other_ms"] == 0  # the recipe's bookkeeping; none by hand
    # The three ratios, recomputed from the rows they are built from (bench/benchmark.py ratios())
    by = {row["name"]: row for row in report["table"]}
    ratios = report["ratios"]
    assert set(ratios) == {"accelerate_overhead", "data_wait_share", "throughput_vs_ddp", "recipe_vs_lean"}
    overhead = ratios["accelerate_overhead"]  # step time, recipe under 2gpu.yaml / DDP by hand, same pipeline
    assert overhead["per_round"] == pytest.approx([runs[ddp]["step_ms"] / runs[tensor]["step_ms"]], rel=1e-12)
    assert overhead["value"] == pytest.approx(overhead["per_round"][0], rel=1e-12)
    assert overhead["met"] == (overhead["value"] <= 1.03)
    share = ratios["data_wait_share"]  # the recipe's data wait vs the course-style pipeline's
    assert (share["value"], share["course_baseline"]) == (by[ddp]["data_fraction"], by[course]["data_fraction"])
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
    """--gpu-table measures GPUs: here it says so, exits 2 and writes nothing."""
    code, output = run_command([sys.executable, "bench/benchmark.py", "--gpu-table", "--out", str(tmp_path / "r")],
                               env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert code == 2, output[-3000:]
    assert "error: --gpu-table measures GPUs and this machine has no CUDA device" in output
    assert not (tmp_path / "r").exists()


def test_gpu_table_plans_every_comparison(tmp_path, monkeypatch):
    """Each part of the GPU table is one benchmark run whose arguments the benchmark accepts; the two variants
    differ from their shipped config in the one key they name, and nothing else."""
    import yaml
    sys.path.insert(0, str(REPO / "bench"))
    import benchmark
    runs = dict(benchmark.gpu_table_runs(tmp_path, 756.0, tmp_path / "images"))
    assert list(runs) == ["mnist", "gpt", "resnet", "zero2-overlap", "fsdp-units"]
    configs = {}
    for folder, cmd in runs.items():
        monkeypatch.setattr(sys, "argv", cmd[1:])
        args = benchmark.parse_args()  # exits on an unknown config, variant or flag
        assert args.mixed_precision == "bf16" and Path(args.out) == tmp_path / folder
        configs[folder] = args.configs
        if args.recipe == "gpt":
            assert "--peak-tflops 756" in args.recipe_args
    assert configs["mnist"] == configs["gpt"] == configs["resnet"] == ["1gpu.yaml", "1gpu_compile.yaml"]
    assert configs["zero2-overlap"] == ["deepspeed_zero2.yaml", "deepspeed_zero2.yaml+no-overlap"]
    assert configs["fsdp-units"] == ["fsdp.yaml", "fsdp.yaml+one-unit"]
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
    assert benchmark.peak_tflops_for("NVIDIA H100 PCIe") == 756 and benchmark.peak_tflops_for("NVIDIA H100 80GB HBM3") \
        == 989
