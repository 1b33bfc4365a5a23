"""finetune_lm.py under DeepSpeed's Ulysses sequence parallelism (accelerate_configs/deepspeed_zero3_sp2.yaml): two
CPU processes share each sequence, each holding half its tokens, and train exactly as one process with the whole
sequence; and the refusals of what it cannot train, checked in this process.

The launches (3, about a minute and a half): one process with the whole sequences (the reference); the two processes
with a checkpoint every 3 steps; and a resume of that run's step 3 with --grad-accum 2 (the same global batch in two
micro-batches: the token-weighted loss over the whole step, sequence-parallel ranks and accumulation together). The
data is uneven.jsonl, whose responses run from 1 to 30 words, padded one to a block (--no-packing), so a loss that
were not weighted by tokens across the slices would differ from one process's.
"""

import shutil
from types import SimpleNamespace

import pytest

from launching import FINETUNE_STEPS, REPO

SP = "deepspeed_zero3_sp2.yaml"
CHECKPOINTS = ("--checkpoint-every", "3", "--keep-last", "0")
# 4 decimals, the bar: DeepSpeed's fp32 sums in another order than one process's (1e-6 here).
DECIMALS = 5e-5


def losses(run):
    return [m["loss"] for m in run.metrics]


@pytest.mark.slow
def test_two_processes_sharing_each_sequence_train_as_one_process(finetune, hf, tmp_path):
    one = finetune("cpu.yaml", "--no-packing")
    sp = finetune(SP, "--no-packing", "--checkpoint-dir", str(hf / "ckpt-sp2"), *CHECKPOINTS)
    s = sp.summary
    assert (s["distributed_type"], s["world_size"], s["deepspeed_stage"]) == ("DEEPSPEED", 2, 3)
    assert s["sequence_parallel"] == 2 and s["packing"] is False
    assert "1 x 16 per group of 2, each sequence split over the group (sequence parallel)" in sp.output
    assert [m["step"] for m in sp.metrics] == list(range(1, FINETUNE_STEPS + 1))
    assert losses(sp) == pytest.approx(losses(one), abs=DECIMALS)
    assert len(set(losses(sp))) == FINETUNE_STEPS  # every step trained
    assert s["val_loss"] == pytest.approx(one.summary["val_loss"], abs=DECIMALS)  # evaluated on whole sequences
    # The exported model is the one process's, and from_pretrained loads it.
    from transformers import AutoModelForCausalLM
    mine, theirs = (AutoModelForCausalLM.from_pretrained(r.out_dir / "model").state_dict() for r in (sp, one))
    assert max(float((mine[k] - theirs[k]).abs().max()) for k in mine) < 1e-4

    # Step 3's checkpoint, resumed with --grad-accum 2: the steps after it are the uninterrupted run's.
    shutil.copytree(hf / "ckpt-sp2" / "step-00000003", tmp_path / "ckpt" / "step-00000003")
    resumed = finetune(SP, "--no-packing", "--checkpoint-dir", str(tmp_path / "ckpt"), *CHECKPOINTS,
                       "--grad-accum", "2")
    assert resumed.summary["resumed_from_step"] == 3
    assert any("--grad-accum 1 -> 2" in change for change in resumed.summary["resume_changes"])
    assert [m["step"] for m in resumed.metrics] == list(range(4, FINETUNE_STEPS + 1))
    after = [m["loss"] for m in sp.metrics if m["step"] > 3]
    assert losses(resumed) == pytest.approx(after, abs=DECIMALS)
    assert losses(resumed) == pytest.approx(losses(one)[3:], abs=DECIMALS)


def sequence_parallel(size=2, world=2):
    from accelrun.finetune.ulysses import SequenceParallel
    return SequenceParallel(size, 0, world // size, 0)


def test_what_sequence_parallelism_cannot_train_is_refused_in_one_line():
    """Before any data or model loads: a block, heads or a batch that the group cannot split; once the data is read:
    packed examples (SDPA under Ulysses attends over the whole block). Each one line that says what to do."""
    sp, config = sequence_parallel(), SimpleNamespace(num_attention_heads=4)
    args = SimpleNamespace(block_size=64, model="tiny", packing=True, format="auto")
    assert sp.problem(args, config, 16, 1, 2) is None
    assert sp.problem(args, config, 1, 1, 2) is None  # one sequence per step over the two processes: the point
    odd_block, three_heads = SimpleNamespace(**{**vars(args), "block_size": 63}), SimpleNamespace(num_attention_heads=3)
    cases = {"--block-size 63 does not split into 2 equal slices": (odd_block, config, 16, 1, 2),
             "tiny has 3 attention heads, which 2 processes cannot share": (args, three_heads, 16, 1, 2),
             "--batch-size 3 must divide by data-parallel ranks x --grad-accum = 2": (args, config, 3, 2, 2),
             "3 processes do not split into groups of 2": (args, config, 16, 1, 3)}
    for words, case in cases.items():
        problem = sp.problem(*case)
        assert words in problem and "\n" not in problem, problem
    assert "Give --no-packing" in sp.packing_problem()
    assert sequence_parallel(1).problem(odd_block, config, 3, 2, 2) is None


def test_a_resume_onto_another_sequence_parallel_size_is_refused():
    """A checkpoint records its sequence-parallel size in its layout (when above 1); a run with another is refused
    in one line, and a layout that records a size no run writes is a damaged checkpoint."""
    from accelrun.checkpoint.manifest import _layout_problem
    from accelrun.checkpoint.rules import incompatibility
    written = {"family": "deepspeed", "zero_stage": 3, "world_size": 2, "grad_accum": 1, "sequence_parallel": 2}
    manifest = {"layout": written, "must_match": {"lr": 1.0}}
    now = {k: v for k, v in written.items() if k != "sequence_parallel"}
    problem = incompatibility(manifest, now, {"lr": 1.0})
    assert "written with sequence parallelism of size 2 and this run has 1" in problem and "\n" not in problem
    assert incompatibility(manifest, written, {"lr": 1.0}) is None
    assert _layout_problem(written) is None and _layout_problem(now) is None
    assert "sequence_parallel 3" in _layout_problem({**written, "sequence_parallel": 3})


def test_other_recipes_refuse_a_sequence_parallel_config():
    """mnist, gpt, resnet and linear_regression under a config with sequence parallelism: one line (accelerate would
    stop in prepare() with a traceback: Ulysses works on Hugging Face models only)."""
    from accelerate.utils import DistributedType

    from accelrun import refusals
    said = []
    accelerator = SimpleNamespace(parallelism_config=SimpleNamespace(sp_size=2, sp_backend="deepspeed"),
                                  distributed_type=DistributedType.DEEPSPEED, num_processes=2)
    original = refusals.fail
    refusals.fail = lambda acc, message, everyone=False: said.append(message)
    try:
        refusals.check_sequence_parallel(accelerator, supported=True)
        assert said == []
        refusals.check_sequence_parallel(accelerator, supported=False)
    finally:
        refusals.fail = original
    assert len(said) == 1 and "does not run under sequence parallelism (parallelism_config_sp_size 2" in said[0]


def sequence_parallel_launch_env(config):
    """The environment accelerate launch gives a worker of `config` (accelerate's own code, as slurm_launch.py uses
    it): what Run() reads before Accelerator() is built."""
    import os

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    parsed = launch_command_parser().parse_args(["--config_file", str(REPO / "accelerate_configs" / config),
                                                 "placeholder.py"])
    parsed, defaults, mp_from_config = _validate_launch_command(parsed)
    fields = list(defaults.deepspeed_config) if defaults else []
    parsed.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * mp_from_config)
    _, env = prepare_deepspeed_cmd_env(parsed)
    changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
    return {**changed, "LOCAL_RANK": "0", "RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}


def test_the_sequence_parallel_refusal_comes_before_the_accelerator_is_built(monkeypatch, tmp_path):
    """Issue 53, item 8: `PYTHONPATH=cpu_route accelerate launch --config_file deepspeed_zero3_sp2.yaml
    recipes/mnist.py` compiled DeepSpeed's deepspeed_shm_comm (minutes; Accelerator() sets DeepSpeed's process group
    up) before "this recipe does not run under sequence parallelism", which depends only on the config and the
    recipe. Now Run() refuses it from the launch's environment, before Accelerator(): one line, exit 2, nothing
    built. finetune_lm.py, whose configuration it is, passes the same check."""
    from accelerate import Accelerator
    from accelerate.state import PartialState

    from accelrun import refusals
    from in_process import run_main

    env = sequence_parallel_launch_env(SP)
    assert env["PARALLELISM_CONFIG_SP_SIZE"] == "2" and env["ACCELERATE_USE_DEEPSPEED"] == "true"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)

    def routed(self, cpu=False, sagemaker_dp=False, backend=None):
        return "gloo", None
    routed.cpu_route = True  # on the CPU route, as PYTHONPATH=cpu_route marks it
    monkeypatch.setattr(PartialState, "_prepare_backend", routed)
    built = []

    def accelerator_built(self, *args, **kwargs):
        built.append("Accelerator()")
        raise SystemExit(3)
    monkeypatch.setattr(Accelerator, "__init__", accelerator_built)
    code, output = run_main("mnist", ["--data-dir", tmp_path, "--output-dir", tmp_path / "out"], timeout=60)
    assert built == [] and code == 2, output
    errors = [line for line in output.splitlines() if line.strip()]
    assert errors == ["error: this recipe does not run under sequence parallelism (parallelism_config_sp_size 2 in "
                      "the config): it is finetune_lm.py's, for Hugging Face models. Use the config without it "
                      "(deepspeed_zero3.yaml)"], output
    refusals.check_gpus_before_start(sequence_parallel=True)  # finetune_lm.py: its configuration, not refused here
