"""Measurement and checks before a job: --report-to / --profile in the recipes, bench/, launch/check_config.py,
launch/preflight.py (3 CPU processes, hand-made broken launches, and a real 2-node Slurm job)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CONFIG_DIR, CONFIG_FILES, REPO, free_port, launch_command, run_command

sys.path.insert(0, str(REPO / "launch"))
import check_config  # noqa: E402
import slurm_launch  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tensorboard_scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tags = set()
    for events in Path(log_dir).rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events.parent))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    return tags


def tensorboard_series(log_dir, tag):
    """[(step, value)] of one scalar as TensorBoard reads it back, in the order it was written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    points = []
    for folder in sorted({events.parent for events in Path(log_dir).rglob("events.out.tfevents.*")}):
        accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            points += [(event.step, event.value) for event in accumulator.Scalars(tag)]
    return points


def assert_same_series(log_dir, metrics_path, key):
    """The tracker got metrics.jsonl's `key`, step by step (TensorBoard keeps float32: 1e-6 relative)."""
    logged = [(r["step"], r[key]) for r in map(json.loads, metrics_path.read_text().splitlines()) if key in r]
    read_back = tensorboard_series(log_dir, key)
    assert len(logged) >= 2 and [step for step, _ in read_back] == [step for step, _ in logged], (read_back, logged)
    assert [value for _, value in read_back] == pytest.approx([value for _, value in logged], rel=1e-6), \
        (read_back, logged)


# matplotlib's default cycle (tab:blue, tab:orange, tab:green) and the bench chart's tab:red / tab:purple
TAB_BLUE, TAB_ORANGE, TAB_GREEN = (31, 119, 180), (255, 127, 14), (44, 160, 44)
TAB_RED, TAB_PURPLE = (214, 39, 40), (148, 103, 189)


def assert_drawn_png(path, size, colours):
    """A PNG that decodes, of the figure's size (figsize x dpi 100), not blank, and with at least 50 pixels
    of each of `colours` (within antialiasing distance): the curves and bars were really drawn."""
    import numpy as np
    from PIL import Image
    assert path.read_bytes().startswith(PNG_MAGIC)
    with Image.open(path) as image:
        image.load()
        assert image.size == size, (path, image.size)
        pixels = np.asarray(image.convert("RGB"), dtype=np.int16).reshape(-1, 3)
    white = (pixels == 255).all(axis=1)
    assert len(np.unique(pixels, axis=0)) > 16 and (~white).mean() > 0.02, f"{path} is (nearly) blank"
    for colour in colours:
        near = (np.abs(pixels - np.array(colour)).max(axis=1) <= 24).sum()
        assert near >= 50, f"{path}: only {near} pixels of colour {colour}"


def traces(out_dir):
    """{rank: events} of the torch.profiler traces a run wrote."""
    found = {}
    for path in (out_dir / "profile").glob("rank*.pt.trace.json"):
        found[int(path.name.split(".")[0][4:])] = json.loads(path.read_text())["traceEvents"]
    return found


# --- the recipes: TensorBoard, curves.png, profiler traces, the step split -----------------------

@pytest.mark.slow
def test_mnist_reports_to_tensorboard_and_profiles_every_rank(launch):
    run = launch("deepspeed_zero2.yaml", "--epochs", "2", "--batch-size", "200", "--log-every", "2",
                 "--report-to", "tensorboard", "--profile", "2", launch_args=("--mixed_precision", "no"))
    tags = tensorboard_scalars(run.out_dir / "tensorboard")
    assert {"loss", "lr", "samples_per_s", "data_ms", "forward_backward_ms", "optimizer_ms", "other_ms", "data_fraction",
            "test_accuracy", "test_loss"} <= tags, tags
    assert_same_series(run.out_dir / "tensorboard", run.out_dir / "metrics.jsonl", "loss")
    # figsize (11, 4) at dpi 100: the loss panel (train loss in blue, test loss in orange) and the accuracy panel
    assert_drawn_png(run.out_dir / "curves.png", (1100, 400), [TAB_BLUE, TAB_ORANGE])
    evals = [json.loads(line) for line in (run.out_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [10, 20] and evals[-1]["test_accuracy"] == run.summary["test_accuracy"]
    by_rank = traces(run.out_dir)
    assert sorted(by_rank) == [0, 1]  # every rank traced its own steps
    for events in by_rank.values():
        steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#2", "ProfilerStep#3"}, steps  # one skipped, one warm-up, 2 recorded
    timing = run.summary["timing"]
    assert timing["micro_batches"] == 19 and timing["optimizer_in_backward"] is True  # DeepSpeed steps in backward
    assert timing["forward_backward_ms"] > 0 and timing["other_ms"] > 0 and timing["samples_per_s"] > 0
    assert len(run.summary["peak_memory_mb_per_rank"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("recipe, args, tags, size, colours", [
    # curves.png: figsize (6, 4) with the loss panel only, (11, 4) with an accuracy panel; dpi 100
    ("linear_regression", ["--epochs", "1", "--num-points", "128"], {"batch_loss", "lr", "m", "n"}, (600, 400),
     [TAB_BLUE]),
    ("gpt", ["--preset", "tiny", "--max-steps", "6", "--batch-size", "8", "--log-every", "1", "--eval-every", "3",
             "--eval-batches", "2", "--sample-tokens", "0"],
     {"loss", "lr", "tokens_per_s", "data_ms", "forward_backward_ms", "optimizer_ms", "val_loss"}, (600, 400),
     [TAB_BLUE, TAB_ORANGE]),
    ("resnet", ["--image-size", "16", "--batch-size", "16", "--epochs", "2", "--num-workers", "1", "--log-every", "1"],
     {"loss", "lr", "samples_per_s", "data_ms", "forward_backward_ms", "optimizer_ms", "val_accuracy"}, (1100, 400),
     [TAB_BLUE]),
    ("finetune_lm", ["--block-size", "32", "--max-steps", "6", "--batch-size", "8", "--log-every", "1", "--eval-every",
                     "3", "--eval-batches", "2", "--sample-tokens", "0"],
     {"loss", "lr", "tokens_per_s", "data_ms", "forward_backward_ms", "optimizer_ms", "val_loss"}, (600, 400),
     [TAB_BLUE, TAB_ORANGE]),
])
def test_every_training_recipe_reports_and_profiles(recipe, args, tags, size, colours, tmp_path):
    from image_folder import write_image_folder
    if recipe == "gpt":
        (tmp_path / "corpus.txt").write_text("\n".join(f"line {i} of a small corpus {i * 7 % 11}" for i in range(800)))
        args = [*args, "--data-files", str(tmp_path / "corpus.txt")]
    if recipe == "resnet":
        args = [*args, "--data-dir", str(write_image_folder(tmp_path / "images", 16, 4, size=16))]
    if recipe == "finetune_lm":
        from tiny_hf import write_all
        hf = write_all(tmp_path / "hf")
        args = [*args, "--model", str(hf / "model"), "--data-files", str(hf / "pairs.jsonl")]
    out = tmp_path / "out"
    code, output = run_command([sys.executable, f"recipes/{recipe}.py", *args, "--output-dir", str(out),
                                "--report-to", "tensorboard", "--profile", "2"])
    assert code == 0, output[-3000:]
    assert tags <= tensorboard_scalars(out / "tensorboard")
    loss_key = "batch_loss" if recipe == "linear_regression" else "loss"
    assert_same_series(out / "tensorboard", out / "metrics.jsonl", loss_key)
    assert_drawn_png(out / "curves.png", size, colours)
    assert list(traces(out)) == [0]
    summary = json.loads((out / "summary.json").read_text())
    if recipe != "linear_regression":  # the SGD lab gathers (m, n) every step: its timing would mean nothing
        assert summary["timing"]["micro_batches"] > 0 and summary["timing"]["optimizer_ms"] > 0


def test_unknown_report_target_is_one_line():
    out = subprocess.run([sys.executable, "recipes/mnist.py", "--report-to", "wandb"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "invalid choice: 'wandb'" in out.stderr


# --- bench/ --------------------------------------------------------------------------------------

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
        ours.train(train), theirs.train(train)
        expected, got = ours(images), theirs(images)
        assert expected.shape == (6, 10)
        torch.testing.assert_close(got, expected, msg=lambda m: f"train={train}: {m}")
    # train mode updated BatchNorm's running statistics alike (same momentum, eps, layers)
    torch.testing.assert_close(theirs.state_dict(), ours.state_dict())


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
    assert runs[lean]["step_ms"] == pytest.approx(1000 * lean_timing["timed_s"] / lean_timing["micro_batches"], rel=1e-12)
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
    assert [benchmark.lean_name(benchmark.lean_key(c, True), True) for c in ("1gpu.yaml", "1gpu_compile.yaml", "cpu.yaml")] \
        == list(leans)
    # resnet has no lean loop, and --no-lean turns it off
    for added, configs, runs in (plan(["2gpu.yaml"], on_gpu=False, recipe="resnet"),
                                 plan(["2gpu.yaml"], on_gpu=False, no_lean=True)):
        assert added == [] and configs == ["2gpu.yaml"] and [name for name, _ in runs] == ["2gpu.yaml"]


def test_benchmark_refuses_an_unknown_config(tmp_path):
    out = subprocess.run([sys.executable, "bench/benchmark.py", "--configs", "nope.yaml", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no such config in accelerate_configs/: nope.yaml" in out.stderr


# --- launch/check_config.py ----------------------------------------------------------------------

@pytest.mark.parametrize("config", CONFIG_FILES)
def test_every_shipped_config_passes(config):
    for recipe in ("recipes/mnist.py", "recipes/gpt.py", None):
        errors, notes = check_config.check(str(CONFIG_DIR / config), recipe)
        assert errors == [], errors
        assert not [n for n in notes if n.startswith("warning:")], notes  # no key that accelerate ignores


def test_keys_accelerate_ignores_are_warned_about(tmp_path):
    """accelerate launch applies a top-level key only when its command-line option defaults to None:
    rdzv_backend and same_network (once in multinode.yaml) never reached the launch."""
    config = tmp_path / "multi.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\n"
                      "rdzv_backend: c10d\nsame_network: false\nmain_process_port: 29500\n")
    errors, notes = check_config.check(str(config))
    warned = sorted(n.split(": ")[2] for n in notes if n.startswith("warning:"))
    assert errors == [] and warned == ["rdzv_backend", "same_network"], notes
    assert "--rdzv_backend has its own default ('static')" in " ".join(notes)


DS_YAML = ("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_machines: 1\nnum_processes: 2\n"
           "{mixed}deepspeed_config:\n{deepspeed}")
WITH_JSON = "  deepspeed_config_file: ds.json\n"


@pytest.mark.parametrize("yaml_text, ds_json, recipe, key, fix", [
    # auto values that need a hidden_size
    (DS_YAML.format(mixed="", deepspeed=WITH_JSON), {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}},
     None, "zero_optimization.stage3_prefetch_bucket_size", "write a number"),
    # an optimizer / scheduler block forces DummyOptim / DummyScheduler
    (DS_YAML.format(mixed="", deepspeed=WITH_JSON), {"zero_optimization": {"stage": 2},
                                                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
     None, "optimizer: a DeepSpeed optimizer block", "delete the \"optimizer\" block"),
    (DS_YAML.format(mixed="", deepspeed=WITH_JSON), {"zero_optimization": {"stage": 2},
                                                     "scheduler": {"type": "WarmupLR"}},
     None, "scheduler: a DeepSpeed scheduler block", "delete the \"scheduler\" block"),
    # offload with a torch optimizer that is not Adam
    (DS_YAML.format(mixed="", deepspeed="  zero_stage: 2\n  offload_optimizer_device: cpu\n"), None,
     "recipes/linear_regression.py", "offload_optimizer_device", "zero_force_ds_cpu_optimizer"),
    # stage-3 options on stage 1 / 2
    (DS_YAML.format(mixed="", deepspeed="  zero_stage: 2\n  offload_param_device: cpu\n"), None,
     None, "deepspeed_config.offload_param_device", "set zero_stage: 3"),
    (DS_YAML.format(mixed="", deepspeed=WITH_JSON), {"zero_optimization": {"stage": 1, "stage3_max_live_parameters": 1e9}},
     None, "zero_optimization.stage3_max_live_parameters", "set \"stage\": 3"),
    # mixed precision that disagrees between the YAML and the JSON
    (DS_YAML.format(mixed="mixed_precision: bf16\n", deepspeed=WITH_JSON),
     {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}, None,
     "mixed_precision: the YAML says bf16 but the DeepSpeed JSON says fp16", "remove mixed_precision from the YAML"),
    # ... and even when they agree, accelerate refuses the YAML key next to a JSON
    (DS_YAML.format(mixed="mixed_precision: bf16\n", deepspeed=WITH_JSON),
     {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, None,
     "mixed_precision: set in the YAML next to deepspeed_config_file", "remove mixed_precision from the YAML"),
    # accelerate's own loader and YAML syntax
    ("distributed_type: DEEPSPEED\nnum_processes: 2\nzero_stage: 2\n", None, None, "accelerate's loader rejects it",
     "remove or correct the key"),
    ("distributed_type: DEEPSPEED\n num_processes: 2\n", None, None, "not valid YAML (line 2", "indentation"),
])
def test_each_trap_is_rejected_with_its_key_and_fix(tmp_path, yaml_text, ds_json, recipe, key, fix):
    config = tmp_path / "broken.yaml"
    config.write_text(yaml_text)
    if ds_json is not None:
        (tmp_path / "ds.json").write_text(json.dumps(ds_json))
    cmd = [sys.executable, str(REPO / "launch" / "check_config.py"), str(config)]
    cmd += ["--recipe", str(REPO / recipe)] if recipe else []
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0] and "Fix: " in lines[0], lines
    assert fix in lines[0].split("Fix: ", 1)[1]


def test_offload_with_an_adam_recipe_passes_with_a_note():
    out = subprocess.run([sys.executable, "launch/check_config.py", "accelerate_configs/deepspeed_zero3_offload.yaml",
                          "--recipe", "recipes/gpt.py"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "DeepSpeedCPUAdam" in out.stdout and out.stdout.rstrip().endswith(": ok")


def test_slurm_launch_runs_the_check_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    env = {line.partition("=")[0]: line.partition("=")[2] for line in
           (REPO / "tests/fixtures/slurm_env/step_1node_1task.env").read_text().splitlines()}
    with pytest.raises(slurm_launch.LaunchError, match="replace recipes/resnet.py's torch.optim.SGD by DeepSpeedCPUAdam"):
        slurm_launch.plan(slurm_launch.parse_args(["accelerate_configs/deepspeed_zero3_offload.yaml", "recipes/resnet.py"]),
                          env, resolve=False)


# --- launch/preflight.py -------------------------------------------------------------------------

def preflight_by_hand(ranks, world_sizes, port, timeout=20):
    """Start preflight ranks as a launcher would, with their own (possibly wrong) environments."""
    procs = [subprocess.Popen([sys.executable, "launch/preflight.py", "--timeout", str(timeout), "--max-bytes", "4096"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ACCELERATE_USE_CPU="1"))
             for rank, world in zip(ranks, world_sizes)]
    results = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("preflight hung")
        results.append((proc.returncode, output))
    return results


@pytest.mark.slow
def test_preflight_on_three_cpu_processes(data_dir, tmp_path):
    """Three, not two: with n = 2 the bus bandwidth factor 2(n-1)/n is 1, and busbw = algbw would pass."""
    n = 3
    cmd, env = launch_command("2gpu.yaml", data_dir, tmp_path, recipe="launch/preflight.py",
                              launch_args=("--num_processes", str(n)))
    cmd = cmd[:cmd.index("launch/preflight.py") + 1] + ["--max-bytes", str(4 * 2**20)]
    code, output = run_command(cmd, env=env, timeout=300)
    assert code == 0, output[-3000:]
    rows = [line for line in output.splitlines() if line.startswith("rank ")]
    assert len(rows) == n and all("| cpu (cpu) |" in row and "OMP_NUM_THREADS=1" in row for row in rows), rows
    assert all(f"local rank {rank} |" in row for rank, row in enumerate(rows)), rows
    table = [line.split() for line in output.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in table] == [1024 * 2**i for i in range(11)] + [4 * 2**20]  # doubling, then x4
    factor = 2 * (n - 1) / n  # nccl-tests: busbw = algbw * 2(n-1)/n
    # Printed as %.1f us and %.3f GB/s: each figure is within half its last digit of the true one. That alone
    # bounds the differences below, whatever the speed of this (shared) machine; no timing is asserted.
    half_us, half_gbs = 0.05, 0.0005
    checked = []
    for size, micros, algbw, busbw in table:
        size, micros, algbw, busbw = int(size), float(micros), float(algbw), float(busbw)
        # algbw = bytes / time: between the bounds the printed time allows, widened by algbw's own rounding
        assert size / (micros + half_us) / 1e3 - half_gbs <= algbw <= size / (micros - half_us) / 1e3 + half_gbs, \
            (size, micros, algbw)
        if size >= 64 * 2**10:  # below, the figures are a few units of the last digit: the rounding would dominate
            assert abs(busbw - factor * algbw) <= half_gbs * (1 + factor) + 1e-9, (size, algbw, busbw, factor)
            checked.append(size)
    assert len(checked) == 6, checked
    assert f"preflight: ok, {n} ranks agree on world size {n} and backend gloo" in output


@pytest.mark.slow
def test_preflight_finds_a_gpu_launch_without_gpus(data_dir, tmp_path):
    cmd, env = launch_command("2gpu.yaml", data_dir, tmp_path, recipe="launch/preflight.py")
    cmd = cmd[:cmd.index("launch/preflight.py") + 1]
    env.pop("ACCELERATE_USE_CPU")
    code, output = run_command(cmd, env=env, timeout=300)
    assert code != 0
    assert "preflight: error: rank 0 on" in output and "sees no GPU" in output and "ACCELERATE_USE_CPU=1" in output


def test_preflight_world_sizes_that_disagree():
    (code0, out0), (code1, out1) = preflight_by_hand([0, 1], [2, 3], free_port())
    assert code0 == 1 and code1 == 1
    assert "rank 1 on" in out1 and "has world_size 3 but rank 0" in out1 and "has 2" in out1
    assert "rank 1 on" in out0 and "has world_size 3 but rank 0 has 2" in out0


def test_preflight_a_rank_that_cannot_reach_the_main_address():
    port = free_port()  # nobody listens there
    [(code, output)] = preflight_by_hand([1], [2], port, timeout=3)
    assert code == 1
    assert "preflight: error: rank 1 on" in output and f"cannot reach the main address 127.0.0.1:{port}" in output


def test_preflight_outside_a_launcher():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "launch/preflight.py"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and out.stderr.startswith("preflight: error: RANK is not set: run this under")


def test_stop_agreement_every_n_steps_and_never_without_signals():
    """--stop-check-every N: all ranks make the same calls, so all skip or all check; no signals, no collective."""
    import signal

    import torch
    sys.path.insert(0, str(REPO / "recipes"))
    from runkit.stopping import GracefulStop

    class OneRank:  # what agreed() uses of an Accelerator; counts the collectives
        device, reductions = torch.device("cpu"), 0

        def reduce(self, tensor, op):
            self.reductions += 1
            return tensor

    previous = signal.getsignal(signal.SIGUSR2)
    try:
        rank = OneRank()
        stopper = GracefulStop("USR2", check_every=3)
        stopper.received = "SIGUSR2"
        assert [stopper.agreed(rank) for _ in range(6)] == [False, False, True, False, False, True]
        assert rank.reductions == 2
        silent, rank = GracefulStop("", check_every=1), OneRank()
        assert not any(silent.agreed(rank) for _ in range(5)) and rank.reductions == 0
    finally:
        signal.signal(signal.SIGUSR2, previous)
