"""--optim-states {fp32,bf16,8bit} (accelrun/finetune/optim_states.py, issue 50 item 1): AdamW's moments in the
precision asked for, checked after the first step, their bytes per parameter in summary.json, the refusals of the
engines that cannot keep them, and checkpoints that hold the low-precision states and resume exactly.

The refusals, the check and the bytes are shown in this process on states planted as the optimizers create them
(no step: torchao compiles its update at the first one, tens of seconds on a CPU). Two launches show FSDP2 on 2 CPU
processes with 8-bit states (about 2 bytes per parameter, a finite loss) and their checkpoint resumed on 1 process
(another world size), the parameters exactly; a one-process resume (bit for bit) is not launched: CI's time goes to
FSDP2's.
"""

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from accelrun.checkpoint.safe_loading import weights_only_loading
from accelrun.engines import FSDP2, DeepSpeed, OneProcessOrDDP
from accelrun.finetune.optim_states import STATE_BYTES, StatesCheck, local_problem, moment_kind, optimizer_for
from launching import finetune_args, launch_command, run_command

ENGINE = OneProcessOrDDP(SimpleNamespace(distributed_type=DistributedType.NO))


def flags(kind):
    return SimpleNamespace(optim_states=kind, lr=1e-3, weight_decay=0.1, lora_r=0)


def planted(kind, model=None):
    """(model, optimizer of --optim-states `kind`) with each parameter's state as the optimizer's first step creates
    it (torch's AdamW: fp32 zeros), without stepping."""
    model = model or torch.nn.Linear(128, 128)  # a 16,384-value matrix (quantised) and a 128-value bias (not)
    optimizer, problem = optimizer_for(list(model.parameters()), flags(kind), ENGINE)
    assert problem is None
    for p in model.parameters():
        new = getattr(optimizer, "_new_buffer", None)
        optimizer.state[p] = {"step": torch.tensor(1.0),
                              "exp_avg": new(p, True) if new else torch.zeros_like(p),
                              "exp_avg_sq": new(p, False) if new else torch.zeros_like(p)}
    return model, optimizer


@pytest.mark.parametrize("kind", ["fp32", "bf16", "8bit"])
def test_each_choice_keeps_its_moments_in_its_precision_and_counts_their_bytes(kind):
    model, optimizer = planted(kind)
    problem, held, covered = local_problem(optimizer, kind)
    assert problem is None
    assert covered == 128 * 128 + 128
    kinds = {moment_kind(optimizer.state[p]["exp_avg"]) for p in model.parameters()}
    assert kinds == {"fp32": {"float32"}, "bf16": {"bfloat16"}, "8bit": {"8bit", "bfloat16"}}[kind]
    # 8bit: the matrix's codes and one fp32 scale per 256 values; the bias (too small for torchao) in bf16, not fp32
    expected = {"fp32": 8.0, "bf16": 4.0, "8bit": (2 * (16384 + 64 * 4) + 2 * 128 * 2) / 16512}[kind]
    assert held / covered == pytest.approx(expected)
    assert held / covered == pytest.approx(STATE_BYTES[kind], rel=0.03)


def test_a_moment_of_another_dtype_stops_the_run_in_one_line():
    """Never a silent fp32: a moment left in the weights' dtype (what torchao does for a small tensor, and what torch's
    load_state_dict did to bf16 moments) is named."""
    model, optimizer = planted("8bit")
    optimizer.state[model.bias]["exp_avg_sq"] = torch.zeros(128)
    problem, _, _ = local_problem(optimizer, "8bit")
    assert problem.startswith("--optim-states 8bit: after the first step a moment (exp_avg_sq, of a parameter of "
                              "shape (128,)) is float32, not bfloat16")
    assert "\n" not in problem

    class Failed(Exception):
        pass

    def fail(message):
        raise Failed(message)

    accelerator = SimpleNamespace(num_processes=1)
    check = StatesCheck("8bit", optimizer, accelerator, fail)
    assert optimizer.first_step_check is not None  # called by the optimizer's first step (ChecksFirstStep)
    with pytest.raises(Failed, match=r"is float32, not bfloat16"):
        check.check(optimizer)


def test_loaded_moments_keep_the_dtype_they_were_saved_in_and_load_as_weights_only(tmp_path):
    """torch's Optimizer.load_state_dict casts loaded states to the weights' dtype (fp32): the bf16 moments stay bf16,
    the 8-bit ones stay 8-bit, and the file loads through the checkpoints' weights-only loading."""
    model, optimizer = planted("8bit")
    optimizer.state[model.weight]["exp_avg"].copy_(torch.randn(128, 128))
    optimizer.state[model.bias]["exp_avg"].copy_(torch.randn(128))
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.bin")
    with weights_only_loading():
        loaded = torch.load(tmp_path / "optimizer.bin")
    again = optimizer_for(list(model.parameters()), flags("8bit"), ENGINE)[0]
    again.load_state_dict(loaded)
    assert local_problem(again, "8bit")[0] is None
    for p in model.parameters():
        before, after = optimizer.state[p]["exp_avg"], again.state[p]["exp_avg"]
        assert torch.equal(before.dequantize() if moment_kind(before) == "8bit" else before,
                           after.dequantize() if moment_kind(after) == "8bit" else after)


def test_the_engines_refuse_what_they_cannot_keep_or_step():
    deepspeed = DeepSpeed(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED))
    problem = deepspeed.optimizer_states_problem("8bit")
    assert problem.startswith("--optim-states 8bit is not available under DeepSpeed") and "fsdp.yaml" in problem
    fsdp = FSDP2(SimpleNamespace(distributed_type=DistributedType.FSDP))
    assert fsdp.optimizer_states_problem("8bit") is None and ENGINE.optimizer_states_problem("bf16") is None
    bnb = type("AdamW8bit", (), {"__module__": "bitsandbytes.optim.adamw"})()
    assert "bitsandbytes issues 89, 1633" in fsdp.optimizer_problem(bnb)
    assert "use --optim-states 8bit" in fsdp.optimizer_problem(bnb)
    assert ENGINE.optimizer_problem(bnb) is None  # one process and DDP step it
    model = torch.nn.Linear(4, 4)
    assert optimizer_for(list(model.parameters()), flags("bf16"), deepspeed) == (None, problem.replace("8bit", "bf16"))


def test_low_precision_states_with_lora_are_refused_from_the_flags():
    from in_process import run_main
    code, output = run_main("finetune_lm", ["--lora-r", "8", "--optim-states", "8bit", "--data-files", "x.jsonl"])
    assert code == 2
    assert "--optim-states 8bit is for full fine-tunes; with --lora-r the adapters' fp32 states are already small" \
           in output


# ---- real runs: a model wide enough that torchao quantises its matrices (each shard at least 4,096 values) --------
STEPS = ["--max-steps", "6", "--checkpoint-every", "3", "--keep-last", "0", "--eval-every", "6", "--sample-tokens", "0"]


@pytest.fixture(scope="module")
def wide(hf):
    """The tiny Llama 128 wide (its matrices 8,192 values or more per shard on 2 processes), beside hf's model."""
    from transformers import AutoTokenizer

    from accelrun.data.tiny_hf import write_model
    target = hf / "wide"
    if not target.exists():
        shutil.copytree(hf / "model", target)
        write_model(target, AutoTokenizer.from_pretrained(target), width=128)
    return target


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, open(Path(run_dir) / "metrics.jsonl"))}


def resume_from(ckpt, step, into):
    """A copy of checkpoint dir `ckpt` holding only its checkpoint of `step`."""
    into.mkdir()
    shutil.copytree(ckpt / f"step-{step:08d}", into / f"step-{step:08d}")
    return into


@pytest.mark.slow
def test_8bit_states_under_fsdp2_on_2_processes_resume_on_1(hf, wide, tmp_path):
    """Issue 50: `--optim-states 8bit` under fsdp.yaml on 2 CPU processes ends with about 2 bytes of state per parameter
    and a finite loss; its checkpoint (the 8-bit states, sharded) resumes on 1 process: torch.distributed.checkpoint
    reshards them, the parameters come back exactly (the first resumed loss is the same number) and the states
    carry on (the next losses agree to float32's reduction order)."""
    def launch(name, ckpt, *launch_args):
        out = tmp_path / name
        out.mkdir()
        cmd, env = launch_command("fsdp.yaml", None, out, *finetune_args(hf, "wide"), "--optim-states", "8bit",
                                  *STEPS, "--checkpoint-dir", str(ckpt), recipe="recipes/finetune_lm.py",
                                  launch_args=("--mixed_precision", "no", *launch_args))
        code, output = run_command(cmd, env=env, timeout=900)
        assert code == 0, output[-4000:]
        return out, output

    first, _ = launch("two", tmp_path / "ck")
    summary = json.loads((first / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["optim_states"] == "8bit"
    assert 2.0 < summary["optimizer_state_bytes_per_param"] < 2.1 and math.isfinite(summary["final_loss"])
    ckpt = resume_from(tmp_path / "ck", 3, tmp_path / "ck1")
    one, output = launch("one", ckpt, "--num_processes", "1")
    assert "world size 2 -> 1" in output
    resumed = json.loads((one / "summary.json").read_text())
    assert resumed["world_size"] == 1 and 2.0 < resumed["optimizer_state_bytes_per_param"] < 2.1
    before, after = losses(first), losses(one)
    assert sorted(after) == [4, 5, 6] and after[4] == before[4]
    assert all(after[s] == pytest.approx(before[s], rel=1e-6) for s in (5, 6))

