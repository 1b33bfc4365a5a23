"""recipes/gpt.py, a GPT with ZeRO-3, launched for real under every config (2 CPU processes).

One launch per (recipe, config) serves every assertion about it: the matrix runs are cached by the
session's `shelf` fixture (conftest.py), and the comparisons (1 process against 2, DDP against ZeRO, resume against the
uninterrupted run) reuse them.
"""

import math

import pytest

from launching import ALL_CONFIGS, OFFLOAD
from run_checks import assert_engine, assert_shards_held

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_gpt_under_every_config(shelf, config):
    run = shelf("gpt", config)
    s = run.summary
    assert_engine(s, config)
    assert s["steps"] == 12 and s["preset"] == "tiny"
    assert s["optimizer"] == ("DeepSpeedCPUAdam" if config == OFFLOAD else "AdamW")
    assert_shards_held(s, config)  # ZeRO-3 and FSDP: half of the parameters on each rank
    # FSDP shards per transformer block (gpt.GPT._no_split_modules): the root, blocks.0, blocks.1, and ln_f,
    # which accelerate splits off; not one unit that stays gathered from forward to backward.
    assert s["fsdp_units"] == (4 if config == "fsdp.yaml" else None)
    # Built sharded (run.sharded_init): no process holds the whole model under ZeRO-3 (zero3_init_flag), only
    # the main process under FSDP. The step-by-step match with 1 process below
    # shows that the weights are the same as when built whole.
    sharded = {"deepspeed_zero3.yaml": "partitioned while built (zero.Init)",
               OFFLOAD: "partitioned while built (zero.Init)",
               "fsdp.yaml": "initialised on the main process only, sharded by prepare()"}
    assert s["model_init"] == sharded.get(config, "built whole on every process")
    # The prompt and then --sample-tokens 16 new bytes, decoded as UTF-8 (1 to 4 bytes per character,
    # an invalid byte shown as one replacement character): 4 to 16 characters after the prompt.
    assert s["sample"].startswith("def ") and 4 <= len(s["sample"]) - len("def ") <= 16, s["sample"]
    # Throughput and MFU from their definitions (docs/measuring.md): tiny is 2 layers of width 64, 64 tokens.
    tokens = s["steps"] * 16 * 64
    assert tokens / s["wall_time_s"] <= s["tokens_per_s"] <= tokens / run.metrics[-1]["train_time_s"], s
    flops_per_token = 6 * (s["param_elements"] - 64 * 64) + 12 * 2 * 64 * 64
    assert s["mfu"] == pytest.approx(flops_per_token * s["tokens_per_s"] / (1e12 * s["world_size"]))
    assert math.isfinite(s["val_loss"]) and s["final_loss"] < s["first_loss"]
    assert s["final_loss"] == run.metrics[-1]["loss"]  # defined as the last progress window's loss
    # DDP, ZeRO-1/2/3 and FSDP on 2 processes follow the 1-process losses step by step.
    if config == "cpu.yaml":
        return  # the reference itself
    one = shelf("gpt", "cpu.yaml")
    tolerance = 1e-3 if config == OFFLOAD else 1e-4  # DeepSpeed's CPU Adam rounds differently from torch's
    assert len(one.metrics) == len(run.metrics) == 12
    for a, b in zip(one.metrics, run.metrics):
        assert a["step"] == b["step"] and b["loss"] == pytest.approx(a["loss"], rel=tolerance), (config, a, b)


def test_gpt_fsdp_activation_checkpointing(shelf, tmp_path):
    """fsdp.yaml with accelerate's --fsdp_activation_checkpointing: each block's activations are recomputed
    in backward (checkpoint wrappers, sharded with their blocks), and the training is the same."""
    plain = shelf("gpt", "fsdp.yaml")
    # Its own checkpoint directory: in the matrix run's, --resume auto would start from its last step.
    checkpointed = shelf("gpt", "fsdp.yaml", "--checkpoint-dir", str(tmp_path / "ckpt"),
                         launch_args=("--mixed_precision", "no", "--fsdp_activation_checkpointing", "true"))
    assert checkpointed.summary["resumed_from_step"] is None
    assert checkpointed.summary["fsdp_units"] == 6  # + a CheckpointWrapper around each of the 2 blocks
    assert [m["loss"] for m in checkpointed.metrics] == pytest.approx([m["loss"] for m in plain.metrics], rel=1e-6)


