"""What Run promises every recipe built on it (docs/writing-a-recipe.md), observed from outside:

* a resumed run must match every flag but the declared ones that may change (recipes/runkit/resume_rules.py);
* the same command again after the run finished changes nothing and exits 0;
* --checkpoint-every alone sets the checkpoint cadence (the last step is saved too);
* each way of running keeps its own default output directory, runs/<recipe>/<how it runs>.
"""

import hashlib
import json
import subprocess
import sys

import pytest

from launching import CONFIG_DIR, DATA_ARGS, REPO, launch_command, recipe_args, run_command


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
def test_checkpoint_cadence_and_an_output_dir_per_config(data_dir, tmp_path):
    """1 process, then 2-process DDP, from the same working directory and without --output-dir: each keeps
    its results in runs/mnist/<how it runs>. 10 steps per epoch with --checkpoint-every 3: saves at 3, 6, 9,
    12, 15, 18 and the last step 20, none at the epoch's end (step 10)."""
    common = [str(REPO / "recipes" / "mnist.py"), "--data-dir", str(data_dir), *DATA_ARGS, "--epochs", "2",
              "--batch-size", "200", "--log-every", "5"]
    single = [sys.executable, *common, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3",
              "--keep-last", "0"]
    code, output = run_command(single, cwd=tmp_path)
    assert code == 0, output[-3000:]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-")) == [
        f"step-{n:08d}" for n in (3, 6, 9, 12, 15, 18, 20)]
    alone = tmp_path / "runs" / "mnist" / "1proc"
    assert json.loads((alone / "summary.json").read_text())["checkpoints"]["saves"] == 7
    first = digest(alone / "summary.json")

    ddp = ["accelerate", "launch", "--config_file", str(CONFIG_DIR / "2gpu.yaml"), "--mixed_precision", "no",
           *common, "--max-steps", "2"]
    code, output = run_command(ddp, env={"ACCELERATE_USE_CPU": "1"}, cwd=tmp_path)
    assert code == 0, output[-3000:]
    assert json.loads((tmp_path / "runs" / "mnist" / "ddp-2proc" / "summary.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in (tmp_path / "runs" / "mnist").iterdir()) == ["1proc", "ddp-2proc"]

    # The first command again: complete, results named, nothing rewritten, exit 0.
    code, output = run_command(single, cwd=tmp_path)
    assert code == 0 and "this run is already complete" in output and "runs/mnist/1proc" in output, output[-3000:]
    assert digest(alone / "summary.json") == first


def test_run_refuses_a_namespace_without_its_flags():
    """A recipe author who forgets add_run_args() learns it at once, by name, not from an AttributeError later."""
    probe = ("import argparse, sys; sys.path.insert(0, 'recipes'); from runkit import Run\n"
             "Run('x', argparse.Namespace(batch_size=8))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "call add_run_args(parser, ...)" in result.stderr, result.stderr[-2000:]


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
