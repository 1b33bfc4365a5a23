"""Checkpoints, exact resume, stop signals and crashes: real launches on CPU (see launching.py's CPU route).

Reference runs (one per config, fp32): 2 epochs of 10 optimizer steps, a checkpoint every 4 steps and at each epoch
end, all kept. Resumed runs start from one of those checkpoints and must end bit for bit where the reference ended,
having seen the same samples on every rank. The other recipes' resumes (gpt with dropout, linear_regression,
finetune_lm's LoRA and another --grad-accum) and the resume rules' refusals follow at the end.
"""

import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from launching import (
    FINETUNE_STEPS,
    FP32,
    REPO,
    TEST_SIZE,
    TRAINING,
    LaunchResult,
    check_exit,
    free_port,
    launch_command,
    recipe_args,
    run_command,
)
from run_checks import assert_identical_params, assert_lora_resumes_exactly, assert_same_steps, digest, saved_model_keys

pytestmark = pytest.mark.slow

MID_EPOCH, EPOCH_END = "step-00000015", "step-00000010"  # 10 steps per epoch: step 15 is 5 steps into epoch 1
# 1 process, DDP, each ZeRO stage (with offload) and FSDP; 1gpu/multinode run the same code as cpu/2gpu.
RESUME_CONFIGS = ["cpu.yaml", "2gpu.yaml", "deepspeed_zero1.yaml", "deepspeed_zero2.yaml",
                  "deepspeed_zero3.yaml", "deepspeed_zero3_offload.yaml", "fsdp.yaml"]


def assert_resumed_at(checkpoint, step, epoch, step_in_epoch):
    """The checkpoint's own record of where the training stood: step and sampler position."""
    state = json.loads((checkpoint / "checkpoint.json").read_text())
    assert (state["step"], state["train_state"]["step"]) == (step, step)
    assert (state["train_state"]["epoch"], state["train_state"]["step_in_epoch"]) == (epoch, step_in_epoch)


@pytest.mark.parametrize("config", RESUME_CONFIGS)
def test_resume_mid_epoch_is_exact(launch, reference, config):
    ref, ckpt = reference(config)
    # --checkpoint-every 5 alone sets the cadence: no extra save at the epoch's end (step 10 is one of its own).
    assert sorted(os.listdir(ckpt)) == [f"step-{n:08d}" for n in (5, 10, 15, 20)]
    resumed = launch(config, *TRAINING, "--resume", str(ckpt / MID_EPOCH), launch_args=FP32)
    assert f"resumed from {ckpt / MID_EPOCH} (step 15" in resumed.output
    assert resumed.summary["resumed_from_step"] == 15 and resumed.summary["steps"] == 20
    # How long checkpoints took (docs/measuring.md): 4 saves in the reference, one verified load here.
    assert ref.summary["checkpoints"]["saves"] == 4 and ref.summary["checkpoints"]["save_checksum_s"] > 0
    assert resumed.summary["checkpoints"]["resume_verify_s"] > 0 and resumed.summary["checkpoints"]["resume_load_s"] > 0
    assert_resumed_at(ckpt / MID_EPOCH, step=15, epoch=1, step_in_epoch=5)
    assert resumed.metrics[0]["step"] == 16
    if "offload" in config:
        # DeepSpeed's CPU Adam resumed from step 15 rounds differently in the last bit (seen: 2 of 5 losses one
        # float32 ulp apart, weights within 4e-9; the same before the Run refactor, and an uninterrupted run
        # repeats bit for bit). Everything else must still match: the step, learning rate and epoch of each line.
        assert_same_steps(ref.metrics, resumed.metrics, after_step=15, loss_rel=1e-6)
        for name, weight in ref.params().items():
            torch.testing.assert_close(resumed.params()[name], weight, rtol=0, atol=1e-7, msg=name)
        return
    assert_same_steps(ref.metrics, resumed.metrics, after_step=15)
    assert_identical_params(ref.params(), resumed.params())
    assert resumed.summary["final_loss"] == ref.summary["final_loss"]
    assert resumed.summary["test_accuracy"] == ref.summary["test_accuracy"]
    # Same weights, yet under DeepSpeed the evaluation's summed loss differs in the 6th digit
    # between two processes (observed with ZeRO-2): the forward pass over DeepSpeed's flattened
    # parameter buffers is not bitwise reproducible across runs. Training steps above are.
    assert resumed.summary["test_loss"] == pytest.approx(ref.summary["test_loss"], rel=1e-5)


@pytest.mark.parametrize("config", ["2gpu.yaml", "deepspeed_zero2.yaml"])
def test_resume_at_epoch_boundary_is_exact(launch, reference, config):
    ref, ckpt = reference(config)
    resumed = launch(config, *TRAINING, "--resume", str(ckpt / EPOCH_END), launch_args=FP32)
    assert_resumed_at(ckpt / EPOCH_END, step=10, epoch=1, step_in_epoch=0)
    assert resumed.metrics[0]["step"] == 11
    assert_same_steps(ref.metrics, resumed.metrics, after_step=10)
    assert_identical_params(ref.params(), resumed.params())


@pytest.mark.parametrize("config", ["deepspeed_zero3.yaml", "fsdp.yaml"])
def test_export_loads_into_plain_model(reference, data_dir, config):
    """model.safetensors from sharded runs is one full state dict for the recipe's own class."""
    ref, _ = reference(config)
    sys.path.insert(0, str(REPO / "recipes"))
    from torchvision.datasets import MNIST

    from mnist import ConvNet, to_input

    model = ConvNet()
    model.load_state_dict(load_file(str(ref.out_dir / "model.safetensors")), strict=True)
    test = MNIST(str(next(data_dir.glob("synthetic-*"))), train=False)
    with torch.no_grad():
        predictions = model.eval()(to_input(test.data, torch.float32)).argmax(1)
    assert len(test.targets) == TEST_SIZE
    assert (predictions == test.targets).sum().item() / TEST_SIZE == ref.summary["test_accuracy"]


def test_world_size_change_where_it_can_work(launch, reference):
    """DDP's checkpoint holds the full state: 2 processes -> 1 continues the same training
    (--sync-bn makes 1 and 2 processes compute the same thing; float sums differ, hence atol)."""
    ref, ckpt = reference("2gpu.yaml", "--sync-bn")
    resumed = launch("cpu.yaml", *TRAINING, "--sync-bn", "--resume", str(ckpt / MID_EPOCH), launch_args=FP32)
    assert "written by 2 processes" in resumed.output and resumed.summary["world_size"] == 1
    # Resumed, not retrained: it starts after step 15 and follows the reference's losses from there.
    assert resumed.summary["resumed_from_step"] == 15 and resumed.metrics[0]["step"] == 16
    reference_losses = {r["step"]: r["loss"] for r in ref.metrics}
    for r in resumed.metrics:
        assert r["loss"] == pytest.approx(reference_losses[r["step"]], rel=1e-4), r["step"]
    a, b = ref.params(), resumed.params()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=5e-5, rtol=1e-4, msg=name)


def assert_continues_on_another_shape(ref, run, resumed_from, start, came_from, how, changes):
    """A run resumed from `resumed_from` (step `start`, written by `came_from` processes) on another world size
    and --grad-accum follows the uninterrupted run `ref`: same steps, epochs and learning rates exactly, losses
    to 1e-4 relative, the tolerance test_gpt.py holds 1 process against 2 to (only the order of the sums
    differs: across ranks, across micro-batches; measured 1e-7 and less here), and says what changed."""
    s, world = run.summary, 3 - came_from
    assert (s["world_size"], s["resumed_from_step"], s["resumed_from_world_size"]) == (world, start, came_from)
    assert s["resume_changes"] == [f"world size {came_from} -> {world}: {how}", *changes]
    writers = f"{came_from} process" + ("es" if came_from != 1 else "")
    assert f"resumed from {resumed_from} (step {start}, written by {writers}" in run.output, \
        run.output[-3000:]
    assert f"resumed on another shape: {changes[0]}" in run.output
    assert [r["step"] for r in run.metrics] == list(range(start + 1, 13))
    reference_steps = {r["step"]: r for r in ref.metrics}
    for r in run.metrics:
        expected = reference_steps[r["step"]]
        assert (r["lr"], r["epoch"]) == (expected["lr"], expected["epoch"]), r["step"]
        assert r["loss"] == pytest.approx(expected["loss"], rel=1e-4), r["step"]
    if "--grad-accum 2 -> 1" in changes[-1]:  # gpt's --eval-batches counts micro-batches x processes
        assert s["val_loss"] == pytest.approx(ref.summary["val_loss"], rel=1e-4)
    for name, weight in ref.params().items():
        torch.testing.assert_close(run.params()[name], weight, rtol=1e-4, atol=1e-6, msg=name)


SHRUNK = ["ranks [1] no longer exist: their RNG state{} dropped",
          "--grad-accum 1 -> 2: the same global batch in 2 micro-batch(es) per process"]
GROWN = ["ranks [1] are new: they take rank 0's RNG state{}",
         "--grad-accum 2 -> 1: the same global batch in 1 micro-batch(es) per process"]


def test_fsdp_resumes_on_another_world_size_and_grad_accum(shelf, shelf_data, tmp_path):
    """FSDP2 on the gpt recipe in fp32 (docs/checkpoints.md, "Another number of GPUs"). The 2-process shelf
    run's step 4 resumed by 1 process with --grad-accum 2 (the same global batch of 16 in two micro-batches of
    8); that run's step 8 resumed by 2 processes with --grad-accum 1. Both follow the uninterrupted run."""
    ref = shelf("gpt", "fsdp.yaml")  # the uninterrupted run; it writes the checkpoints resumed below
    written_by_2 = shelf_data / "ckpt-gpt-fsdp.yaml" / "step-00000004"
    one = shelf("gpt", "fsdp.yaml", "--grad-accum", "2", "--checkpoint-dir", str(tmp_path / "one"), "--resume",
                str(written_by_2), launch_args=(*FP32, "--num_processes", "1"))
    two = shelf("gpt", "fsdp.yaml", "--checkpoint-dir", str(tmp_path / "two"), "--resume",
                str(tmp_path / "one" / "step-00000008"))
    how = "torch.distributed.checkpoint reshards the model and optimizer by parameter name onto the new ranks"
    assert_continues_on_another_shape(ref, one, written_by_2, 4, 2, how,
                                      [SHRUNK[0].format(" and buffers are"), SHRUNK[1]])
    assert_continues_on_another_shape(ref, two, tmp_path / "one" / "step-00000008", 8, 1, how,
                                      [GROWN[0].format(" and buffers"), GROWN[1]])
    # The checkpoint the 1-process run wrote records how it split the batch, for the next resume.
    layout = json.loads((tmp_path / "one" / "step-00000008" / "checkpoint.json").read_text())["layout"]
    assert layout == {"family": "fsdp", "zero_stage": None, "world_size": 1, "grad_accum": 2}
    # The new rank took rank 0's RNG state (resharding.rng_for_new_rank): with dropout 0 the RNG never reaches the
    # loss, but it advances every step (the state at step 12 is not step 8's), so the two ranks' states at step 12
    # are equal only if rank 1 started from rank 0's, not from its own seed.
    states = [rng_state(tmp_path / "two" / "step-00000012", rank) for rank in (0, 1)]
    assert not torch.equal(states[0]["torch_manual_seed"],
                           rng_state(tmp_path / "one" / "step-00000008", 0)["torch_manual_seed"])
    assert torch.equal(states[0]["torch_manual_seed"], states[1]["torch_manual_seed"])
    assert states[0]["random_state"] == states[1]["random_state"]
    assert all(np.array_equal(a, b) for a, b in zip(states[0]["numpy_random_seed"], states[1]["numpy_random_seed"]))


def rng_state(checkpoint, rank):
    """accelerate's RNG state of one rank in a checkpoint, read as the resume reads it (weights only)."""
    from accelrun.checkpoint.safe_loading import weights_only_loading
    with weights_only_loading():
        return torch.load(checkpoint / f"random_states_{rank}.pkl")


UNIVERSAL = ("DeepSpeed's universal checkpoint (ds_to_universal, converted once into the checkpoint's universal/ "
             "part, then load_universal) repartitions the {} onto the new ranks")


# 2 -> 1 for every ZeRO stage, and back 1 -> 2 for ZeRO-2 and ZeRO-3: each resume is one launch on top of the
# shelf's uninterrupted runs. ZeRO-3 (offload too) needed accelrun's repair of DeepSpeed's stage-3 universal load
# (resharding.repair_zero3_universal_load): without it the loss drifted 0.2% in 8 steps.
ZERO_BACK_AND_FORTH = {"deepspeed_zero1.yaml": False, "deepspeed_zero2.yaml": True, "deepspeed_zero3.yaml": True,
                       "deepspeed_zero3_offload.yaml": False}


@pytest.mark.parametrize("config", list(ZERO_BACK_AND_FORTH))
def test_zero_resumes_on_another_world_size_through_the_universal_checkpoint(shelf, shelf_data, tmp_path, config):
    """Each ZeRO stage on the gpt recipe in fp32, as the FSDP test above: the shelf run's step 4 resumed by 1
    process with --grad-accum 2 (for ZeRO-2 and ZeRO-3, that run's step 8 then by 2 processes). Each resume
    converts its checkpoint once into universal/ (DeepSpeed's universal checkpoint, with a manifest of its
    own); under ZeRO-2, a converted file changed afterwards refuses the next resume by name, loading nothing."""
    ref = shelf("gpt", config)
    written_by_2 = tmp_path / "copy" / "step-00000004"  # a copy: the conversion writes into the checkpoint
    shutil.copytree(shelf_data / f"ckpt-gpt-{config}" / "step-00000004", written_by_2)
    one = shelf("gpt", config, "--grad-accum", "2", "--checkpoint-dir", str(tmp_path / "one"),
                "--resume", str(written_by_2), launch_args=(*FP32, "--num_processes", "1"))
    how = UNIVERSAL.format("parameters and optimizer state" if "zero3" in config else "optimizer state")
    assert_continues_on_another_shape(ref, one, written_by_2, 4, 2, how, [SHRUNK[0].format(" is"), SHRUNK[1]])
    if ZERO_BACK_AND_FORTH[config]:
        two = shelf("gpt", config, "--checkpoint-dir", str(tmp_path / "two"), "--resume",
                    str(tmp_path / "one" / "step-00000008"))
        assert_continues_on_another_shape(ref, two, tmp_path / "one" / "step-00000008", 8, 1, how,
                                          [GROWN[0].format(""), GROWN[1]])
    # The conversion: a derived part the checkpoint's own manifest does not list, whose manifest records every
    # file it holds with checksums that match, and the checkpoint it came from.
    derived = written_by_2 / "universal"
    assert f"converted {written_by_2}'s ZeRO state to DeepSpeed's universal checkpoint in {derived}" in one.output
    # That line alone: DeepSpeed's converter printed its banner, steps and bars into the log (issue 53, item 9).
    for noise in ("Converting DeepSpeed checkpoint", "Extracting ZeRO fragments", "No AutoEP", "/proc/", "it/s]"):
        assert noise not in one.output, (noise, one.output[-3000:])
    converted = json.loads((derived / "checkpoint.json").read_text())
    on_disk = sorted(str(p.relative_to(derived)) for p in derived.rglob("*") if p.is_file())
    assert sorted(converted["files"]) == [rel for rel in on_disk if rel != "checkpoint.json"]
    assert "latest_universal" in converted["files"] and "pytorch_model/zero/wpe.weight/fp32.pt" in converted["files"]
    from accelrun.checkpoint.files import matches
    for rel, want in converted["files"].items():
        with open(derived / rel, "rb") as f:
            assert set(want) == {"size", "xxh3_128"} and matches(f.fileno(), want), rel
    own = json.loads((written_by_2 / "checkpoint.json").read_text())
    assert converted["derived_from"] == hashlib.sha256(json.dumps(own["files"], sort_keys=True).encode()).hexdigest()
    assert not [rel for rel in own["files"] if rel.startswith("universal")]
    if config != "deepspeed_zero2.yaml":
        return  # the check of a converted part runs the same code for every stage: one launch of it is enough
    # One byte of a converted file flipped: the next resume on 1 process reuses the part, so it must refuse.
    rel = "pytorch_model/zero/wpe.weight/fp32.pt"
    data = bytearray((derived / rel).read_bytes())
    data[-10] ^= 0xFF
    (derived / rel).write_bytes(bytes(data))
    run = shelf("gpt", "deepspeed_zero2.yaml", "--grad-accum", "2", "--checkpoint-dir", str(tmp_path / "three"),
                "--resume", str(written_by_2), launch_args=(*FP32, "--num_processes", "1"), check=False)
    assert run.returncode == 1, run.output[-3000:]
    assert (f"error: checkpoint {written_by_2} cannot be used on 1 process: its converted part {derived}: {rel} "
            f"does not match its recorded size and checksum") in run.output, run.output[-3000:]
    assert f"Remove {derived} to have it converted again" in run.output
    assert "ZeRO state to DeepSpeed's universal checkpoint in" not in run.output  # reused, not converted again
    assert "resumed from" not in run.output


# The file replaced by a pickle that would run code, per engine: accelerate's optimizer state (DDP), one
# rank's ZeRO optimizer shard, one rank's ZeRO-3 model shard, and the pickled index of FSDP's sharded
# checkpoint (torch.distributed.checkpoint's .metadata).
PLANTED = {"2gpu.yaml": "optimizer.bin",
           "deepspeed_zero2.yaml": "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt",
           "deepspeed_zero3.yaml": "pytorch_model/zero_pp_rank_0_mp_rank_00_model_states.pt",
           "fsdp.yaml": "optimizer_0/.metadata"}


class _RunsCode:
    """Unpickling this runs a shell command: what an attacker would plant."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("config", list(PLANTED))
def test_planted_pickle_runs_no_code(launch, reference, tmp_path, config):
    """A checkpoint whose file was replaced by a code-running pickle, with its checksum updated in the
    manifest (whoever can write the file can write the manifest): refused by name, and nothing runs."""
    import hashlib
    import io
    import pickle

    _, ckpt = reference(config)
    if config == "fsdp.yaml":  # sharded: every rank wrote its own part of the model and optimizer
        assert {p.name for p in (ckpt / MID_EPOCH / "pytorch_model_fsdp_0").iterdir()} == {
            ".metadata", "__0_0.distcp", "__1_0.distcp"}
    work, marker, rel = tmp_path / MID_EPOCH, tmp_path / "code-ran", PLANTED[config]
    shutil.copytree(ckpt / MID_EPOCH, work)
    if rel.endswith(".metadata"):
        data = pickle.dumps(_RunsCode(marker))
    else:
        buffer = io.BytesIO()
        torch.save({"state": _RunsCode(marker)}, buffer)
        data = buffer.getvalue()
    (work / rel).write_bytes(data)
    manifest = json.loads((work / "checkpoint.json").read_text())
    manifest["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (work / "checkpoint.json").write_text(json.dumps(manifest))

    run = launch(config, *TRAINING, "--resume", str(work), launch_args=FP32, check=False)
    assert run.returncode == 1, run.output[-3000:]
    assert f"checkpoint {work} cannot be used: rank " in run.output, run.output[-3000:]
    assert f"{rel}: " in run.output and "asks for posix.system" in run.output, run.output[-3000:]
    assert not marker.exists()


def test_resume_refusals(launch, reference, tmp_path):
    _, zero2_ckpt = reference("deepspeed_zero2.yaml")
    _, ddp_ckpt = reference("2gpu.yaml")
    # A DeepSpeed checkpoint in a plain run: different files.
    run = launch("cpu.yaml", *TRAINING, "--resume", str(zero2_ckpt / MID_EPOCH), launch_args=FP32, check=False)
    assert run.returncode == 1 and "written by deepspeed (ZeRO stage 2)" in run.output, run.output[-2000:]
    # A truncated ZeRO shard (one rank's optimizer state): refused by name, nothing loaded.
    work = tmp_path / "zero2-truncated"
    shutil.copytree(zero2_ckpt / MID_EPOCH, work)
    shard = "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(work / shard, 1000)
    run = launch("deepspeed_zero2.yaml", *TRAINING, "--resume", str(work), launch_args=FP32, check=False)
    assert run.returncode == 1, run.output[-2000:]
    assert f"{shard} does not match its recorded size and checksum (truncated or overwritten)" in run.output
    # Another global batch would replay other samples: refused, with the setting named.
    run = launch("2gpu.yaml", *TRAINING, "--batch-size", "100", "--resume", str(ddp_ckpt / MID_EPOCH),
                 launch_args=FP32, check=False)
    assert run.returncode == 1 and "batch_size 200 vs 100" in run.output, run.output[-2000:]
    # --resume none into a directory that holds checkpoints would rotate them away: refused, nothing touched.
    work = tmp_path / "ckpt"
    shutil.copytree(ddp_ckpt, work)
    run = launch("cpu.yaml", *TRAINING, "--checkpoint-dir", str(work), "--resume", "none", launch_args=FP32,
                 check=False)
    assert run.returncode == 1 and "--resume none, but --checkpoint-dir" in run.output, run.output[-2000:]
    assert "step-00000020 the newest" in run.output
    assert sorted(os.listdir(work)) == sorted(os.listdir(ddp_ckpt))
    assert not (run.out_dir / "metrics.jsonl").exists()
    # A --resume path that does not exist says so (not "the save never finished").
    run = launch("cpu.yaml", *TRAINING, "--resume", str(tmp_path / "step-00000099"), launch_args=FP32, check=False)
    assert run.returncode == 1 and "step-00000099: no such directory" in run.output, run.output[-2000:]


def test_checkpoint_dir_that_nodes_do_not_share_is_refused(data_dir, tmp_path):
    """Two 'nodes' on this machine (two launchers, --num_machines 2), each in its own working directory, given
    the same relative --checkpoint-dir: each writes its own disk, as node-local storage would. The first save
    must fail with the shared-storage message, on both nodes, and leave no checkpoint that looks complete."""
    port, nodes = free_port(), []
    for rank in (0, 1):
        cwd = tmp_path / f"node{rank}"
        cwd.mkdir()
        cmd, env = launch_command("multinode.yaml", data_dir, cwd / "out", *TRAINING, "--checkpoint-dir", "ckpt",
                                  launch_args=FP32, recipe=str(REPO / "recipes" / "mnist.py"))
        cmd[cmd.index("--machine_rank") + 1] = str(rank)
        cmd[cmd.index("--num_machines") + 1] = "2"
        cmd[cmd.index("--main_process_port") + 1] = str(port)
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
        nodes.append(subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    for output in outputs:
        check_exit(output, "a node's launcher")
    assert [node.returncode for node in nodes] == [1, 1], outputs[0][-3000:] + outputs[1][-3000:]
    assert "ranks [1] wrote their part of the checkpoint somewhere the main process cannot see" in outputs[0]
    for rank in (0, 1):
        assert not [p for p in (tmp_path / f"node{rank}" / "ckpt").iterdir() if p.name.startswith("step-")]


def test_corrupt_and_unfinished_checkpoints(launch, reference, tmp_path):
    ref, ckpt = reference("cpu.yaml")
    work = tmp_path / "ckpt"
    shutil.copytree(ckpt, work)
    # Newest checkpoint truncated on disk; an unfinished save of a later step; a leftover temp dir.
    with open(work / "step-00000020" / "optimizer.bin", "r+b") as f:
        f.truncate(100)
    (work / "step-00000024").mkdir()
    (work / ".tmp-step-00000028").mkdir()
    (work / ".tmp-step-00000028" / ".accelrun-saving").touch()  # the marker a save writes first (a crash's leftover)
    (work / "step-00000010" / "checkpoint.json").write_text('{"step": 10, "files": ')  # a corrupt manifest
    explicit = launch("cpu.yaml", *TRAINING, "--resume", str(work / "step-00000020"), launch_args=FP32, check=False)
    assert explicit.returncode == 1, explicit.output[-2000:]  # the recipe exits 2; accelerate launch says 1
    assert "optimizer.bin does not match its recorded size and checksum" in explicit.output
    auto = launch("cpu.yaml", *TRAINING, "--checkpoint-dir", str(work), launch_args=FP32)
    assert f"skipping checkpoint {work / 'step-00000024'}: no checkpoint.json" in auto.output
    assert f"skipping checkpoint {work / 'step-00000020'}: optimizer.bin does not match" in auto.output
    assert f"removing {work / '.tmp-step-00000028'}: a save that never finished" in auto.output
    assert f"skipping checkpoint {work / 'step-00000010'}: unreadable checkpoint.json" in auto.output
    assert auto.summary["resumed_from_step"] == 15
    assert_identical_params(ref.params(), auto.params())


def test_same_size_corruption_is_refused(launch, reference, tmp_path):
    """One byte of model.safetensors flipped in place (bit rot, a bad copy): the size still matches, so only the
    SHA-256 in the manifest can tell. The resume refuses the checkpoint by name, exits non-zero, loads nothing."""
    _, ckpt = reference("cpu.yaml")
    work = tmp_path / MID_EPOCH
    shutil.copytree(ckpt / MID_EPOCH, work)
    weights = work / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:  # a byte of the last tensor's data, well past the header
        f.seek(size - 100)
        byte = f.read(1)[0]
        f.seek(size - 100)
        f.write(bytes([byte ^ 0xFF]))
    assert weights.stat().st_size == size
    run = launch("cpu.yaml", *TRAINING, "--resume", str(work), launch_args=FP32, check=False)
    assert run.returncode == 1, run.output[-3000:]
    assert "model.safetensors does not match its recorded size and checksum (truncated or overwritten)" in run.output, \
        run.output[-3000:]
    assert "resumed from" not in run.output and not (run.out_dir / "metrics.jsonl").exists()


def test_resumed_log_windows_match_and_old_checkpoints_are_pruned(launch, reference, tmp_path):
    """A progress line averages the loss since the previous one. Resumed inside such a window (step 15 of
    the 13-16 window), the run still logs the uninterrupted run's losses: the checkpoint keeps the window."""
    ref, ckpt = reference("cpu.yaml", "--log-every", "4")
    pruned = tmp_path / "ckpt"
    resumed = launch("cpu.yaml", *TRAINING, "--log-every", "4", "--resume", str(ckpt / MID_EPOCH), "--checkpoint-dir",
                     str(pruned), "--checkpoint-every", "2", "--keep-last", "2", launch_args=FP32)
    assert [r["step"] for r in resumed.metrics] == [16, 20]
    assert_same_steps(ref.metrics, resumed.metrics, after_step=15)
    # The same run saved steps 16, 18 and 20 and kept the newest two (--keep-last 2).
    assert sorted(p.name for p in pruned.iterdir()) == ["step-00000018", "step-00000020"]
    assert "checkpoint saved: " + str(pruned / "step-00000016") in resumed.output


# ---- the other recipes: their resume rules and exactness (every resume test of the suite in this file, but the
# stops', the attacks' and Slurm's requeues) --------------------------------------------------------------------

@pytest.mark.slow
def test_a_resume_must_match_every_training_flag(shelf, shelf_data):
    """gpt's shelf run (12 steps, --checkpoint-every 4): its final checkpoint refuses a resume that changes
    --max-grad-norm or --dropout (both once left out of a hand-written list), and the same command again
    only says the run is complete."""
    ref = shelf("gpt", "cpu.yaml")
    ckpt = shelf_data / "ckpt-gpt-cpu.yaml"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == [
        "step-00000004", "step-00000008", "step-00000012"]
    manifest = json.loads((ckpt / "step-00000012" / "checkpoint.json").read_text())
    # Every parsed flag is guarded except those that may change: the run services' and the sample's.
    assert {"max_grad_norm", "dropout", "lr", "seed", "batch_size", "grad_accum"} <= set(manifest["must_match"])
    assert not {"output_dir", "log_every", "checkpoint_dir", "resume", "prompt", "peak_tflops"} & set(
        manifest["must_match"])
    command, env = launch_command("cpu.yaml", None, ref.out_dir, *recipe_args("gpt", "cpu.yaml", shelf_data),
                                  recipe="recipes/gpt.py")
    for flag, value, saved in (("--max-grad-norm", "0.5", "1.0"), ("--dropout", "0.1", "0.0")):
        code, output = run_command([*command, flag, value], env=env)
        name = flag[2:].replace("-", "_")
        # 1: accelerate's single-process launcher turns its worker's exit code 2 into its own failure.
        assert code == 1 and f"error: cannot resume from {ckpt / 'step-00000012'}: these settings differ" in output
        assert f"{name} {saved} vs {value}" in output, output[-3000:]
    before = {name: digest(ref.out_dir / name) for name in ("summary.json", "metrics.jsonl", "model.safetensors")}
    code, output = run_command(command, env=env)
    assert code == 0 and "this run is already complete" in output and str(ref.out_dir) in output, output[-3000:]
    assert {name: digest(ref.out_dir / name) for name in before} == before


@pytest.mark.slow
def test_resume_is_exact_with_dropout(shelf_data, tmp_path):
    """Dropout draws from torch's global RNG, which a checkpoint restores; nothing else may draw from it between
    the restore and the next step (a DataLoader's iterator once did, at the resume point). 1 process, gpt with
    --dropout 0.1: resumed from step 4, steps 5-8 log the uninterrupted run's losses bit for bit."""
    base = [sys.executable, str(REPO / "recipes" / "gpt.py"), *recipe_args("gpt", "cpu.yaml", shelf_data)[:-4],
            "--dropout", "0.1", "--max-steps", "8", "--sample-tokens", "0", "--keep-last", "0"]
    code, output = run_command([*base, "--output-dir", str(tmp_path / "whole"), "--checkpoint-dir",
                                str(tmp_path / "ckpt")])
    assert code == 0, output[-3000:]
    code, output = run_command([*base, "--output-dir", str(tmp_path / "resumed"), "--checkpoint-dir",
                                str(tmp_path / "ckpt2"), "--resume", str(tmp_path / "ckpt" / "step-00000004")])
    assert code == 0 and "resumed from" in output, output[-3000:]
    losses = [[(r["step"], r["loss"]) for r in map(json.loads, (tmp_path / name / "metrics.jsonl").open())]
              for name in ("whole", "resumed")]
    assert losses[1] == [step for step in losses[0] if step[0] > 4] and len(losses[1]) == 4




def test_linear_regression_resume_is_exact(shelf, shelf_data, tmp_path):
    ref = shelf("linear_regression", "2gpu.yaml")
    ckpt = shelf_data / "ckpt-linear_regression-2gpu.yaml" / "step-00000004"
    # Its new checkpoints go elsewhere: the reference's directory is read by other tests.
    out = tmp_path / "out"
    resumed = shelf("linear_regression", "2gpu.yaml", "--resume", str(ckpt), "--output-dir", str(out),
                    "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert f"resumed from {ckpt}" in resumed.output
    # Every step's (m, n) as in the uninterrupted run (the progress lines' timings differ, of course).
    exact = ("step", "epoch", "m", "n")
    assert [{k: r[k] for k in exact} for r in LaunchResult(0, "", out).metrics] == [{k: r[k] for k in exact}
                                                                          for r in ref.metrics[4:]]




@pytest.mark.slow
@pytest.mark.parametrize("config", ["2gpu.yaml", "deepspeed_zero3.yaml"])
def test_lora_checkpoint_holds_the_adapters_and_resumes_exactly(lora, hf, tmp_path, config):
    """The checkpoint leaves the frozen base out (the resumed run loads it from --model again); resumed from
    step 3, the run ends with the uninterrupted run's losses and adapter, bit for bit."""
    ref = lora(config)
    step3 = hf / f"ckpt-lora-{config}" / "step-00000003"
    keys = saved_model_keys(step3)  # DeepSpeed's module files: no fragments of the frozen parameters either
    assert keys and all(".lora_" in key for key in keys), keys
    assert_lora_resumes_exactly(functools.partial(lora, config), ref, step3, tmp_path)


@pytest.mark.slow
def test_resume_with_another_grad_accum_from_an_odd_step(finetune, tmp_path):
    """A checkpoint of step 3 written with --grad-accum 1, resumed with --grad-accum 2 (what a job back on fewer
    GPUs does): the steps go on exactly as before. accelerate's restored micro-batch counter (3) would make
    the first micro-batch after the resume an optimizer step of its own (4.89 at step 4 instead of 5.34)."""
    ckpt = ["--checkpoint-every", "3", "--keep-last", "0"]
    ref = finetune("cpu.yaml", "--checkpoint-dir", str(tmp_path / "ref"), *ckpt)
    shutil.copytree(tmp_path / "ref" / "step-00000003", tmp_path / "ckpt" / "step-00000003")
    resumed = finetune("cpu.yaml", "--checkpoint-dir", str(tmp_path / "ckpt"), *ckpt, "--grad-accum", "2")
    assert resumed.summary["resumed_from_step"] == 3
    assert any("--grad-accum 1 -> 2" in change for change in resumed.summary["resume_changes"])
    assert [m["step"] for m in resumed.metrics] == list(range(4, FINETUNE_STEPS + 1))
    for a, b in zip([m for m in ref.metrics if m["step"] > 3], resumed.metrics):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["lr"] == a["lr"], (a, b)
