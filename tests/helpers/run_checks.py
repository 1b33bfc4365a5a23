"""Assertions on what a launched run did, shared by several test files.

Owns the comparisons between two runs (the same parameters bit for bit, the same metrics step by step,
timings aside) and the checks on one run's summary (the engine that really ran, the part of the weights
each rank holds, a config refused with one clear line), a LoRA checkpoint's saved model keys and its exact resume,
and a file's digest (a result not rewritten).
"""

import hashlib
import shutil

import pytest
import torch

from launching import EXPECTED


def assert_identical_params(a, b):
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"parameters differ: {different}"


TIMINGS = {"train_time_s", "samples_per_s", "tokens_per_s", "data_ms", "compute_ms", "forward_backward_ms",
           "optimizer_ms", "other_ms", "data_fraction", "mfu"}


def assert_same_steps(reference_metrics, resumed_metrics, after_step, loss_rel=0.0):
    """The resumed run's metrics.jsonl lines after the resume equal the uninterrupted run's, line for line:
    every field but the timings (loss, learning rate, epoch, step), exactly; the loss within loss_rel if given."""
    expected = [{k: v for k, v in r.items() if k not in TIMINGS} for r in reference_metrics if r["step"] > after_step]
    got = [{k: v for k, v in r.items() if k not in TIMINGS} for r in resumed_metrics if r["step"] > after_step]
    assert got and len(got) == len(expected)
    if loss_rel:
        assert [r.pop("loss") for r in got] == pytest.approx([r.pop("loss") for r in expected], rel=loss_rel)
    assert got == expected


def assert_engine(summary, config):
    dist_type, world, stage, _ = EXPECTED[config]
    assert (summary["distributed_type"], summary["world_size"], summary["deepspeed_stage"]) == (dist_type, world, stage)


def assert_refused(run, words):
    """A config that makes no sense for the recipe: one clear line, a non-zero exit, no traceback."""
    assert run.returncode != 0
    errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and words in errors[0], run.output[-3000:]
    # torchrun prints its own ChildFailedError traceback for any failed worker; the recipe must not add one.
    assert "[rank0]: Traceback" not in run.output and "[rank1]: Traceback" not in run.output
    assert "terminate called" not in run.output


def assert_shards_held(summary, config):
    per_rank = summary["param_elements_per_rank"]
    if EXPECTED[config][3]:  # ZeRO-3 / FSDP: each rank really holds only its part
        assert all(n < summary["param_elements"] for n in per_rank) and sum(per_rank) >= summary["param_elements"]
    else:
        assert all(n == summary["param_elements"] for n in per_rank)
        assert len(set(summary["param_checksum_per_rank"])) == 1


def digest(path):
    """SHA-256 of a file's bytes: what a test compares to say a result was not rewritten."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def saved_model_keys(step):
    """The keys of the model a checkpoint of any engine saved: one process's and DDP's model.safetensors, DeepSpeed's
    module states (one per rank under ZeRO-3, with no fragment of a frozen parameter), or FSDP2's
    torch.distributed.checkpoint folder."""
    if (step / "model.safetensors").exists():
        from safetensors import safe_open
        with safe_open(step / "model.safetensors", "pt") as f:
            return list(f.keys())
    if (step / "pytorch_model").is_dir():
        keys = []
        for part in (step / "pytorch_model").glob("*_model_states.pt"):
            states = torch.load(part, weights_only=True)
            assert not states["frozen_param_fragments"], part
            keys += list(states["module"])
        return keys
    from torch.distributed.checkpoint import FileSystemReader
    return list(FileSystemReader(str(step / "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata)


def assert_lora_resumes_exactly(resume, ref, step, tmp_path):
    """The LoRA checkpoint `step` copied into a checkpoint directory of its own and resumed there
    (resume(checkpoint_dir=...) launches the run): it ends with the uninterrupted run `ref`'s losses after that step
    and its adapter, bit for bit."""
    shutil.copytree(step, tmp_path / "ckpt" / step.name)
    resumed = resume(checkpoint_dir=tmp_path / "ckpt")
    number = int(step.name.removeprefix("step-"))
    assert resumed.summary["resumed_from_step"] == number
    assert [m["loss"] for m in resumed.metrics] == [m["loss"] for m in ref.metrics if m["step"] > number]
    adapter = "adapter/adapter_model.safetensors"
    assert (resumed.out_dir / adapter).read_bytes() == (ref.out_dir / adapter).read_bytes()
