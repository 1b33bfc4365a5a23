"""src/accelrun/checkpoint/rules.py without a launch: what a resume on another world size or --grad-accum may
change, what it refuses, the log window's rule, and the table in
docs/checkpoints.md that states the rules. Quick: the launches that prove them are in test_checkpoint_resume.py."""

import importlib

import pytest

from accelrun.checkpoint.resharding import reshaped_window
from accelrun.checkpoint.rules import (
    PER_RANK,
    RESHAPE,
    WORLD_SIZE_CHANGE,
    checkpoint_kind,
    incompatibility,
    reshaped,
)
from launching import REPO

SETTINGS = {"batch_size": 16, "grad_accum": 1, "lr": 1e-3}


def manifest(family="fsdp", world=2, grad_accum=1, stage=None, **settings):
    return {"layout": {"family": family, "zero_stage": stage, "world_size": world, "grad_accum": grad_accum},
            "must_match": {**SETTINGS, "grad_accum": grad_accum, **settings}}


def now(family="fsdp", world=1, grad_accum=2, stage=None):
    return {"family": family, "zero_stage": stage, "world_size": world, "grad_accum": grad_accum}


@pytest.mark.parametrize("family,stage", [("full", None), ("fsdp", None), ("deepspeed", 1), ("deepspeed", 2),
                                          ("deepspeed", 3)])
def test_world_size_and_grad_accum_may_change_where_the_state_reshards(family, stage):
    saved, here = manifest(family, stage=stage), now(family, stage=stage)
    assert incompatibility(saved, here, {**SETTINGS, "grad_accum": 2}) is None
    assert reshaped(saved, here) == [
        f"world size 2 -> 1: {WORLD_SIZE_CHANGE[checkpoint_kind(saved['layout'])]}",
        "ranks [1] no longer exist: their RNG state" + (" and buffers are" if family == "fsdp" else " is")
        + " dropped",
        "--grad-accum 1 -> 2: the same global batch in 2 micro-batch(es) per process"]
    grown = manifest(family, world=1, grad_accum=2, stage=stage)
    assert reshaped(grown, now(family, world=4, grad_accum=1, stage=stage))[1] == (
        "ranks [1, 2, 3] are new: they take rank 0's RNG state" + (" and buffers" if family == "fsdp" else ""))
    assert reshaped(saved, now(family, world=2, grad_accum=1, stage=stage)) == []


def test_the_global_batch_may_not_change():
    problem = incompatibility(manifest(), now(), {**SETTINGS, "grad_accum": 2, "batch_size": 8})
    assert problem == ("these settings differ from the run that wrote it (saved, now): batch_size 16 vs 8 "
                       "(--batch-size is the global batch, which a resume keeps: give --batch-size 16)")


def test_the_hints_for_a_batch_that_does_not_split_lead_to_a_run_that_starts():
    """Issue 41, item 6: a run of --batch-size 16 resumed on 3 processes was told to try --batch-size 15, and that
    resume was then refused for batch_size 16 vs 15. Each way out either message names works: the new run's
    --batch-size splits, and each process count named for a resume splits the checkpoint's batch and is accepted."""
    import re

    from accelrun.refusals import batch_problem
    problem = batch_problem(3, 16)
    assert "give --batch-size 15 for a new run; a resume keeps its checkpoint's --batch-size, so launch" in problem
    assert batch_problem(3, 15) is None
    counts = [int(n) for n in re.findall(r"\d+", re.search(r"launch ([\d, or]+) processes", problem).group(1))]
    assert counts and 3 not in counts, problem
    for n in counts:
        assert batch_problem(n, 16) is None
        assert incompatibility(manifest(), now(world=n, grad_accum=1), SETTINGS) is None
    # The resume refused for the other batch says which to give, and on 3 processes where to run it.
    refused = incompatibility(manifest(), now(world=3, grad_accum=1), {**SETTINGS, "batch_size": 15})
    assert "give --batch-size 16; launch 1, 2, 4 or 8 processes (accelerate launch --num_processes N)" in refused
    assert batch_problem(2, 7, 1).endswith("so launch 1 or 7 processes (accelerate launch --num_processes N)")
    assert "launch 1 process (" in batch_problem(2, 127)  # one process, said so
    assert "with --grad-accum 1" in batch_problem(2, 6, 4)  # no count splits 6 into 4 micro-batches


def test_a_lora_checkpoint_is_refused_on_another_base():
    """Issue 41, item 2: finetune_lm's LoRA checkpoints record the fingerprint of --model's weights as a data fact;
    the same --model path holding other weights is refused with a message that says so."""
    saved = manifest(model="./base", base_weights="sha256:" + "a" * 64)
    problem = incompatibility(saved, now(), {**SETTINGS, "model": "./base", "base_weights": "sha256:" + "b" * 64})
    assert problem == ("its LoRA adapters were trained on other base weights than --model ./base holds now "
                       "(fingerprint sha256:aaaaaaaaaaaa, now sha256:bbbbbbbbbbbb): adapters continued on another base "
                       "are trained on two. Give --model the weights it was trained on")
    assert incompatibility(saved, now(), {**SETTINGS, "model": "./base", "base_weights": "sha256:" + "a" * 64}) is None


def test_every_kind_of_checkpoint_has_a_way_onto_another_world_size():
    """No kind is refused for its world size alone (ZeRO-1 and ZeRO-3 were, until their launches in
    test_checkpoint_resume.py followed the uninterrupted run); the ZeRO stages go through the universal checkpoint."""
    assert all(WORLD_SIZE_CHANGE.values())
    assert {k for k, how in WORLD_SIZE_CHANGE.items() if "universal checkpoint" in how} == {
        "deepspeed ZeRO-1", "deepspeed ZeRO-2", "deepspeed ZeRO-3"}


def test_another_engine_is_still_refused():
    assert "their files differ" in incompatibility(manifest("fsdp"), now("full"), SETTINGS)


def test_a_checkpoint_without_grad_accum_in_its_layout_reads_it_from_its_settings():
    old = manifest(grad_accum=2)
    del old["layout"]["grad_accum"]
    assert reshaped(old, now(world=2, grad_accum=1)) == [
        "--grad-accum 2 -> 1: the same global batch in 1 micro-batch(es) per process"]


def test_log_window_carries_the_old_ranks_mean_in_the_new_micro_batches():
    """2 ranks, 1 micro-batch per step, 3 steps into the window (per-rank loss sums 6 and 9: means 2 and 3)
    -> 1 rank with --grad-accum 2: 6 micro-batches of half the size, mean 2.5."""
    window = {"loss_sums": [6.0, 9.0], "micro": 3, "data_time": 1.0, "compute_time": 2.0}
    moved = reshaped_window(window, manifest(world=2, grad_accum=1), now(world=1, grad_accum=2))
    assert moved == {"loss_sums": [15.0], "micro": 6, "data_time": 1.0, "compute_time": 2.0}
    assert moved["loss_sums"][0] / moved["micro"] == (2.0 + 3.0) / 2
    back = reshaped_window(moved, manifest(world=1, grad_accum=2), now(world=4, grad_accum=1))
    assert back["loss_sums"] == [7.5] * 4 and back["micro"] == 3
    assert reshaped_window(window, manifest(world=2), now(world=2, grad_accum=1)) is window


def test_each_per_rank_rule_names_the_one_function_that_applies_it():
    """Every PER_RANK row says where its rule is applied, and that function exists there (a rule moved or renamed
    without its row fails here)."""
    for part, (rule, where) in PER_RANK.items():
        module, name = where.rsplit(".", 1)
        assert rule and callable(getattr(importlib.import_module(f"accelrun.{module}"), name, None)), (part, where)


def test_docs_state_every_rule_as_a_table():
    """docs/checkpoints.md's table names every family, RESHAPE flag and per-rank part the code has rules for."""
    text = (REPO / "docs" / "checkpoints.md").read_text()
    section = text[text.index("## Another number of GPUs"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    for name in [*WORLD_SIZE_CHANGE, *(f"--{flag.replace('_', '-')}" for flag in RESHAPE), *PER_RANK]:
        assert any(f"| {name} |" in row or f"| `{name}` |" in row for row in rows), name


def test_many_differing_settings_are_one_short_line():
    """A checkpoint of another recipe written before manifests named their recipe (issue 35, item 5): four of its
    differences named, long values cut, the rest counted, and the hint that flags only one side has mean another
    recipe."""
    saved = manifest(data_dir="/data/mnist", epochs=2, **{f"flag_{i}": i for i in range(30)})
    problem = incompatibility(saved, now(), {**SETTINGS, "grad_accum": 2, "a_path": "x" * 200, "block_size": 32})
    assert problem == ("these settings differ from the run that wrote it (saved, now): a_path '<not set>' vs '"
                       + "x" * 56 + "..., block_size '<not set>' vs 32, data_dir '/data/mnist' vs '<not set>', epochs "
                       "2 vs '<not set>' and 30 more (flags only one of them has: a checkpoint of another recipe?)")


@pytest.mark.parametrize("grad_accum", ["2", 0, True, 2.5, None])
def test_a_checkpoint_whose_settings_hold_no_number_of_micro_batches_is_refused(grad_accum):
    """Issue 52, item 6: a manifest without grad_accum in its layout whose settings' grad_accum is a string ended in
    a TypeError after "resumed from" (resharding computes with it); now one line, before anything loads."""
    old = manifest(grad_accum=2)
    del old["layout"]["grad_accum"]
    old["must_match"]["grad_accum"] = grad_accum
    problem = incompatibility(old, now(), SETTINGS)
    if grad_accum is None:  # neither holds one: this run's
        assert problem is None
        return
    assert problem == (f"its grad_accum {grad_accum!r} is not a number of micro-batches, so this run cannot tell how "
                       f"it split the global batch")
