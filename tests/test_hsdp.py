"""HSDP (accelerate_configs/hsdp.yaml): FSDP2 over a 2-D mesh, dp_replicate copies of the model each sharded over
dp_shard processes (issue 50, item 2). Quick: the label and the engine that runs it, on a fake accelerator. Slow: four
launches of mnist on 4 CPU processes (2 x 2) and on FSDP2 (4 processes, then 2), fp32, without BatchNorm (its
statistics are per rank, so another number of processes would train another model): the shards each rank holds, the
losses against FSDP2 over 4 processes, and a checkpoint of 2 x 2 resumed on FSDP2 over 2 processes and back. The
2-node Slurm job that runs it and requeues is test_slurm_launch.py's."""

from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from accelrun.engines import FSDP2, Engine
from launching import FP32, TRAINING

# The tests' training (launching.TRAINING: 2 epochs of 10 steps of 200 samples, a checkpoint every 5) without
# BatchNorm, so that 2 and 4 processes train the same model.
HSDP_TRAINING = (*TRAINING, "--no-batchnorm")
CHANGE = "torch.distributed.checkpoint reshards the model and optimizer by parameter name onto the new ranks"


class MeshAccelerator:
    """What FSDP2 reads of an Accelerator for its label: the distributed type, the processes, accelerate's
    parallelism_config (dp_replicate_size: HSDP's copies of the model)."""

    def __init__(self, processes, replicate=None):
        self.distributed_type, self.num_processes, self.mixed_precision = DistributedType.FSDP, processes, "bf16"
        self.gradient_accumulation_steps = 1
        self.parallelism_config = (SimpleNamespace(dp_replicate_size=replicate, dp_shard_size=processes // replicate,
                                                   sp_size=1, sp_backend="deepspeed") if replicate else None)
        self.state = SimpleNamespace(dynamo_plugin=None)


def test_hsdp_is_fsdp2_labelled_with_its_mesh():
    """HSDP is FSDP2 (the same engine, checkpoint family and format), its label says hsdp and the two sizes: the
    default output directory runs/<recipe>/hsdp2x2-4proc-bf16 is not FSDP2's over the same 4 processes."""
    hsdp, fsdp = Engine.of(MeshAccelerator(4, replicate=2)), Engine.of(MeshAccelerator(4))
    assert type(hsdp) is FSDP2 and type(fsdp) is FSDP2 and hsdp.layout()["family"] == fsdp.layout()["family"]
    assert (hsdp.replicas, fsdp.replicas) == (2, 1)
    assert hsdp.label() == "hsdp2x2-4proc-bf16" and fsdp.label() == "fsdp-4proc-bf16"
    assert Engine.of(MeshAccelerator(32, replicate=4)).label() == "hsdp4x8-32proc-bf16"
    # One node (replicate 1, shard = its processes): FSDP2, labelled so.
    assert Engine.of(MeshAccelerator(2, replicate=1)).label() == "fsdp-2proc-bf16"


@pytest.fixture(scope="module")
def runs(launch, reference, tmp_path_factory):
    """The four launches: HSDP 2 x 2 with its checkpoints (conftest's reference run, which test_slurm_launch.py's HSDP
    job compares to), FSDP2 over 4 processes, HSDP's step 5 resumed on FSDP2 over 2 processes (checkpointing), and
    that run's step 10 resumed back on HSDP 2 x 2."""
    root = tmp_path_factory.mktemp("hsdp")
    hsdp, ckpt = reference("hsdp.yaml", "--no-batchnorm")
    fsdp4 = launch("fsdp.yaml", *HSDP_TRAINING, launch_args=(*FP32, "--num_processes", "4"))
    on_two = launch("fsdp.yaml", *HSDP_TRAINING, "--checkpoint-dir", str(root / "two"), "--resume",
                    str(ckpt / "step-00000005"), launch_args=FP32)
    back = launch("hsdp.yaml", *HSDP_TRAINING, "--checkpoint-dir", str(root / "back"), "--resume",
                  str(root / "two" / "step-00000010"), launch_args=FP32)
    return SimpleNamespace(ckpt=ckpt, hsdp=hsdp, fsdp4=fsdp4, on_two=on_two, back=back)


@pytest.mark.slow
def test_each_rank_holds_half_of_every_parameter_equal_across_replicas(runs):
    """2 x 2 on 4 CPU processes: every rank holds half the elements (the summary's count of what each rank really
    holds: DTensor.to_local), ranks 0 and 2 (shard 0 of each copy) the same values, ranks 1 and 3 (shard 1) the
    same, shard 0 not shard 1's; and the checkpoint's torch.distributed.checkpoint metadata has each parameter in 2
    chunks of half its rows, each written once (the replicas' copies are not written twice)."""
    from torch.distributed.checkpoint import FileSystemReader

    s = runs.hsdp.summary
    assert (s["distributed_type"], s["world_size"], s["steps"]) == ("FSDP", 4, 20)
    assert s["param_elements_per_rank"] == [s["param_elements"] // 2] * 4, s["param_elements_per_rank"]
    checksums = s["param_checksum_per_rank"]
    assert checksums[0] == checksums[2] and checksums[1] == checksums[3] and checksums[0] != checksums[1], checksums
    metadata = FileSystemReader(str(runs.ckpt / "step-00000005" / "pytorch_model_fsdp_0")).read_metadata()
    parameters = {name: meta for name, meta in metadata.state_dict_metadata.items()
                  if name.endswith(("weight", "bias"))}
    assert len(parameters) >= 4 and sum(meta.size.numel() for meta in parameters.values()) == s["param_elements"]
    for name, meta in parameters.items():
        rows = meta.size[0]
        assert [(c.offsets[0], c.sizes[0]) for c in meta.chunks] == [(0, rows // 2), (rows // 2, rows // 2)], name
        assert list(meta.chunks[0].sizes[1:]) == list(meta.size[1:]), name
    written = [index for index in metadata.storage_data if index.fqn in parameters]
    assert len(written) == 2 * len(parameters)


@pytest.mark.slow
def test_hsdp_trains_to_fsdp2s_losses_over_the_same_processes(runs):
    """The same 4 processes read the same samples under both: the losses are FSDP2's over 4 processes to 1e-6 (only
    the order of the gradient sums differs: reduce-scatter within a copy, then all-reduce across copies), the first 3
    steps and every one after."""
    hsdp, fsdp4 = runs.hsdp.metrics, runs.fsdp4.metrics
    assert runs.fsdp4.summary["world_size"] == 4 and [r["step"] for r in hsdp] == [r["step"] for r in fsdp4]
    assert [r["loss"] for r in hsdp[:3]] == pytest.approx([r["loss"] for r in fsdp4[:3]], rel=1e-6, abs=1e-6)
    assert [r["loss"] for r in hsdp] == pytest.approx([r["loss"] for r in fsdp4], rel=1e-5)
    assert [r["lr"] for r in hsdp] == [r["lr"] for r in fsdp4]


def assert_continues(ref, run, start, came_from, world):
    """A run resumed at `start` from a checkpoint of `came_from` processes, on `world`: it says so, and follows the
    uninterrupted HSDP run: the same steps, learning rates and epochs exactly; losses to 1e-5 relative and the final
    weights to 1e-4 (the norm of the difference against the weights'): 2 processes sum the gradients in another
    order, and Adam's update turns that into differences of up to 2e-5 in the weights near zero (measured: losses
    7e-7 relative at most, weights 2.1e-5 by norm, FSDP2 over 4 processes against 2 x 2: 3.7e-7)."""
    s = run.summary
    assert (s["world_size"], s["resumed_from_step"], s["resumed_from_world_size"]) == (world, start, came_from)
    assert s["resume_changes"][0] == f"world size {came_from} -> {world}: {CHANGE}", s["resume_changes"]
    expected = {r["step"]: r for r in ref.metrics}
    assert [r["step"] for r in run.metrics] == list(range(start + 1, 21))
    for r in run.metrics:
        assert (r["lr"], r["epoch"]) == (expected[r["step"]]["lr"], expected[r["step"]]["epoch"]), r["step"]
        assert r["loss"] == pytest.approx(expected[r["step"]]["loss"], rel=1e-5), r["step"]
    weights, resumed = ref.params(), run.params()
    assert resumed.keys() == weights.keys()
    a, b = (torch.cat([params[name].flatten() for name in sorted(weights)]) for params in (weights, resumed))
    assert ((a - b).norm() / a.norm()).item() < 1e-4


@pytest.mark.slow
def test_a_checkpoint_of_2x2_resumes_on_fsdp2_over_2_processes_and_back(runs):
    """HSDP's checkpoints are FSDP2's (family fsdp, torch.distributed.checkpoint's folders): step 5 of 2 x 2 resumes
    on FSDP2 over 2 processes, whose step 10 resumes back on 2 x 2; both follow the uninterrupted 2 x 2 run."""
    assert_continues(runs.hsdp, runs.on_two, 5, 4, 2)
    assert_continues(runs.hsdp, runs.back, 10, 2, 4)
    assert runs.back.summary["param_elements_per_rank"] == [runs.hsdp.summary["param_elements"] // 2] * 4
