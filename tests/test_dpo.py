"""recipes/dpo.py (finetune/preference.py) on the tiny model (accelrun.data.tiny_hf) and a learnable preference set
(preference.write_toy_pairs: whether a number is even, chosen the right answer).

In this process (tests/helpers/in_process.py): the first loss is ln 2 (the policy is the reference), the reference
from disabled adapters equals a separate frozen copy's, a precomputed reference gives the on-the-fly losses, a
resume continues exactly (LoRA, and a full fine-tune whose table is computed again from a frozen copy), a full
fine-tune's frozen reference gives the precomputed losses, and the refusals are one line each. Launched (4 launches,
conftest's dpo fixture, STEPS steps each): one process, DDP, ZeRO-3 and FSDP2 agree step by step from ln 2, and the
one-process run prefers the chosen answers of held-out pairs; one more: a full fine-tune under FSDP2, its frozen
reference sharded as the policy.
"""

import json
import math
import shutil
import sys

import pytest
import torch

from accelrun.finetune.preference import write_toy_pairs
from in_process import run_main
from launching import REPO
from run_checks import assert_engine

sys.path.insert(0, str(REPO / "recipes"))
LN2 = math.log(2)
# The fewest steps after which the one-process LoRA run prefers the chosen answer of at least 90% of the held-out
# pairs (measured 2026-11-28: 50 steps 80%, 55 85%, 60 90%, 80 95%); 80 steps before, 25% more time per launch.
STEPS = 60
FULL = ["--lr", "1e-3"]  # a full fine-tune (no --lora-r): every weight moves, so a smaller step


def dpo_args(hf, steps=STEPS, lora=True):
    return ["--model", str(hf / "model"), "--data-files", str(hf / "prefs.jsonl"), *(["--lora-r", "8"] if lora else []),
            "--block-size", "32", "--batch-size", "16", "--max-steps", str(steps), "--lr", "1e-2", "--beta", "0.5",
            "--log-every", "1", "--eval-every", str(steps), "--save-dtype", "float32"]


@pytest.fixture(scope="module")
def prefs(hf):
    if not (hf / "prefs.jsonl").exists():
        write_toy_pairs(hf / "prefs.jsonl")
    return hf / "prefs.jsonl"


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # in this process, 4 steps twice: 20 s
def test_first_loss_is_ln2_and_a_precomputed_reference_gives_the_same_losses(hf, prefs, tmp_path):
    runs = {}
    for name, extra in (("on the fly", []), ("precomputed", ["--precompute-ref"])):
        code, output = run_main("dpo", [*dpo_args(hf, 4), *extra, "--output-dir", tmp_path / name], timeout=300)
        assert code == 0, output[-3000:]
        runs[name] = losses(tmp_path / name)
    assert runs["on the fly"][0] == pytest.approx(LN2, abs=1e-6)
    assert runs["precomputed"] == pytest.approx(runs["on the fly"], abs=1e-6)
    assert len(set(runs["on the fly"])) == 4  # it trains
    summary = json.loads((tmp_path / "precomputed" / "summary.json").read_text())
    assert summary["reference"] == "precomputed" and {"val_loss", "val_reward_accuracy"} <= summary.keys()
    assert (tmp_path / "precomputed" / "adapter" / "adapter_config.json").is_file()


def test_disabled_adapters_give_a_frozen_copys_log_probabilities(hf, prefs):
    """The on-the-fly reference of a LoRA run: the policy with its (trained, nonzero) adapters disabled gives what a
    separate frozen copy of the base gives, to 1e-6."""
    import argparse

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from accelrun.finetune.lora import with_lora
    from accelrun.finetune.preference import collate, disabled_adapter_logps, load_pairs, sequence_logps
    from dpo import parse_args
    args = parse_args(dpo_args(hf))
    pairs = load_pairs(argparse.Namespace(**vars(args)), AutoTokenizer.from_pretrained(hf / "model"), 32, 8)
    batch = collate([pairs.train[i] for i in range(6)])
    frozen = AutoModelForCausalLM.from_pretrained(hf / "model").eval()
    policy = with_lora(AutoModelForCausalLM.from_pretrained(hf / "model"), args).eval()
    for name, p in policy.named_parameters():
        if "lora_" in name:
            p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) / 4
    with torch.no_grad():
        expected, adapted = sequence_logps(frozen, batch, None), sequence_logps(policy, batch, None)
    got = disabled_adapter_logps(policy, policy, batch, None)
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)
    assert (adapted - expected).abs().max() > 1e-2  # the adapters matter


@pytest.mark.slow  # in this process, 6 + 3 steps: 25 s
def test_a_resumed_run_continues_exactly(hf, prefs, tmp_path):
    """Stopped after step 3 (its checkpoint) and resumed with --precompute-ref: the steps after it are the
    uninterrupted run's, and the adapter is the same bytes."""
    common = [*dpo_args(hf, 6), "--precompute-ref", "--checkpoint-every", "3", "--keep-last", "0"]
    code, output = run_main("dpo", [*common, "--checkpoint-dir", tmp_path / "ckpt", "--output-dir", tmp_path / "a"],
                            timeout=300)
    assert code == 0, output[-3000:]
    shutil.copytree(tmp_path / "ckpt" / "step-00000003", tmp_path / "ckpt2" / "step-00000003")
    code, output = run_main("dpo", [*common, "--checkpoint-dir", tmp_path / "ckpt2", "--output-dir", tmp_path / "b"],
                            timeout=300)
    assert code == 0, output[-3000:]
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["resumed_from_step"] == 3
    assert losses(tmp_path / "b") == losses(tmp_path / "a")[3:]
    adapter = "adapter/adapter_model.safetensors"
    assert (tmp_path / "b" / adapter).read_bytes() == (tmp_path / "a" / adapter).read_bytes()
    # The data changed: the precomputed reference (and the pairs) are not those the checkpoint trained on.
    changed = tmp_path / "changed.jsonl"
    changed.write_text(prefs.read_text().replace("is 1", "is 3"))
    code, output = run_main("dpo", [*common, "--data-files", changed, "--max-steps", "9", "--checkpoint-dir",
                                    tmp_path / "ckpt", "--output-dir", tmp_path / "a"], timeout=300)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "data_sha256" in errors[0], output[-3000:]


@pytest.mark.parametrize("record, words", [
    ({"prompt": "Question: is 2 even?\nAnswer:", "chosen": " Yes."}, "line 21: it has no 'rejected'"),
    ({"prompt": "Question: is 2 even? " * 20, "chosen": " Yes.", "rejected": " No."},
     "line 21: its prompt is"),
])
def test_a_bad_record_is_refused_with_its_file_and_line(hf, prefs, tmp_path, record, words):
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(prefs.read_text().splitlines(keepends=True)[:20]) + json.dumps(record) + "\n")
    code, output = run_main("dpo", [*dpo_args(hf, 2), "--data-files", data, "--output-dir", tmp_path / "out"])
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and f"{data}, {words}" in errors[0], output[-3000:]
    assert "Traceback" not in output


@pytest.mark.slow
@pytest.mark.parametrize("config", ["2gpu.yaml", "deepspeed_zero3.yaml", "fsdp.yaml"])
def test_engines_agree_step_by_step_from_ln2(dpo, config):
    """LoRA DPO (--lora-r 8) under DDP, ZeRO-3 and FSDP2 (2 CPU processes) follows one process step by step; every
    first loss is ln 2 (0.6931 as printed); the one-process run, trained, prefers the chosen answers of the held-out
    pairs, and the 2-process run ends with a held-out reward accuracy above 0.5 and one process's validation loss
    (issue 56's done-when: fsdp.yaml)."""
    one, run = dpo("cpu.yaml"), dpo(config)
    assert_engine(run.summary, config)
    assert one.summary["val_reward_accuracy"] >= 0.9 and run.summary["val_reward_accuracy"] > 0.5
    assert round(one.summary["first_loss"], 4) == round(run.summary["first_loss"], 4) == 0.6931  # as printed
    first = [[m["loss"] for m in r.metrics][:5] for r in (one, run)]
    assert first[0][0] == pytest.approx(LN2, abs=1e-6) and first[1][0] == pytest.approx(LN2, abs=1e-6)
    assert first[1] == pytest.approx(first[0], rel=1e-4)
    # After 60 steps at lr 1e-2 the reduction order's rounding has grown (FSDP2: 0.31660 against 0.31655; at 80
    # steps 0.2217 against 0.2210): the done-when's "same validation loss" is fsdp.yaml's to 1e-3
    rel = 1e-3 if config == "fsdp.yaml" else 1e-2
    assert run.summary["val_loss"] == pytest.approx(one.summary["val_loss"], rel=rel)


@pytest.fixture(scope="module")
def full_runs(hf, prefs, tmp_path_factory):
    """A full fine-tune's DPO in this process, 6 steps: with its frozen reference, and with --precompute-ref
    checkpointing at step 3, then that run resumed from its step 3 (its table computed again from a frozen copy)."""
    root, runs = tmp_path_factory.mktemp("dpo-full"), {}
    common = [*dpo_args(hf, 6, lora=False), *FULL]
    saving = ["--precompute-ref", "--checkpoint-every", "3", "--keep-last", "0"]
    for name, extra in (("frozen", []), ("precomputed", [*saving, "--checkpoint-dir", root / "ckpt"])):
        code, output = run_main("dpo", [*common, *extra, "--output-dir", root / name], timeout=300)
        assert code == 0, output[-3000:]
        runs[name] = root / name
    shutil.copytree(root / "ckpt" / "step-00000003", root / "ckpt2" / "step-00000003")
    code, output = run_main("dpo", [*common, *saving, "--checkpoint-dir", root / "ckpt2", "--output-dir",
                                    root / "resumed"], timeout=300)
    assert code == 0 and "reference log-probabilities of 400 pairs computed" in output, output[-3000:]
    runs["resumed"] = root / "resumed"
    return runs


@pytest.mark.slow  # in this process, 6 + 6 + 3 steps of a full fine-tune: 30 s
def test_a_full_fine_tunes_frozen_reference_and_its_precomputed_resume(full_runs):
    """A full fine-tune (no --lora-r): its reference a frozen copy of --model, from ln 2, the losses of the table
    the policy computed before its first step; and with --precompute-ref resumed from step 3, the table computed
    again from a frozen copy gives the uninterrupted run's losses and model, exactly."""
    frozen, precomputed, resumed = (losses(full_runs[n]) for n in ("frozen", "precomputed", "resumed"))
    assert frozen[0] == pytest.approx(LN2, abs=1e-6) and len(set(frozen)) == 6
    assert precomputed == pytest.approx(frozen, abs=1e-6)
    assert resumed == precomputed[3:]
    summaries = {n: json.loads((full_runs[n] / "summary.json").read_text()) for n in full_runs}
    assert summaries["frozen"]["reference"] == "frozen copy" and summaries["resumed"]["resumed_from_step"] == 3
    weights = "model/model.safetensors"
    assert (full_runs["resumed"] / weights).read_bytes() == (full_runs["precomputed"] / weights).read_bytes()


@pytest.mark.slow
def test_fsdp2_full_fine_tune_shards_its_frozen_reference(launch, hf, full_runs):
    """FSDP2 on 2 CPU processes, a full fine-tune: its frozen reference loaded and sharded as the policy
    (fsdp2_prepare_model, no optimizer) gives ln 2 at the first step and one process's losses step by step."""
    run = launch("fsdp.yaml", *dpo_args(hf, 6, lora=False), *FULL, launch_args=("--mixed_precision", "no"),
                 recipe="recipes/dpo.py")
    assert_engine(run.summary, "fsdp.yaml")
    assert run.summary["reference"] == "frozen copy" and run.summary["lora_r"] == 0
    got = [m["loss"] for m in run.metrics]
    assert got[0] == pytest.approx(LN2, abs=1e-6)
    assert got == pytest.approx(losses(full_runs["frozen"]), rel=1e-4)
