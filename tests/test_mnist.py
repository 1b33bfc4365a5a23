"""recipes/mnist.py: real multi-process launches under every config, on CPU (see launching.py's CPU route).

The launches refused by accelrun's start-up checks (refusals.py), made with mnist.py, are in test_refusals.py."""

import json
import math
import re
import sys

import pytest
import torch

from launching import (
    ALL_CONFIGS,
    CONFIG_DIR,
    DATA_ARGS,
    EXPECTED,
    TEST_SIZE,
    YAML_FILES,
    load_yaml,
    on_a_terminal,
    terminal_lines,
)

pytestmark = pytest.mark.slow

FP32 = ["--mixed_precision", "no"]  # exact comparisons need fp32; bf16 on CPU is also 7x slower
SHORT = ("--max-steps", "8", "--log-every", "1")


def test_every_config_has_an_expectation():
    """Every shipped YAML, the sequence-parallel one included (test_sequence_parallel.py reads its expectation)."""
    assert set(EXPECTED) == set(YAML_FILES)


@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_config_really_trains(launch, reference, config):
    """Each config trains (the fp32 reference run: 2 epochs of 10 steps, shared with the resume tests), and,
    as shipped, runs in the precision its YAML names (a 2-step smoke run: bf16 on a CPU is slow)."""
    run, _ = reference(config)
    s = run.summary
    dist_type, world, stage, sharded = EXPECTED[config]
    assert (s["distributed_type"], s["world_size"], s["deepspeed_stage"]) == (dist_type, world, stage)
    assert s["data_source"] == "synthetic" and "SYNTHETIC" in run.output
    # --data auto says why it fell back (here: the download failed, offline).
    assert re.search(r"DATA: SYNTHETIC digits .*not real MNIST: \w+", run.output), run.output[:2000]
    assert s["final_loss"] < 0.5 * s["first_loss"], s
    # Chance is 0.1; the 1-process run reaches about 0.8 in these 20 steps, and every config computes the same.
    single = reference("cpu.yaml")[0].summary["test_accuracy"]
    assert single >= 0.7 and abs(s["test_accuracy"] - single) <= 0.02, (s["test_accuracy"], single)
    assert s["test_samples"] == TEST_SIZE
    assert len(s["param_elements_per_rank"]) == world
    if sharded:  # ZeRO-3 / FSDP: every rank holds only a part of the weights
        assert all(n < s["param_elements"] for n in s["param_elements_per_rank"]), s
        assert sum(s["param_elements_per_rank"]) >= s["param_elements"]
    else:  # replicated: every rank holds the same, synchronised weights
        assert all(n == s["param_elements"] for n in s["param_elements_per_rank"]), s
        assert len(set(s["param_checksum_per_rank"])) == 1, s
    if config == "fsdp.yaml":
        # What each rank really holds, not how many units (the ConvNet is one unit under any wrap policy): FSDP2
        # cuts every parameter along its first dimension, so each rank's element count and checksum are those of
        # its pieces of the exported (gathered) weights. Weights left whole on each rank (no sharding) hold twice
        # the elements; pieces other than the rank's own (a wrong placement) give other checksums.
        elements, checksums = fsdp_shards(run.params(), world)
        assert s["param_elements_per_rank"] == elements, s
        assert s["param_checksum_per_rank"] == pytest.approx(checksums, rel=1e-9, abs=1e-9), s
    else:
        assert s["fsdp_units"] is None
    # Offload swaps the optimizer; the summary must say which one really ran.
    assert s["optimizer"] == ("DeepSpeedCPUAdam" if "offload" in config else "AdamW")
    # Each figure from its definition (docs/measuring.md, "Summary fields").
    assert s["data_fraction"] == pytest.approx(s["data_time_s"] / (s["data_time_s"] + s["compute_time_s"]))
    assert s["peak_memory_mb"] == max(s["peak_memory_mb_per_rank"]) and min(s["peak_memory_mb_per_rank"]) > 100
    assert s["peak_memory_reserved_mb_per_rank"] is None  # CUDA's allocator only
    samples = s["steps"] * 200  # the reference's global batch
    assert samples / s["wall_time_s"] <= s["samples_per_s"] <= samples / run.metrics[-1]["train_time_s"], s
    # The logged learning rate is the one the stepping optimizer holds: it must follow the cosine
    # decay under every config (with offload it once stayed at its peak).
    lrs = [m["lr"] for m in run.metrics]
    assert lrs[0] == pytest.approx(1e-3, rel=0.01) and lrs[-1] < 0.01 * lrs[0], lrs
    assert "SUMMARY " in run.output
    # The run ends by saying where its results went.
    results = [line for line in run.output.splitlines() if line.startswith("results: ")]
    assert len(results) == 1 and all(str(run.out_dir / f) in results[0] for f in (
        "summary.json", "metrics.jsonl", "eval.jsonl", "model.safetensors"))

    smoke = launch(config, "--max-steps", "2", "--log-every", "1")  # the YAML's own precision
    shipped = smoke.summary
    # model.safetensors is fp32 from every config (DeepSpeed's bf16 engines once exported bf16 weights).
    assert shipped["exported_dtype"] == "float32"
    assert {v.dtype for v in smoke.params().values() if v.is_floating_point()} == {torch.float32}
    assert shipped["mixed_precision"] == shipped_precision(config)
    if dist_type == "DEEPSPEED":  # the first line says that the JSON set bf16, and where fp32 is (issue 41, item 5)
        json_file = load_yaml(config)["deepspeed_config"]["deepspeed_config_file"]
        assert (f"mixed precision bf16 (set by {json_file}, not by --mixed_precision; fp32: --deepspeed_config_file "
                f"{json_file.replace('.json', '_fp32.json')})") in smoke.output, smoke.output[:3000]
    assert s["mixed_precision"] == "no"  # the reference ran fp32, a DeepSpeed JSON included
    # Gradients are summed across processes in fp32 under every engine (DDP's fp32 gradients; the DeepSpeed
    # JSONs' communication_data_type; FSDP2's reduce_dtype set by accelrun), and ZeRO-1/2 overlap that with
    # the backward pass: read from the engines that ran (docs/configs.md, "Gradient reduction").
    assert shipped["grad_reduce_dtype"] == (None if world == 1 else "float32"), shipped
    assert shipped["overlap_comm"] == (True if dist_type == "DEEPSPEED" else None), shipped
    assert (shipped["distributed_type"], shipped["steps"]) == (dist_type, 2)
    assert all(math.isfinite(x) for x in (shipped["first_loss"], shipped["final_loss"], shipped["test_loss"]))


def fsdp_shards(weights, world):
    """(elements per rank, checksum per rank) of the parameters FSDP2 gives each rank: each parameter cut along
    its first dimension as torch.chunk cuts it (BatchNorm's running statistics are buffers, not sharded)."""
    elements, checksums = [0] * world, [0.0] * world
    for name, tensor in weights.items():
        if name.endswith(("running_mean", "running_var", "num_batches_tracked")):
            continue
        for rank, piece in enumerate(torch.chunk(tensor, world)):
            elements[rank] += piece.numel()
            checksums[rank] += piece.double().sum().item()
    return elements, checksums


def shipped_precision(config):
    """The dtype a config asks for: its YAML's mixed_precision, or with a DeepSpeed JSON, the JSON's."""
    cfg = load_yaml(config)
    ds_file = (cfg.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if ds_file:
        ds = json.loads((CONFIG_DIR.parent / ds_file).read_text())
        return next((d for d in ("bf16", "fp16") if ds.get(d, {}).get("enabled") is True), "no")
    return cfg.get("mixed_precision", "no")


def assert_same_params(a, b, atol=5e-5, rtol=1e-4):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name].float(), b[name].float(), atol=atol, rtol=rtol, msg=name)


def test_sync_bn_one_process_equals_two(reference):
    """Global batch B on 1 process == B/2 on each of 2 processes, when BatchNorm sees the global batch.
    (The 2-process --sync-bn run is also the world-size-change test's reference.)"""
    one, _ = reference("cpu.yaml", "--sync-bn")
    two, _ = reference("2gpu.yaml", "--sync-bn")
    assert (one.summary["world_size"], two.summary["world_size"]) == (1, 2)
    assert one.summary["steps"] == two.summary["steps"] == 20
    # The same losses step by step; over 20 steps the float sums drift the second BatchNorm's running mean by
    # up to 1.5e-4 (of 0.64; measured), hence atol 2e-4.
    assert [m["loss"] for m in two.metrics] == pytest.approx([m["loss"] for m in one.metrics], rel=1e-5)
    assert_same_params(one.params(), two.params(), atol=2e-4)
    # Without --sync-bn each process normalises its own half batch: the runs differ.
    local_bn, _ = reference("2gpu.yaml")
    with pytest.raises(AssertionError):
        assert_same_params(one.params(), local_bn.params(), atol=2e-4)


def test_evaluation_is_exact_for_an_odd_test_set(launch):
    """--epochs 0 evaluates the seeded initial model: identical counts on 1 and 2 processes, none dropped."""
    one = launch("1gpu.yaml", "--epochs", "0", "--eval-batch-size", "100", launch_args=FP32).summary
    two = launch("2gpu.yaml", "--epochs", "0", "--eval-batch-size", "100", launch_args=FP32).summary
    assert one["test_samples"] == two["test_samples"] == TEST_SIZE
    assert one["test_accuracy"] == two["test_accuracy"]
    assert one["test_loss"] == pytest.approx(two["test_loss"], rel=1e-5)


@pytest.mark.parametrize("config", ["deepspeed_zero1.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml",
                                    "deepspeed_zero3_offload.yaml", "fsdp.yaml"])
def test_sharded_configs_match_ddp_step_by_step(reference, config):
    """Every ZeRO stage, offload and FSDP compute what DDP computes: the resume tests' fp32 reference runs
    (20 steps, every step logged) compared loss by loss and weight by weight."""
    ddp, _ = reference("2gpu.yaml")
    other, _ = reference(config)
    expected_type, _, stage, _ = EXPECTED[config]
    assert (other.summary["distributed_type"], other.summary["deepspeed_stage"]) == (expected_type, stage)
    ddp_losses = [m["loss"] for m in ddp.metrics]
    other_losses = [m["loss"] for m in other.metrics]
    assert len(ddp_losses) == len(other_losses) == 20
    rel = 1e-3 if "offload" in config else 1e-4  # DeepSpeed's CPU Adam rounds differently from torch's
    assert other_losses == pytest.approx(ddp_losses, rel=rel)
    assert_same_params(ddp.params(), other.params(), atol=1e-3 if "offload" in config else 1e-4)
    if config == "deepspeed_zero3.yaml":
        assert_log_a_person_can_read(other.output)


def assert_log_a_person_can_read(output):
    """A ZeRO-3 log (20 progress lines here) is its progress lines plus start-up and end lines, not one torch
    deprecation warning per collective per step (DeepSpeed 0.19.8's all_gather_into_tensor / reduce_scatter_tensor,
    silenced by accelrun/engines/zero.py quiet_deprecated_collectives: 202 lines for 22 progress and evaluation
    lines)."""
    lines = output.splitlines()
    progress = [line for line in lines if line.startswith("epoch ")]
    assert len(progress) >= 20, output[-3000:]
    assert "is deprecated. Please use `torch.distributed" not in output, output[-3000:]
    assert len(lines) <= 3 * len(progress), f"{len(lines)} lines for {len(progress)} progress lines:\n{output[-3000:]}"


@pytest.mark.parametrize("config", ["2gpu.yaml", "deepspeed_zero2.yaml"])
def test_grad_accum_equals_one_large_batch(launch, config):
    """--grad-accum 2 with global batch B == no accumulation with B (without BatchNorm: see the docstring)."""
    args = ("--no-batchnorm", "--batch-size", "128", *SHORT)
    plain = launch(config, *args, launch_args=FP32)
    accum = launch(config, *args, "--grad-accum", "2", launch_args=FP32)
    assert plain.summary["steps"] == accum.summary["steps"] == 8
    # Really accumulated: twice the micro-batches of half the size (not one batch of 128 per step).
    # Really accumulated: 2 micro-batches ran per optimizer step, against 1 (counted by the step timer, which sees
    # every micro-batch the loop runs; its steady count leaves out the first). The same weights as one batch of
    # 128 per step (below) then make each micro-batch half of it.
    per_step = [(r.summary["timing"]["micro_batches"] + 1) / r.summary["steps"] for r in (plain, accum)]
    assert per_step == [1, 2], per_step
    assert_same_params(plain.params(), accum.params())
    assert [m["loss"] for m in accum.metrics] == pytest.approx([m["loss"] for m in plain.metrics], rel=1e-4)


# --- errors a user can cause in mnist's own flags: one clear message, non-zero exit ---------------

def test_strict_mnist_offline_says_what_to_do(launch, tmp_path):
    (tmp_path / "empty").mkdir()  # a --data-dir that is named and missing is refused before (test_refusals)
    run = launch("2gpu.yaml", "--data", "mnist", "--data-dir", str(tmp_path / "empty"), launch_args=FP32,
                 check=False)
    assert run.returncode != 0
    assert "MNIST is not in" in run.output and "login node" in run.output


@pytest.mark.parametrize("extra", [(), ("--stop-signals", "", "--stop-check-every", "1")],
                         ids=["default", "no-signals"])
def test_no_host_sync_between_progress_lines(launch, tmp_path, extra):
    """60 steps of 2-process DDP, a progress line every 20: .item(), .tolist(), .cpu(), cuda.synchronize and
    collectives (counted by the CPU shim per optimizer step) happen at start-up, at the progress lines and
    at the end only. With --stop-signals '' there is nothing to agree on, so even --stop-check-every 1 adds
    no collective. (With --stop-check-every 1 alone the same count finds calls at every one of the 60 steps.)"""
    counts_dir = tmp_path / "syncs"
    counts_dir.mkdir()
    launch("2gpu.yaml", "--epochs", "1", "--max-steps", "60", "--batch-size", "32", "--log-every", "20", *extra,
           launch_args=FP32, env={"TEST_COUNT_SYNCS": str(counts_dir)})
    for rank in (0, 1):
        counts = json.loads((counts_dir / f"rank{rank}.json").read_text())
        busy = {int(step) for step, calls in counts.items() if calls}
        assert {1, 20, 40} <= busy, counts  # the progress lines reduce the loss: the counter sees them
        assert busy <= {0, 1, 20, 40, 60}, {k: v for k, v in counts.items() if int(k) not in (0, 1, 20, 40, 60)}


def test_deepspeed_bf16_exports_the_fp32_masters(launch):
    """Under a DeepSpeed bf16 engine the module holds bf16 weights and the optimizer the fp32 masters: the
    export carries the masters, like DDP and FSDP (before, the bf16 weights upcast, labelled float32)."""
    run = launch("deepspeed_zero2.yaml", "--epochs", "1", "--max-steps", "5", "--batch-size", "200")
    assert run.summary["mixed_precision"] == "bf16" and run.summary["exported_dtype"] == "float32"
    weights = {k: v for k, v in run.params().items() if k.endswith("weight")}
    assert weights and all(v.dtype == torch.float32 for v in weights.values())
    # Trained fp32 masters are almost never representable in bf16's 8-bit mantissa; bf16 weights always are.
    assert any((v != v.bfloat16().float()).any() for v in weights.values()), "exported weights are bf16 values"


def test_on_a_terminal_each_line_stands_above_the_progress_bar(data_dir, tmp_path):
    """Issue 41, item 8: on a terminal each `epoch N done | test loss ...` line was glued to the end of the progress
    bar, the bar was drawn a second time below it at the end, and the first line said "1 processes". Run as a user
    runs it (a pseudo-terminal, so the bar is drawn): as the terminal shows it, every line starts a line of its own,
    the checkpoints' lines too (issue 53, item 9), the finished bar is on one line, and the first line says
    "1 process"."""
    code, output = on_a_terminal([sys.executable, "recipes/mnist.py", "--data-dir", str(data_dir), *DATA_ARGS,
                                  "--epochs", "2", "--batch-size", "200", "--log-every", "5",
                                  "--output-dir", str(tmp_path / "out"), "--checkpoint-dir", str(tmp_path / "ckpt"),
                                  "--checkpoint-every", "7"])
    shown = terminal_lines(output)
    assert code == 0 and "10/20" in output, output[-3000:]  # the bar was drawn
    done = [line for line in shown if "done | test loss" in line]
    assert len(done) == 2 and all(line.startswith("epoch ") for line in done), shown
    saved = [line for line in shown if "checkpoint saved: " in line]  # steps 7 and 14, mid-epoch, and the last
    assert len(saved) == 3 and all(line.startswith("checkpoint saved: ") for line in saved), shown
    bars = [line for line in shown if re.search(r"\| \d+/20 \[", line)]
    assert len([line for line in bars if "| 20/20 [" in line]) == 1, shown  # the finished bar, once
    assert all(re.fullmatch(r"\s*\d+%\|.*it/s\]", line) for line in bars), bars  # nothing glued to a bar
    assert next(line for line in shown if "| mixed precision" in line).startswith("NO | 1 process on cpu |"), shown
