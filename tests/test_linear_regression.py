"""recipes/linear_regression.py, the SGD lab, launched for real under every config (2 CPU processes):
data parallelism is large-batch SGD, step for step.

One launch per (recipe, config) serves every assertion about it: the matrix runs are cached by the
session's `shelf` fixture (conftest.py), and the comparisons (1 process against 2, resume against the
uninterrupted run) reuse them.
"""

import math
import subprocess
import sys

import pytest
from PIL import Image

from launching import CONFIG_FILES, OFFLOAD, REPO
from run_checks import assert_engine, assert_refused

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("config", CONFIG_FILES)  # the *_compile.yaml ones too
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
