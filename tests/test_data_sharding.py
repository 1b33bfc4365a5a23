"""recipes/data_sharding.py, what each rank sees of the data, launched for real under one config of each kind of
process group (launching.NO_MODEL_CONFIGS: 1 process, DDP, DeepSpeed, FSDP; 2 CPU processes): it builds no model, so
the config changes nothing else.

One launch per (recipe, config) serves every assertion about it: the matrix runs are cached by the
session's `shelf` fixture (conftest.py), and the comparisons (each config against 1 process) reuse them.
"""

import json
import subprocess
import sys

import pytest

from launching import EXPECTED, NO_MODEL_CONFIGS, REPO, LaunchResult
from run_checks import assert_engine

pytestmark = pytest.mark.slow


def shards(run):
    return json.loads((run.out_dir / "shards.json").read_text())


@pytest.mark.parametrize("config", NO_MODEL_CONFIGS["data_sharding"])  # no model: a kind of process group each
def test_data_sharding_under_each_kind_of_process_group(shelf, config):
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
    assert shards(LaunchResult(0, "", tmp_path))[0]["batches_per_rank"] != seeded[0]["batches_per_rank"]

    dropped = shards(shelf("data_sharding", "2gpu.yaml", "--drop-last", launch_args=()))
    assert [len(b) for b in dropped[0]["batches_per_rank"]] == [5, 5]
    assert dropped[0]["repeated"] == 0 and len(dropped[0]["missing"]) == 3

    unseeded = shelf("data_sharding", "2gpu.yaml", "--unseeded", launch_args=())
    # Every rank shuffles with its own seed: samples are seen twice and others never, every epoch.
    assert all(e["repeated"] > 1 and e["missing"] for e in shards(unseeded)), shards(unseeded)
