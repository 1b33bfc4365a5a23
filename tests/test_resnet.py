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
from run_checks import assert_engine, assert_shards_held

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("config", [c for c in CONFIG_FILES if c != OFFLOAD])  # *_compile.yaml too; offload below
def test_resnet_under_every_config(shelf, config):
    run = shelf("resnet", config)
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


def test_resnet_refuses_optimizer_offload_as_linear_regression_does(monkeypatch):
    """Under deepspeed_zero3_offload.yaml an SGD recipe stops in Run.setup, before its data, with one line
    (accelrun.refusals.refuse_optimizer_offload): launched for real once, by linear_regression.py in its matrix
    (test_linear_regression.py: the line, the exit code, no traceback). resnet.py gives the same call its own reason:
    its main() run here, in this process, up to that call, and the line the refusal prints with what it was given."""
    from accelrun import refusals
    from in_process import kept_process_state

    sys.path.insert(0, str(REPO / "recipes"))
    import resnet

    handed = {}

    class Reached(Exception):
        pass

    def setup(self, accelerator, **kwargs):
        handed.update(kwargs)
        raise Reached

    monkeypatch.setattr(resnet.Run, "setup", setup)
    with pytest.raises(Reached), kept_process_state():
        resnet.main(["--data-dir", "unused", "--output-dir", "unused"])
    said = []
    from types import SimpleNamespace

    from accelerate.utils import DistributedType
    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}  # deepspeed_zero3_offload
    offloading = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, state=SimpleNamespace(
        deepspeed_plugin=SimpleNamespace(deepspeed_config=offload)))
    monkeypatch.setattr(refusals, "fail", lambda accelerator, message, everyone=False: said.append(message))
    refusals.refuse_optimizer_offload(offloading, *handed["refuse_offload"])
    assert said == ["ResNet trains with SGD and momentum, and fits on a GPU without offload: DeepSpeed optimizer "
                    "offload silently replaces SGD by its CPU Adam; use deepspeed_zero2.yaml instead."], said
