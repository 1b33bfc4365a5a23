"""recipes/runkit/refusals.py: launches that would train wrongly, refused at start-up with one clear line and a
non-zero exit, before the data and the model are built. Each is a real launch of recipes/mnist.py on CPU.

The refusals a recipe adds for itself are with its own tests (an SGD recipe under optimizer offload: test_resnet.py,
test_linear_regression.py; ZeRO-3 loading a whole model that does not fit: test_finetune_lm.py).
"""

import json

import pytest

from launching import CONFIG_DIR

pytestmark = pytest.mark.slow

FP32 = ["--mixed_precision", "no"]
SHORT = ("--max-steps", "8", "--log-every", "1")


def test_global_batch_must_divide(launch):
    run = launch("2gpu.yaml", "--batch-size", "127", launch_args=FP32, check=False)
    assert run.returncode == 1  # torchrun reports any failed worker as 1; the recipe itself exits 2
    assert "error: --batch-size 127 is the global batch" in run.output
    assert "Traceback" not in run.output.split("error: --batch-size")[0][-2000:]
    assert "eval-batch-size" not in run.output  # 1000 divides by 2: only the real problem is named
    # The launcher's failure summary, printed last, ends with the same line instead of a docs pointer.
    summary = run.output[run.output.rindex("Root Cause"):]
    assert "traceback : error: --batch-size 127 is the global batch" in summary, summary


def test_gpu_config_on_cpu_refuses_independent_copies(launch):
    """A MULTI_GPU config on a machine without GPUs would train 2 unrelated copies; the recipe stops."""
    run = launch("2gpu.yaml", *SHORT, launch_args=FP32, env={"ACCELERATE_USE_CPU": "0"}, check=False)
    assert run.returncode != 0
    assert "the launcher started 2 processes" in run.output and "ACCELERATE_USE_CPU=1" in run.output


def test_more_processes_than_gpus_is_refused_before_anything_is_built(launch):
    """2gpu.yaml on a node with one GPU (simulated: torch.cuda reports 1) fails at once with the fixes, instead
    of CUDA's 'invalid device ordinal' after the model and data are built."""
    run = launch("2gpu.yaml", *SHORT, launch_args=FP32, env={"ACCELERATE_USE_CPU": "0", "TEST_FAKE_GPUS": "1"},
                 check=False)
    assert run.returncode == 1
    errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert errors == ["error: this node has 1 GPU(s) and the launch starts 2 processes on it (num_processes 2): pass "
                      "--num_processes 1 to accelerate launch, or use accelerate_configs/1gpu.yaml, or set "
                      "ACCELERATE_USE_CPU=1 for a run on the CPU."], run.output[-3000:]
    assert "DATA:" not in run.output  # refused before the data (and the model)


def test_deepspeed_config_without_its_cpu_route_is_refused(launch):
    """ACCELERATE_USE_CPU=1 silently turns DeepSpeed off: the recipe says so instead of training DDP."""
    run = launch("deepspeed_zero2.yaml", *SHORT, launch_args=FP32, env={"ACCELERATE_USE_CPU": "1", "PYTHONPATH": ""},
                 check=False)
    assert run.returncode == 1
    assert "error: the config asks for DEEPSPEED but accelerate is running MULTI_CPU" in run.output, run.output[-3000:]


def test_deepspeed_config_may_not_contradict_the_flags(launch, tmp_path):
    ds = json.loads((CONFIG_DIR / "deepspeed_zero2.json").read_text())
    ds["gradient_accumulation_steps"] = 4  # contradicts --grad-accum
    (tmp_path / "zero2_gas4.json").write_text(json.dumps(ds))
    bad = tmp_path / "zero2_gas4.yaml"
    bad.write_text((CONFIG_DIR / "deepspeed_zero2.yaml").read_text().replace(
        "accelerate_configs/deepspeed_zero2.json", str(tmp_path / "zero2_gas4.json")))
    run = launch(str(bad), *SHORT, launch_args=FP32, check=False)
    assert run.returncode != 0
    assert "gradient_accumulation_steps=4" in run.output and "remove those keys" in run.output
