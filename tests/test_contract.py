"""The recipes' contract, launched: a wrong flag under a launcher, the checkpoint cadence and where results go from
one working directory, a recipe copied alone into an empty directory. The quick checks of the same contract, which
read the sources or start an interpreter for its --help, are test_source.py."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from launching import CONFIG_DIR, DATA_ARGS, REPO, run_command
from run_checks import digest

pytestmark = pytest.mark.slow




@pytest.mark.slow
def test_a_wrong_flag_under_two_processes_is_one_line_first(launch):
    """Under accelerate launch (2 processes) the recipe's line comes first and once; what follows is torchrun's
    report (not ours), whose root cause is that line instead of a pointer to torch's docs; no usage block."""
    run = launch("2gpu.yaml", "--lora-rank", "16", check=False)
    line = "mnist.py: error: unrecognized arguments: --lora-rank 16 (python3 recipes/mnist.py --help lists the flags)"
    lines = [x for x in run.output.splitlines() if x.strip()]
    assert run.returncode == 1 and lines[0] == line, run.output[-3000:]
    assert lines.count(line) == 1 and f"traceback : {line}" in run.output, run.output[-3000:]
    assert "usage:" not in run.output and "To enable traceback" not in run.output, run.output[-3000:]


@pytest.mark.slow
def test_checkpoint_cadence_and_an_output_dir_per_config(data_dir, tmp_path):
    """1 process, then 2-process DDP, from the same working directory and without --output-dir: each keeps
    its results in runs/mnist/<how it runs>; continued on 2 processes it stays there, branched it does not, and no run
    overwrites another's results. 10 steps per
    epoch with --checkpoint-every 3: saves at 3, 6, 9, 12, 15, 18 and the last step 20, none at the epoch's end
    (step 10)."""
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
    pair = tmp_path / "runs" / "mnist" / "ddp-2proc"
    assert json.loads((pair / "summary.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in (tmp_path / "runs" / "mnist").iterdir()) == ["1proc", "ddp-2proc"]

    # The first command again: complete, results named, nothing rewritten, exit 0, answered before the data loads.
    code, output = run_command(single, cwd=tmp_path)
    assert code == 0 and "this run is already complete" in output and "runs/mnist/1proc" in output, output[-3000:]
    assert "DATA:" not in output, output[-3000:]
    assert digest(alone / "summary.json") == first

    # As if it had been stopped after step 9's save: the same run continued by 2 processes, still without
    # --output-dir, goes on in runs/mnist/1proc (its tracker too), one metrics history, not a second one begun
    # in ddp-2proc (issue 35, item 8).
    for step in (12, 15, 18, 20):
        shutil.rmtree(tmp_path / "ckpt" / f"step-{step:08d}")
    resumed = [*ddp[:-2], *single[len(common) + 1:], "--report-to", "tensorboard"]
    code, output = run_command(resumed, env={"ACCELERATE_USE_CPU": "1"}, cwd=tmp_path)
    assert code == 0, output[-3000:]
    assert ("results: in runs/mnist/1proc, with the run this checkpoint comes from (not runs/mnist/ddp-2proc; give "
            "--output-dir to write elsewhere)") in output
    summary = json.loads((alone / "summary.json").read_text())
    assert (summary["world_size"], summary["resumed_from_step"], summary["steps"]) == (2, 9, 20)
    steps = [json.loads(line)["step"] for line in (alone / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[0] == 1 and steps[-1] == 20, steps
    assert (alone / "tensorboard").is_dir() and not (pair / "tensorboard").exists()
    assert json.loads((pair / "summary.json").read_text())["steps"] == 2

    # Step 9 given to a run with a --checkpoint-dir of its own is a branch, a run of its own: it leaves the original's
    # results alone, and its default directory holds the 2-step run's, which it does not overwrite either (issue
    # 41: it did, in silence): it writes the next free name, and says so.
    continued, two_steps = digest(alone / "metrics.jsonl"), digest(pair / "summary.json")
    branch = [*ddp[:-2], "--resume", str(tmp_path / "ckpt" / "step-00000009"), "--checkpoint-dir",
              str(tmp_path / "branch")]
    code, output = run_command(branch, env={"ACCELERATE_USE_CPU": "1"}, cwd=tmp_path)
    assert code == 0 and "results: in" not in output, output[-3000:]
    assert ("results: runs/mnist/ddp-2proc holds another run's results (eval.jsonl, metrics.jsonl, model.safetensors, "
            "summary.json); this run writes runs/mnist/ddp-2proc-2 (give --output-dir to choose)") in output
    branched = json.loads((tmp_path / "runs" / "mnist" / "ddp-2proc-2" / "summary.json").read_text())
    assert (branched["resumed_from_step"], branched["output_dir"]) == (9, "runs/mnist/ddp-2proc-2")
    assert digest(alone / "metrics.jsonl") == continued and digest(pair / "summary.json") == two_steps


def install_from_this_tree(site):
    """accelrun as a user installs it: built from this tree's pyproject.toml and src/ (a copy of the two and the README
    it names, so the build leaves nothing in the checkout) and installed into `site`, without dependencies (they are
    installed already), build isolation or a package index: offline, in seconds."""
    tree = site.parent / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tree / name)
    shutil.copytree(REPO / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                          "--no-compile", "--disable-pip-version-check", "-q", "--target", str(site), str(tree)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]


@pytest.mark.slow
def test_a_recipe_copied_alone_runs(data_dir, tmp_path):
    """Issues 43 and 53: mnist.py copied alone into an empty directory runs there to its summary, with nothing beside
    it but installed packages (its helpers are accelrun's: accelrun.data, accelrun.Run), and accelrun the one
    pyproject.toml installs, not this checkout's src/ (a broken pyproject.toml fails here)."""
    site = tmp_path / "site"
    install_from_this_tree(site)
    alone = tmp_path / "elsewhere"
    alone.mkdir()
    shutil.copy(REPO / "recipes" / "mnist.py", alone / "mnist.py")
    # Not launching.launch_environment, which puts this checkout's src/ first: the installed package alone.
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    where = subprocess.run([sys.executable, "-c", "import accelrun; print(accelrun.__file__)"], cwd=alone, env=env,
                           capture_output=True, text=True, timeout=120)
    assert where.stdout.strip() == str(site / "accelrun" / "__init__.py"), (where.stdout, where.stderr)
    run = subprocess.run([sys.executable, "mnist.py", "--data", "synthetic", "--data-dir", str(data_dir), *DATA_ARGS,
                          "--epochs", "1", "--batch-size", "500"], cwd=alone, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    assert json.loads((alone / "runs" / "mnist" / "1proc" / "summary.json").read_text())["steps"] == 4
    assert sorted(p.name for p in alone.iterdir()) == ["mnist.py", "runs"]
