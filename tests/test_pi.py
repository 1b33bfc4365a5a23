"""recipes/pi.py, an all-reduce you can check, launched for real under one config of each kind of process group
(launching.NO_MODEL_CONFIGS: 1 process, DDP across machines, DeepSpeed, FSDP; 2 CPU processes): it builds no model,
so the config changes nothing else.

One launch per (recipe, config) serves every assertion about it: the matrix runs are cached by the
session's `shelf` fixture (conftest.py), and the comparisons (2 and 3 processes against 1) reuse them.
"""

import math

import pytest

from launching import NO_MODEL_CONFIGS
from run_checks import assert_engine

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("config", NO_MODEL_CONFIGS["pi"])  # no model: a kind of process group each
def test_pi_under_each_kind_of_process_group(shelf, config):
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
