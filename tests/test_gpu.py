"""The GPU pack: `python -m pytest -m gpu` on a machine with CUDA (README, "On a GPU"). Without a CUDA device
every test here is skipped with that reason; the 2-GPU tests are skipped with fewer than 2 GPUs.

Each launch checks what only a GPU shows:
  * the loss goes down, and the run computes in the precision its config asks for (bf16 in every GPU config);
  * the summary's timing split (CUDA events, src/accelrun/timing.py) adds up to the wall-clock time of the
    same steps (metrics.jsonl's train_time_s between two progress lines);
  * MFU lies between 0 and 1 (gpt.py, finetune_lm.py with --peak-tflops);
  * the peak device memory is reported (cuda_allocated, above zero);
  * the chunked loss (finetune_lm's default) against the plain one, and QLoRA, with the planner's figures in the log;
  * FlexAttention's packed step (finetune_lm's --attention flex, the default for packed blocks on CUDA) against SDPA's
    dense mask, with the sync check (the block mask is built on the device);
  * no host synchronisation in steady steps: tests/helpers/gpu_shim switches torch.cuda.set_sync_debug_mode("error")
    on between two progress lines, so an operation that makes the host wait for the GPU fails the run.
    Not under DeepSpeed: its optimizer step reads the gradient norm and the overflow flag on the host
    (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py: .item(), synchronize()), by its design. Not in
    linear_regression.py either: the lab logs its line's m and n at every step.
The runs are launched here, not through the CPU route. `bash gpu_check/run.sh` runs this file alone as the second
phase of the one-command GPU check (gpu_check/gpu_call.py): on 8 pytest workers that share the GPU (pytest-xdist;
each worker writes its own gpu_data), every launch small enough for eight at once, a test's time mostly process
start-up and compilation, which the cores share. The check caps the pack and sizes each launch's cap to it
($GPU_PACK_LAUNCH_S; 420 s when unset): a hung launch fails its own test, and the rest of the pack goes on.
"""

import json
import math
import os
import sys

import pytest
import torch

from accelrun.data.image_folder import write_image_folder
from accelrun.data.tiny_hf import write_all
from launching import CONFIG_DIR, REPO, LaunchResult, free_port, load_yaml, run_command, write_corpus

GPUS = torch.cuda.device_count()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="no CUDA device: the GPU pack needs one")]
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"fewer than 2 GPUs ({GPUS} here)")
GPU_SHIM = REPO / "tests" / "helpers" / "gpu_shim"
PEAK_TFLOPS = "989"  # H100 SXM dense bf16; MFU only has to lie in (0, 1) here
ONE_PROCESS = ["1gpu.yaml", "1gpu_compile.yaml"]
ENGINES = ["fsdp.yaml", "deepspeed_zero1.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"]
TWO_PROCESS = ["2gpu.yaml", "2gpu_compile.yaml", *ENGINES]
RECIPES = ["mnist", "gpt", "resnet", "finetune_lm", "linear_regression"]
LAUNCH_S = float(os.environ.get("GPU_PACK_LAUNCH_S") or 420)  # one launch's cap: gpu_check/gpu_call.py sizes it


@pytest.fixture(scope="session")
def gpu_data(tmp_path_factory):
    """Text for gpt.py, class folders for resnet.py, the tiny Hugging Face model for finetune_lm.py."""
    root = tmp_path_factory.mktemp("gpu_data")
    write_corpus(root / "corpus.txt", 8000)
    write_image_folder(root / "images", train_per_class=640, val_per_class=64, size=32)
    write_all(root / "hf")
    return root


def recipe_args(recipe, data):
    """(arguments, steps between progress lines): every run logs at step 1, at `every` and at 2 x `every`,
    and evaluates only at the end, so steps 3 .. every-2 are steady."""
    every = {"mnist": 30, "gpt": 30, "resnet": 16, "finetune_lm": 15, "linear_regression": 8}[recipe]
    steps = ["--max-steps", str(2 * every), "--log-every", str(every)]
    return {
        "mnist": ["--data", "synthetic", "--data-dir", str(data / "mnist"), "--synthetic-train-size", "20000",
                  "--synthetic-test-size", "1000", "--epochs", "1", "--batch-size", "256", *steps],
        "gpt": ["--preset", "tiny", "--data-files", str(data / "corpus.txt"), "--batch-size", "32",
                "--warmup-steps", "5", "--eval-every", str(2 * every), "--eval-batches", "4", "--sample-tokens", "0",
                "--peak-tflops", PEAK_TFLOPS, *steps],
        "resnet": ["--data-dir", str(data / "images"), "--image-size", "32", "--batch-size", "32", "--epochs", "1",
                   "--num-workers", "2", *steps],
        "finetune_lm": ["--model", str(data / "hf" / "model"), "--data-files", str(data / "hf" / "pairs.jsonl"),
                        "--block-size", "32", "--batch-size", "16", "--lr", "3e-3", "--warmup-steps", "2",
                        "--eval-every", str(2 * every), "--eval-batches", "2", "--sample-tokens", "0",
                        "--peak-tflops", PEAK_TFLOPS, *steps],
        "linear_regression": ["--epochs", "4", "--num-points", "1024", "--batch-size", "64", "--log-every", "8"],
    }[recipe], every


def gpu_launch(tmp_path, config, recipe, data, processes=None, sync_check=True, extra=()):
    """accelerate launch of recipes/<recipe>.py under `config` on this machine's GPUs (no CPU route), with the
    sync check between the first two progress lines where it applies (see the module docstring); `extra`: more of
    the recipe's flags (its output directory then gets a name of its own)."""
    args, every = recipe_args(recipe, data)
    args = [*args, *extra]
    out = tmp_path / f"{recipe}-{config.replace('.yaml', '')}{'-extra' if extra else ''}"
    cmd = ["accelerate", "launch", "--config_file", str(CONFIG_DIR / config), "--main_process_port", str(free_port()),
           *(["--num_processes", str(processes)] if processes else []),
           f"recipes/{recipe}.py", "--output-dir", str(out), *args]
    env = {"PYTHONPATH": str(GPU_SHIM)}
    checked = sync_check and recipe != "linear_regression" and "deepspeed" not in config
    if checked:
        env["TEST_SYNC_DEBUG_STEPS"] = f"3:{every - 2}"
    returncode, output = run_command(cmd, env=env, timeout=LAUNCH_S)
    run = LaunchResult(returncode, output, out)
    assert returncode == 0, f"launch failed ({returncode}):\n{output[-6000:]}"
    if checked:
        assert "TEST-SHIM: synchronising CUDA operations raise from step 3" in output, output[-3000:]
        assert f"allowed again after step {every - 2}" in output, output[-3000:]
    return run


def expected_precision(config):
    """What the config asks for: the YAML's mixed_precision, or the DeepSpeed JSON's bf16/fp16."""
    cfg = load_yaml(config)
    ds_file = (cfg.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if not ds_file:
        return cfg.get("mixed_precision", "no")
    ds = json.loads((REPO / ds_file).read_text())
    return next((dtype for dtype in ("bf16", "fp16") if ds.get(dtype, {}).get("enabled")), "no")


def assert_gpu_run(run, config, recipe):
    s, metrics = run.summary, run.metrics
    assert s["mixed_precision"] == expected_precision(config) == "bf16", s["mixed_precision"]
    progress = [m for m in metrics if "data_ms" in m]  # linear_regression.py also writes a line per step
    losses = [m["loss"] for m in progress]
    assert losses[-1] < losses[0], losses
    # The peak device memory, read from the CUDA allocator.
    assert s["peak_memory_kind"] == "cuda_allocated" and s["peak_memory_mb"] > 0, s
    reserved = s["peak_memory_reserved_mb_per_rank"]
    assert len(reserved) == s["world_size"] and all(r >= a for r, a in zip(reserved, s["peak_memory_mb_per_rank"]))
    if recipe in ("mnist", "gpt"):
        assert s["optimizer_implementation"] == "fused", s["optimizer_implementation"]
    if recipe in ("gpt", "finetune_lm"):
        assert 0 < s["mfu"] < 1, s["mfu"]
        assert all(0 < m["mfu"] < 1 for m in progress), [m["mfu"] for m in progress]
    # CUDA-event phases of the last window (the steps after the previous progress line) against the host's clock
    # over the same steps. The host reads its clock just before each progress line waits for the GPU, so the two
    # differ by the work queued at those two moments: a step or two of the window's 15 to 30.
    before, last = progress[-2], progress[-1]
    micro_batches = (last["step"] - before["step"]) * s["args"].get("grad_accum", 1)
    phases = sum(last[f"{phase}_ms"] for phase in ("data", "forward_backward", "optimizer", "other"))
    wall = last["train_time_s"] - before["train_time_s"]
    assert phases * micro_batches / 1000 == pytest.approx(wall, rel=0.1, abs=0.05), (last, before)
    # The summary's steady split is the same four phases, and they make its throughput.
    timing = s["timing"]
    step_ms = sum(timing[f"{phase}_ms"] for phase in ("data", "forward_backward", "optimizer", "other"))
    rate = next(v for k, v in timing.items() if k.endswith("_per_s"))
    assert rate * step_ms / 1000 > 0 and timing["micro_batches"] >= len(progress), timing


@pytest.mark.parametrize("config", ONE_PROCESS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_on_one_gpu(tmp_path, gpu_data, recipe, config):
    run = gpu_launch(tmp_path, config, recipe, gpu_data)
    assert_gpu_run(run, config, recipe)
    assert run.summary["distributed_type"] == "NO" and run.summary["world_size"] == 1


@pytest.mark.parametrize("config", ENGINES)
def test_engines_on_one_process(tmp_path, gpu_data, config):
    """FSDP2 and ZeRO-1/2/3 with one process: gpt built sharded where the engine shards, bf16 compute, and the
    exported weights are the fp32 masters (bf16 values upcast would all be representable in bf16)."""
    run = gpu_launch(tmp_path, config, "gpt", gpu_data, processes=1)
    assert_gpu_run(run, config, "gpt")
    s = run.summary
    assert s["distributed_type"] == ("FSDP" if config == "fsdp.yaml" else "DEEPSPEED"), s["distributed_type"]
    if config == "deepspeed_zero3.yaml":
        assert s["model_init"] == "partitioned while built (zero.Init)", s["model_init"]
    weights = [v for k, v in run.params().items() if v.is_floating_point()]
    assert any((v != v.bfloat16().float()).any() for v in weights), "exported weights are bf16 values"


def test_resnet_under_fsdp_on_one_process(tmp_path, gpu_data):
    """FSDP2 refuses channels_last (non-contiguous) parameters: resnet keeps only its inputs channels_last."""
    run = gpu_launch(tmp_path, "fsdp.yaml", "resnet", gpu_data, processes=1)
    assert_gpu_run(run, "fsdp.yaml", "resnet")


@two_gpus
@pytest.mark.parametrize("config", TWO_PROCESS)
def test_two_gpus(tmp_path, gpu_data, config):
    """Every multi-process config on 2 GPUs: mnist, and gpt where the engine shards the model."""
    for recipe in ("mnist", "gpt") if config in ENGINES else ("mnist",):
        run = gpu_launch(tmp_path, config, recipe, gpu_data, processes=2)
        assert_gpu_run(run, config, recipe)
        assert run.summary["world_size"] == 2


@two_gpus
def test_resnet_under_fsdp_on_two_gpus(tmp_path, gpu_data):
    run = gpu_launch(tmp_path, "fsdp.yaml", "resnet", gpu_data, processes=2)
    assert_gpu_run(run, "fsdp.yaml", "resnet")
    assert run.summary["fsdp_units"], run.summary["fsdp_units"]


def test_pi_times_the_computation_not_its_launch(tmp_path):
    """On a GPU the kernels of the partial sum are queued: the compute time is taken once the sum is read."""
    out = tmp_path / "pi"
    cmd = ["accelerate", "launch", "--config_file", str(CONFIG_DIR / "1gpu.yaml"), "--main_process_port",
           str(free_port()), "recipes/pi.py", "--intervals", "1e9", "--output-dir", str(out)]
    returncode, output = run_command(cmd, timeout=min(300, LAUNCH_S))
    assert returncode == 0, output[-4000:]
    [row] = LaunchResult(returncode, output, out).summary["results"]
    assert row["compute_seconds_per_rank"][0] >= 0.5 * row["seconds"], row


def test_chunked_loss_on_one_gpu(tmp_path, gpu_data):
    """The loss in 8 chunks (finetune_lm's default) against the plain loss (--loss-chunks 1) on one GPU: no host
    synchronisation in steady steps (the kept positions are counted on the CPU: torch.nonzero_static), the same
    losses to bf16's resolution; and bench/lm_memory.py's figure for this shape printed beside the run's
    torch.cuda.max_memory_allocated (the summary's peak_memory_mb), for the pack's log."""
    sys.path.insert(0, str(REPO / "bench"))
    import lm_memory
    chunked = gpu_launch(tmp_path, "1gpu.yaml", "finetune_lm", gpu_data)
    assert_gpu_run(chunked, "1gpu.yaml", "finetune_lm")
    args, _ = recipe_args("finetune_lm", gpu_data)
    plain_out = tmp_path / "plain"
    cmd = ["accelerate", "launch", "--config_file", str(CONFIG_DIR / "1gpu.yaml"), "--main_process_port",
           str(free_port()), "recipes/finetune_lm.py", "--output-dir", str(plain_out), *args, "--loss-chunks", "1"]
    returncode, output = run_command(cmd, timeout=LAUNCH_S)
    assert returncode == 0, output[-4000:]
    plain = LaunchResult(returncode, output, plain_out)
    assert [m["loss"] for m in chunked.metrics] == pytest.approx([m["loss"] for m in plain.metrics], rel=2e-2)
    config = json.loads((gpu_data / "hf" / "model" / "config.json").read_text())
    s = chunked.summary
    tokens = s["args"]["batch_size"] * s["block_size"]
    planned = lm_memory.shape_parts(s["param_elements"], config, "full", tokens, gpus=1)
    print(f"planner {sum(planned.values()) * 1e3:.1f} MB ({planned}) beside max_memory_allocated "
          f"{s['peak_memory_mb']:.1f} MB (chunked), {plain.summary['peak_memory_mb']:.1f} MB (plain)")
    assert s["peak_memory_mb"] > 0 and plain.summary["peak_memory_mb"] > 0


def test_flex_attention_on_one_gpu(tmp_path, gpu_data):
    """Issue 55: packed pairs trained with --attention flex (compiled FlexAttention, a BlockMask built on the device
    from each block's positions) take no host synchronisation in steady steps, and train as SDPA with the dense
    block-diagonal mask does (--attention sdpa; bf16: losses to 2e-2); auto takes flex here. Both peaks in the log."""
    flex = gpu_launch(tmp_path, "1gpu.yaml", "finetune_lm", gpu_data, extra=("--attention", "flex"))
    assert_gpu_run(flex, "1gpu.yaml", "finetune_lm")
    dense = gpu_launch(tmp_path / "dense", "1gpu.yaml", "finetune_lm", gpu_data, extra=("--attention", "sdpa"))
    assert flex.summary["attention"] == "flex" and dense.summary["attention"] == "sdpa"
    assert flex.summary["examples_per_block"] > 1  # packed: flex has examples to keep apart
    assert [m["loss"] for m in flex.metrics] == pytest.approx([m["loss"] for m in dense.metrics], rel=2e-2)
    print(f"flex {flex.summary['tokens_per_s']:.0f} tokens/s, peak {flex.summary['peak_memory_mb']:.1f} MB; dense "
          f"{dense.summary['tokens_per_s']:.0f} tokens/s, peak {dense.summary['peak_memory_mb']:.1f} MB")


def test_qlora_on_one_gpu(tmp_path, gpu_data):
    """QLoRA (--load-in-4bit, LoRA r 16) on one GPU: bitsandbytes' CUDA kernels train the adapters on the NF4 base
    with no host synchronisation in steady steps, in bf16; the planner's figure for this shape (bench/lm_memory.py,
    job "QLoRA") printed beside the run's torch.cuda.max_memory_allocated, for the pack's log."""
    sys.path.insert(0, str(REPO / "bench"))
    import lm_memory
    run = gpu_launch(tmp_path, "1gpu.yaml", "finetune_lm", gpu_data, extra=("--lora-r", "16", "--load-in-4bit"))
    assert_gpu_run(run, "1gpu.yaml", "finetune_lm")
    s = run.summary
    assert s["quantized_base"] == "nf4" and s["frozen_dtype"] == "bfloat16", s
    from safetensors import safe_open
    model = gpu_data / "hf" / "model"
    with safe_open(model / "model.safetensors", "pt") as f:  # the base's parameters (param_elements counts packed)
        n = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    config = json.loads((model / "config.json").read_text())
    planned = lm_memory.shape_parts(n, config, "QLoRA", s["args"]["batch_size"] * s["block_size"], gpus=1)
    print(f"planner {sum(planned.values()) * 1e3:.1f} MB ({planned}) beside max_memory_allocated "
          f"{s['peak_memory_mb']:.1f} MB (QLoRA)")


def test_pack_sees_the_gpu():
    """The machine the pack runs on, in its log: the device and the software (the first line to read)."""
    print(f"{GPUS} x {torch.cuda.get_device_name(0)}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"python {sys.version.split()[0]}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}")
    assert torch.cuda.is_bf16_supported()
