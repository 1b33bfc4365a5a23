"""recipes/resnet.py, a real image pipeline (PNG/JPEG class folders), launched for real under every
config (2 CPU processes).

One launch per (recipe, config) serves every assertion about it: the matrix runs are cached by the
session's `shelf` fixture (conftest.py), and the comparisons (the stopped and resumed run) reuse them.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from launching import CONFIG_FILES, OFFLOAD, REPO
from run_checks import assert_engine, assert_refused, assert_shards_held

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("config", CONFIG_FILES)  # the *_compile.yaml ones too
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


