"""float8 for full fine-tunes (accelrun/float8.py, accelerate_configs/fsdp_fp8.yaml; issue 50 item 3): which linear
layers compute in float8, the refusals (LoRA, 4-bit bases, compile under DDP, DeepSpeed, a GPU without float8; the
config's traps: tests/test_check_config.py) and a checkpoint of a float8 run that resumes exactly.

The choice of layers and the refusals are shown in this process; one pair of launches runs the
shipped fsdp_fp8.yaml (compiled, FSDP2 over 2 CPU processes: torch runs float8 matmuls on the CPU, as a check of the
wiring) and resumes its checkpoint: the same losses and, bit for bit, the same exported weights.
"""

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from accelrun import float8
from accelrun.engines import FSDP2, DeepSpeed, OneProcessOrDDP
from accelrun.sharded_model import FLOAT8_WHOLE
from launching import finetune_args, launch_command, run_command


class Net(torch.nn.Module):
    """first and last: bf16 by position; wide: converted (N > 1024); narrow: too small (K <= 4096, N <= 1024);
    odd: 1,048 wide, not a multiple of 16."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(64, 64)
        self.wide = torch.nn.Linear(64, 1040)
        self.narrow = torch.nn.Linear(1040, 64)
        self.odd = torch.nn.Linear(64, 1048)
        self.last = torch.nn.Linear(1048, 64)


def test_the_large_layers_compute_in_float8_and_the_first_line_counts_them():
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear
    model, layers = Net(), float8.Float8Layers()
    layers.bind(model)
    convert_to_float8_training(model, module_filter_fn=layers)
    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {"wide"}
    facts = float8.facts(model, layers, "cpu")
    assert (facts["float8_linears"], facts["linears"]) == (1, 5)
    assert facts["float8_kept"] == {"first and last": 2, "too small": 1, "not a multiple of 16": 1}
    assert float8.describe(facts) == (" (1 of 5 linear layers in float8; bf16: 2 first and last, 1 too small, 1 not a "
                                      "multiple of 16; on the cpu: a wiring check of the float8 path, not its speed)")
    assert float8.describe(float8.facts(model, layers, "cuda")).endswith("1 not a multiple of 16)")
    assert float8.describe({"mixed_precision": "bf16"}) == ""


def test_the_export_writes_the_weights_behind_torchaos_float8_wrapper(tmp_path):
    """FSDP2's float8 all-gather wraps each converted weight; on one process the full state dict hands the wrapper to
    the export, which safetensors could not write ('invalid python storage')."""
    from safetensors.torch import load_file, save_file
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    weight = torch.randn(32, 16)
    wrapped = WeightWithDynamicFloat8CastTensor(weight, LinearMMConfig(), torch.float8_e4m3fn)
    with pytest.raises(RuntimeError):
        save_file({"w": wrapped.float().contiguous()}, tmp_path / "wrapped.safetensors")
    save_file({"w": float8.plain(wrapped).float().contiguous()}, tmp_path / "plain.safetensors")
    assert torch.equal(load_file(tmp_path / "plain.safetensors")["w"], weight)
    assert float8.plain(weight) is weight


def test_lora_and_4_bit_bases_are_refused_under_float8():
    fp8, bf16 = SimpleNamespace(mixed_precision="fp8"), SimpleNamespace(mixed_precision="bf16")
    assert "with --lora-r" in float8.flags_problem(fp8, lora_r=16)
    assert "drop --load-in-4bit" in float8.flags_problem(fp8, lora_r=16, load_in_4bit=True)
    assert float8.flags_problem(fp8) is None and float8.flags_problem(bf16, lora_r=16, load_in_4bit=True) is None


def test_the_engines_refuse_the_ways_that_do_not_run_float8():
    def ddp(processes):
        return OneProcessOrDDP(SimpleNamespace(distributed_type=DistributedType.MULTI_GPU, num_processes=processes))
    assert "torchao issue 1308" in ddp(2).float8_problem(compiled=True)
    assert "fsdp_fp8.yaml" in ddp(2).float8_problem(compiled=True)
    assert ddp(2).float8_problem(compiled=False) is None and ddp(1).float8_problem(compiled=True) is None
    deepspeed = DeepSpeed(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED))
    assert "fsdp_fp8.yaml" in deepspeed.float8_problem(compiled=False)
    assert FSDP2(SimpleNamespace(distributed_type=DistributedType.FSDP)).float8_problem(True) is None


@pytest.mark.parametrize("capability, refused", [((8, 0), True), ((8, 9), False), ((9, 0), False)])
def test_a_gpu_without_float8_is_refused_before_accelerator(monkeypatch, capability, refused):
    """accelerate's Accelerator() would run fp16 instead on such a GPU, with only a log warning (a CPU run with that
    GPU visible too): the launch is stopped first."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    problem = float8.launch_problem({"ACCELERATE_MIXED_PRECISION": "fp8"})
    assert (problem is not None) == refused
    if refused:
        assert "this NVIDIA A100-SXM4-80GB has 8.0, and accelerate would run fp16 instead" in problem
        assert "use fsdp.yaml (bf16)" in problem and "CUDA_VISIBLE_DEVICES=" in problem and "\n" not in problem
    cpu_run = {"ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_USE_CPU": "True"}
    assert (float8.launch_problem(cpu_run) is not None) == refused
    assert float8.launch_problem({"ACCELERATE_MIXED_PRECISION": "bf16"}) is None


def test_a_backend_other_than_torchaos_is_refused_before_accelerator():
    """accelerate's Accelerator() raises an ImportError for Transformer Engine, which is not installed: one line."""
    problem = float8.launch_problem({"ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_FP8_BACKEND": "TE"})
    assert problem == ("mixed precision fp8 with fp8_config backend TE: accelrun runs torchao's float8 (AO); "
                       "Transformer Engine and MS-AMP are neither installed nor tested here: write backend: AO "
                       "(fsdp_fp8.yaml)")
    assert float8.launch_problem({"ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_FP8_BACKEND": "AO"}) is None


def test_the_launch_check_stops_a_float8_run_on_such_a_gpu(monkeypatch, capsys):
    """check_gpus_before_start (Run's first call, before Accelerator()) says it in one line and exits 2."""
    from accelrun.refusals import check_gpus_before_start
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    with pytest.raises(SystemExit) as stopped:
        check_gpus_before_start()
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"error: {float8.launch_problem()}\n"


class Failed(Exception):
    pass


def float8_run(distributed_type, processes, dynamo="INDUCTOR", backend="AO"):
    """A Run at its float8 decision (Run._float8) for an accelerator of this kind; run.fail raises Failed."""
    from accelerate.utils.dataclasses import FP8BackendType

    from accelrun.engines import Engine
    from accelrun.run import Run
    state = SimpleNamespace(dynamo_plugin=SimpleNamespace(backend=SimpleNamespace(value=dynamo)))
    accelerator = SimpleNamespace(distributed_type=distributed_type, num_processes=processes, mixed_precision="fp8",
                                  state=state, fp8_backend=FP8BackendType(backend),
                                  ao_recipe_handler=SimpleNamespace(module_filter_func=None), prepare=lambda *a: a)
    run = Run.__new__(Run)  # only what _float8 uses: the engine and fail
    run.engine = Engine.of(accelerator)

    def fail(message):
        raise Failed(message)

    run.fail = fail
    return run, accelerator


def test_run_refuses_float8_where_its_engine_does_and_installs_the_choice_elsewhere():
    run, accelerator = float8_run(DistributedType.MULTI_GPU, 2)
    with pytest.raises(Failed, match="torchao issue 1308"):
        run._float8(accelerator)
    run, accelerator = float8_run(DistributedType.MULTI_GPU, 2, backend="TE")
    with pytest.raises(Failed, match="mixed precision fp8 with accelerate's backend TE: accelrun runs torchao's"):
        run._float8(accelerator)
    run, accelerator = float8_run(DistributedType.FSDP, 2)
    layers = run._float8(accelerator)
    assert isinstance(layers, float8.Float8Layers) and accelerator.ao_recipe_handler.module_filter_func is layers
    model = Net()
    accelerator.prepare(model)  # binds the model prepare() is given: its first and last stay bf16
    assert layers.ends == {"first", "last"}


def test_dpo_refuses_lora_under_float8_in_one_line(hf, monkeypatch):
    from accelrun.finetune.preference import write_toy_pairs
    from in_process import run_main
    write_toy_pairs(hf / "float8-prefs.jsonl")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    code, output = run_main("dpo", ["--model", str(hf / "model"), "--data-files", str(hf / "float8-prefs.jsonl"),
                                    "--lora-r", "8", "--output-dir", str(hf / "dpo-lora8")])
    assert code == 2 and "error: mixed precision fp8 is for full fine-tunes: with --lora-r" in output
    assert "Traceback" not in output


def test_finetune_lm_refuses_lora_under_float8_in_one_line(hf, monkeypatch):
    from in_process import run_main
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    code, output = run_main("finetune_lm", [*finetune_args(hf), "--lora-r", "8", "--output-dir", str(hf / "lora8")])
    assert code == 2
    assert "error: mixed precision fp8 is for full fine-tunes: with --lora-r" in output
    assert "Traceback" not in output


# ---- the shipped config launched: FSDP2 over 2 CPU processes, compiled, a checkpoint resumed ---------------------
STEPS = ["--max-steps", "6", "--checkpoint-every", "3", "--keep-last", "0", "--eval-every", "6", "--sample-tokens", "0"]


@pytest.fixture(scope="module")
def float8_model(hf):
    """The tiny Llama 64 wide with an MLP 1,040 wide: its gate and up projections (1,040 x 64) pass float8's rule,
    two per layer; the rest stay bf16."""
    from transformers import AutoTokenizer

    from accelrun.data.tiny_hf import write_model
    target = hf / "float8"
    if not target.exists():
        shutil.copytree(hf / "model", target)
        write_model(target, AutoTokenizer.from_pretrained(target), width=64, intermediate=1040)
    return target


@pytest.mark.slow
def test_the_shipped_float8_config_trains_and_resumes_exactly(hf, float8_model, tmp_path):
    """fsdp_fp8.yaml as shipped: 4 of the 15 linear layers in float8 (the first line and the summary say which
    stayed bf16, and that the CPU only checks the wiring), every process building its own copy, a finite falling loss;
    its step-3 checkpoint resumed gives the uninterrupted run's losses and exported weights exactly."""
    def launch(name, ckpt):
        out = tmp_path / name
        cmd, env = launch_command("fsdp_fp8.yaml", None, out, *finetune_args(hf, "float8"), *STEPS,
                                  "--checkpoint-dir", str(ckpt), recipe="recipes/finetune_lm.py")
        code, output = run_command(cmd, env=env, timeout=900)
        assert code == 0, output[-4000:]
        return out, output

    first, output = launch("whole", tmp_path / "ck")
    assert ("mixed precision fp8 (4 of 15 linear layers in float8; bf16: 2 first and last, 9 too small; on the cpu: "
            "a wiring check of the float8 path, not its speed)") in output
    summary = json.loads((first / "summary.json").read_text())
    assert (summary["mixed_precision"], summary["float8_linears"], summary["linears"]) == ("fp8", 4, 15)
    assert summary["model_init"] == FLOAT8_WHOLE and summary["world_size"] == 2
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] < summary["first_loss"]
    (tmp_path / "ck3").mkdir()
    shutil.copytree(tmp_path / "ck" / "step-00000003", tmp_path / "ck3" / "step-00000003")
    again, output = launch("resumed", tmp_path / "ck3")
    assert "resumed from" in output and "step-00000003" in output
    losses = [{r["step"]: r["loss"] for r in map(json.loads, open(Path(d) / "metrics.jsonl"))} for d in (first, again)]
    assert sorted(losses[1]) == [4, 5, 6] and all(losses[1][s] == losses[0][s] for s in (4, 5, 6))
    from safetensors.torch import load_file
    whole, resumed = (load_file(str(d / "model" / "model.safetensors")) for d in (first, again))
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)

