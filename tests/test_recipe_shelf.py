"""The course labs and the two workloads, each launched for real under every config (2 CPU processes).

One launch per (recipe, config) serves every assertion about it: the matrix runs are cached by
the session's `launch` fixture, and the comparisons (1 process against 2, DDP against ZeRO,
resume against the uninterrupted run) reuse them.
"""

import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch
from PIL import Image

from conftest import ALL_CONFIGS, EXPECTED, FP32, REPO, Run, frozen, rank_of, thawed
from image_folder import write_image_folder

pytestmark = pytest.mark.slow

OFFLOAD = "deepspeed_zero3_offload.yaml"
TWO_PROCESS = [c for c in ALL_CONFIGS if EXPECTED[c][1] == 2]


@pytest.fixture(scope="session")
def shelf_data(tmp_path_factory):
    """A text corpus for gpt.py, PNG/JPEG class folders for resnet.py, and a checkpoint root."""
    root = tmp_path_factory.mktemp("shelf")
    lines = [f"{i % 97:02d}: the {('quick', 'lazy', 'small')[i % 3]} fox number {i * 7 % 13} jumps over dog {i % 5}."
             for i in range(3000)]
    (root / "corpus.txt").write_text("\n".join(lines))
    write_image_folder(root / "images", train_per_class=48, val_per_class=11, size=20)
    return root


def recipe_args(recipe, config, data):
    """The matrix run's arguments: small, fp32 where runs are compared, checkpoints where resumes are tested."""
    ckpt = ["--checkpoint-dir", str(data / f"ckpt-{recipe}-{config}"), "--keep-last", "0"]
    return {
        "linear_regression": ["--epochs", "2", "--num-points", "256", "--batch-size", "32", "--log-every", "4",
                              "--checkpoint-every", "4", "--plot", "--compare-batch-sizes", *ckpt],
        "pi": ["--intervals", "1e3,1e5,1e6"],
        "data_sharding": [],
        "resnet": ["--data-dir", str(data / "images"), "--image-size", "16", "--batch-size", "16", "--epochs", "1",
                   "--max-steps", "3", "--num-workers", "1", "--log-every", "1"],
        "gpt": ["--preset", "tiny", "--data-files", str(data / "corpus.txt"), "--max-steps", "12", "--batch-size", "16",
                "--log-every", "1", "--eval-every", "6", "--eval-batches", "4", "--warmup-steps", "2",
                "--sample-tokens", "16", "--peak-tflops", "1", "--checkpoint-every", "4", *ckpt],
    }[recipe]


@pytest.fixture(scope="session")
def shelf(launch, shelf_data):
    """shelf(recipe, config, *extra, launch_args=FP32, check=True, env=None) -> Run of recipes/<recipe>.py."""
    def _shelf(recipe, config, *extra, launch_args=FP32, check=True, env=None):
        return launch(config, *recipe_args(recipe, config, shelf_data), *extra, launch_args=launch_args,
                      recipe=f"recipes/{recipe}.py", check=check, env=env)
    return _shelf


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


# ---- linear_regression: data parallelism is large-batch SGD ----------------------------------------

@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_linear_regression_under_every_config(shelf, config):
    run = shelf("linear_regression", config, check=config != OFFLOAD)
    if config == OFFLOAD:
        return assert_refused(run, "DeepSpeed optimizer offload silently replaces SGD")
    s = run.summary
    assert_engine(s, config)
    assert s["steps"] == 16 and s["optimizer"] == "SGD"
    # From the lab's start (-1, 2) to near the least-squares line.
    assert s["distance_to_least_squares"] < 0.3 * math.hypot(-1 - s["least_squares"]["m"], 2 - s["least_squares"]["n"])
    assert [m["step"] for m in run.metrics] == list(range(1, 17))
    with Image.open(run.out_dir / "trajectory.png") as image:
        assert image.format == "PNG" and image.size[0] > 300
    # The point of the lab: global batch B on 2 processes (B/2 each) walks the same path as B on 1 process.
    if config == "cpu.yaml":
        return  # the reference itself
    one = shelf("linear_regression", "cpu.yaml")
    assert len(one.metrics) == len(run.metrics) == 16
    for a, b in zip(one.metrics, run.metrics):
        assert abs(a["m"] - b["m"]) <= 1e-6 and abs(a["n"] - b["n"]) <= 1e-6, (config, a, b)


# The lab's SGD written out by hand: the same points and the same (seeded) batch order, which the test
# takes from accelerate's own prepared loader in a fresh process; float64 arithmetic.
HAND_SGD = """
import sys, types
sys.path.insert(0, "recipes")
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset
from linear_regression import make_points
args = types.SimpleNamespace(seed=0, num_points=256, true_m=2.0, true_n=-1.0, noise=0.5)
accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True,
                                                                             use_seedable_sampler=True))
set_seed(0)
x, y = make_points(args)
loader = accelerator.prepare(DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, drop_last=True))
m, n, path = -1.0, 2.0, []
for epoch in range(2):
    loader.set_epoch(epoch)
    for xb, yb in loader:
        xb, yb = xb.double().flatten(), yb.double().flatten()
        residual = m * xb + n - yb
        m, n = m - 0.1 * (2 * residual * xb).mean().item(), n - 0.1 * (2 * residual).mean().item()
        path.append((m, n))
print(path)
"""


def test_linear_regression_follows_hand_written_sgd(shelf):
    """The 1-process run's (m, n) at every step is plain SGD's, computed independently (to 1e-6: fp32)."""
    result = subprocess.run([sys.executable, "-c", HAND_SGD], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = eval(result.stdout.strip().splitlines()[-1])  # a list of (m, n) from our own script
    run = shelf("linear_regression", "cpu.yaml")
    assert len(run.metrics) == len(expected) == 16
    for record, (m, n) in zip(run.metrics, expected):
        assert abs(record["m"] - m) <= 1e-6 and abs(record["n"] - n) <= 1e-6, (record, m, n)


def test_linear_regression_scale_lr(shelf):
    plain = shelf("linear_regression", "2gpu.yaml")
    scaled = shelf("linear_regression", "2gpu.yaml", "--scale-lr", "--checkpoint-dir", "")
    assert "SGD lr 0.2 " in scaled.output and "SGD lr 0.1 " in plain.output
    assert scaled.metrics[0]["m"] != pytest.approx(plain.metrics[0]["m"], abs=1e-4)


def test_linear_regression_resume_is_exact(shelf, shelf_data, tmp_path):
    ref = shelf("linear_regression", "2gpu.yaml")
    ckpt = shelf_data / "ckpt-linear_regression-2gpu.yaml" / "step-00000004"
    # Its new checkpoints go elsewhere: the reference's directory is read by other tests.
    out = tmp_path / "out"
    resumed = shelf("linear_regression", "2gpu.yaml", "--resume", str(ckpt), "--output-dir", str(out),
                    "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert f"resumed from {ckpt}" in resumed.output
    assert Run(0, "", out).metrics == ref.metrics[4:]


# ---- pi: an all-reduce you can check --------------------------------------------------------------

@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_pi_under_every_config(shelf, config):
    s = shelf("pi", config, launch_args=()).summary
    assert_engine(s, config)
    one = shelf("pi", "cpu.yaml", launch_args=()).summary
    assert len(s["results"]) == len(one["results"]) == 3
    for row, ref in zip(s["results"], one["results"]):
        assert abs(row["pi"] - ref["pi"]) <= 1e-12 * math.pi, (row, ref)
        assert sum(row["intervals_per_rank"]) == row["intervals"] and len(row["intervals_per_rank"]) == s["world_size"]
    errors = [abs(row["error"]) for row in s["results"]]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-12, errors  # shrinks as N grows


def test_pi_on_three_processes(shelf):
    three = shelf("pi", "2gpu.yaml", launch_args=("--num_processes", "3")).summary
    one = shelf("pi", "cpu.yaml", launch_args=()).summary
    assert three["world_size"] == 3 and len(three["results"]) == len(one["results"]) == 3
    assert three["results"][0]["intervals_per_rank"] == [333, 333, 334]
    for row, ref in zip(three["results"], one["results"]):
        assert abs(row["pi"] - ref["pi"]) <= 1e-12 * math.pi


# ---- data_sharding: what each rank sees ----------------------------------------------------------

def shards(run):
    return json.loads((run.out_dir / "shards.json").read_text())


@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_data_sharding_under_every_config(shelf, config):
    run = shelf("data_sharding", config, launch_args=())
    assert_engine(run.summary, config)
    epochs, world = shards(run), EXPECTED[config][1]
    one_process = shards(shelf("data_sharding", "cpu.yaml", launch_args=()))
    orders = []
    for epoch, single in zip(epochs, one_process):
        per_rank = epoch["batches_per_rank"]
        assert len(per_rank) == world and len({len(b) for b in per_rank}) == 1  # the same steps on every rank
        # The global order is the 1-process order, each batch cut into world-size slices...
        global_order = [i for step in zip(*per_rank) for part in step for i in part]
        single_order = [i for b in single["batches_per_rank"][0] for i in b]
        assert sorted(single_order) == list(range(23)) and global_order[:23] == single_order
        if world == 2:
            # ...and with 23 samples and batch 4 the short last batch is topped up with the epoch's first sample,
            # so both ranks run 6 steps. The shards are disjoint apart from that one repeated sample.
            assert global_order[23:] == single_order[:1]
            first, second = (set(i for b in batches for i in b) for batches in per_rank)
            assert first & second in (set(), {global_order[0]})
        assert epoch["evaluated"] == list(range(23))  # gather_for_metrics drops the repeat
        orders.append(global_order)
    assert orders[0] != orders[1]  # reshuffled each epoch
    if world == 2:  # the same seed gives the same shards, whatever the engine
        assert epochs == shards(shelf("data_sharding", "2gpu.yaml", launch_args=()))


def test_data_sharding_seed_drop_last_and_the_unseeded_mistake(shelf, tmp_path):
    seeded = shards(shelf("data_sharding", "cpu.yaml", launch_args=()))
    other_seed = subprocess.run([sys.executable, "recipes/data_sharding.py", "--seed", "1", "--output-dir",
                                 str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert other_seed.returncode == 0, other_seed.stderr
    assert shards(Run(0, "", tmp_path))[0]["batches_per_rank"] != seeded[0]["batches_per_rank"]

    dropped = shards(shelf("data_sharding", "2gpu.yaml", "--drop-last", launch_args=()))
    assert [len(b) for b in dropped[0]["batches_per_rank"]] == [5, 5]
    assert dropped[0]["repeated"] == 0 and len(dropped[0]["missing"]) == 3

    unseeded = shelf("data_sharding", "2gpu.yaml", "--unseeded", launch_args=())
    # Every rank shuffles with its own seed: samples are seen twice and others never, every epoch.
    assert all(e["repeated"] > 1 and e["missing"] for e in shards(unseeded)), shards(unseeded)


# ---- resnet: a real image pipeline ---------------------------------------------------------------

@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_resnet_under_every_config(shelf, config):
    run = shelf("resnet", config, check=config != OFFLOAD)
    if config == OFFLOAD:
        return assert_refused(run, "ResNet trains with SGD and momentum")
    s = run.summary
    assert_engine(s, config)
    assert s["steps"] == 3 and s["data_source"] == "folder" and s["classes"] == 2 and s["val_images"] == 22
    assert all(math.isfinite(m["loss"]) and m["data_ms"] >= 0 and m["compute_ms"] > 0 for m in run.metrics)
    assert s["data_fraction"] == pytest.approx(s["data_time_s"] / (s["data_time_s"] + s["compute_time_s"]))
    images = s["steps"] * 16  # the global batch
    assert images / s["wall_time_s"] <= s["images_per_s"] <= images / run.metrics[-1]["train_time_s"], s
    assert_shards_held(s, config)
    assert "waiting for data" in run.output


def test_resnet_learns_from_image_files(shelf_data, tmp_path):
    """1 process, real PNG/JPEG decoding in 2 workers: stripes are told apart (chance is 50%)."""
    result = subprocess.run([sys.executable, "recipes/resnet.py", "--data-dir", str(shelf_data / "images"),
                             "--image-size", "16", "--batch-size", "16", "--epochs", "5", "--lr", "0.05",
                             "--num-workers", "2", "--output-dir", str(tmp_path)], cwd=REPO, capture_output=True,
                            text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["val_accuracy"] >= 0.9 and s["final_loss"] < s["first_loss"], s


def test_resnet_stop_reaches_workers_too(start, shelf, shelf_data, tmp_path):
    """Slurm signals every process of a step, DataLoader workers included: the workers ignore it, the
    training processes stop together and save, and the same command finishes the run."""
    args = [*recipe_args("resnet", "2gpu.yaml", shelf_data), "--max-steps", "40", "--epochs", "10",
            "--checkpoint-dir", str(tmp_path / "ckpt")]
    run = start("2gpu.yaml", *args, recipe="recipes/resnet.py")
    run.wait_until(lambda: run.steps_logged() >= 2 and len(run.workers()) >= 4, "step 2 with workers")
    everyone = run.workers()
    frozen(everyone)
    for pid in everyone:
        os.kill(pid, signal.SIGUSR1)
    thawed(everyone)
    assert run.finish() != 0
    assert "stopped by SIGUSR1" in run.output and "DataLoader worker" not in run.output, run.output[-3000:]
    assert run.left == []
    again = shelf("resnet", "2gpu.yaml", *args[len(recipe_args("resnet", "2gpu.yaml", shelf_data)):],
                  "--output-dir", str(run.log_path.parent))
    s = Run(again.returncode, again.output, run.log_path.parent).summary
    assert s["steps"] == 40 and 2 <= s["resumed_from_step"] < 40


# ---- gpt: a GPT with ZeRO-3 ----------------------------------------------------------------------

@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_gpt_under_every_config(shelf, config):
    run = shelf("gpt", config)
    s = run.summary
    assert_engine(s, config)
    assert s["steps"] == 12 and s["preset"] == "tiny" and s["optimizer"] == ("DeepSpeedCPUAdam" if config == OFFLOAD else "AdamW")
    assert_shards_held(s, config)  # ZeRO-3 and FSDP: half of the parameters on each rank
    # FSDP shards per transformer block (gpt.GPT._no_split_modules): the root, blocks.0, blocks.1, and ln_f,
    # which accelerate splits off; not one unit that stays gathered from forward to backward.
    assert s["fsdp_units"] == (4 if config == "fsdp.yaml" else None)
    # Built sharded (run.sharded_init): no process holds the whole model under ZeRO-3 (zero3_init_flag), only
    # the main process under FSDP. The step-by-step match with 1 process below
    # shows that the weights are the same as when built whole.
    sharded = {"deepspeed_zero3.yaml": "partitioned while built (zero.Init)", OFFLOAD: "partitioned while built (zero.Init)",
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


def test_gpt_stop_on_one_rank_and_resume_under_zero3(start, shelf, shelf_data, tmp_path):
    config = "deepspeed_zero3.yaml"
    ref = shelf("gpt", config)
    ckpt = tmp_path / "ckpt"
    args = recipe_args("gpt", config, shelf_data)[:-4] + ["--checkpoint-dir", str(ckpt), "--keep-last", "0"]
    run = start(config, *args, recipe="recipes/gpt.py")
    run.wait_until(lambda: run.steps_logged() >= 3 and len(run.workers()) == 2, "step 3")
    workers = run.workers()
    frozen(workers)
    os.kill(next(pid for pid in workers if rank_of(pid) == 1), signal.SIGUSR1)  # one rank only
    thawed(workers)
    assert run.finish() == 1  # torchrun reports the workers' 75 as 1
    assert "stopped by a signal to another rank" in run.output and run.left == []
    stopped_at = int(sorted(p.name for p in ckpt.iterdir())[-1].split("-")[1])
    assert 3 <= stopped_at < 12
    again = shelf("gpt", config, *args[len(recipe_args("gpt", config, shelf_data)) - 4:],
                  "--output-dir", str(run.log_path.parent))
    resumed = Run(again.returncode, again.output, run.log_path.parent)
    assert resumed.summary["resumed_from_step"] == stopped_at
    assert [m["loss"] for m in resumed.metrics] == [m["loss"] for m in ref.metrics]
    a, b = ref.params(), resumed.params()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
