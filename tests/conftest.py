"""The pytest fixtures shared by the test files: the synthetic data, cached launches, the uninterrupted
reference runs, runs started in the background, and the matrix runs of the smaller recipes.

What they are built on (the CPU route, launch commands, Run, Background) is in launching.py.
"""

import os
import signal
import sys
from pathlib import Path

import pytest

from image_folder import write_image_folder
from launching import (
    FP32,
    REPO,
    TEST_SIZE,
    TRAIN_SIZE,
    TRAINING,
    Background,
    Run,
    launch_command,
    recipe_args,
    run_command,
    write_corpus,
)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """Synthetic digits generated once for the whole session, in MNIST's idx format."""
    sys.path.insert(0, str(REPO / "recipes"))
    from synthetic_data.mnist import write_synthetic_mnist
    root = tmp_path_factory.mktemp("data")
    write_synthetic_mnist(root / f"synthetic-{TRAIN_SIZE}-{TEST_SIZE}", TRAIN_SIZE, TEST_SIZE, seed=0)
    return root


@pytest.fixture(scope="session")
def launch(data_dir, tmp_path_factory):
    """launch(config, *recipe_args, launch_args=(), env=None, check=True) -> Run.

    Runs are cached by their arguments, so tests that compare the same runs share one launch.
    """
    cache = {}

    def _launch(config, *recipe_args, launch_args=(), env=None, check=True, recipe="recipes/mnist.py",
                timeout=600):
        key = (config, recipe_args, tuple(launch_args), tuple(sorted((env or {}).items())), recipe)
        if key not in cache:
            out_dir = tmp_path_factory.mktemp(Path(config).stem)
            cmd, route_env = launch_command(config, data_dir, out_dir, *recipe_args, launch_args=launch_args,
                                            recipe=recipe)
            returncode, output = run_command(cmd, env={**route_env, **(env or {})}, timeout=timeout)
            cache[key] = Run(returncode, output, out_dir)
        run = cache[key]
        if check:
            assert run.returncode == 0, f"launch failed ({run.returncode}):\n{run.output[-6000:]}"
        return run

    return _launch


@pytest.fixture(scope="session")
def reference(launch, tmp_path_factory):
    """reference(config, *extra) -> (Run, checkpoint dir) of the uninterrupted run."""
    dirs = {}

    def _reference(config, *extra):
        key = (config, extra)
        if key not in dirs:
            dirs[key] = tmp_path_factory.mktemp("ckpt-" + config.split(".")[0])
        ckpt = dirs[key]
        return launch(config, *TRAINING, *extra, "--checkpoint-dir", str(ckpt), launch_args=FP32), ckpt

    return _reference


@pytest.fixture
def start(data_dir, tmp_path):
    runs = []

    def _start(config, *recipe_args, env=None, name="run", recipe="recipes/mnist.py", launch_args=FP32):
        out_dir = tmp_path / name
        out_dir.mkdir()
        cmd, route_env = launch_command(config, data_dir, out_dir, *recipe_args, launch_args=launch_args,
                                        recipe=recipe)
        run = Background(cmd, {**route_env, **(env or {})}, out_dir / "launch.log", os.path.basename(recipe))
        runs.append(run)
        return run

    yield _start
    for run in runs:  # never leave a process behind, whatever the test did
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
        run.finish(deadline=60)


@pytest.fixture(scope="session")
def shelf_data(tmp_path_factory):
    """A text corpus for gpt.py, PNG/JPEG class folders for resnet.py, and a checkpoint root."""
    root = tmp_path_factory.mktemp("shelf")
    write_corpus(root / "corpus.txt", 3000)
    write_image_folder(root / "images", train_per_class=48, val_per_class=11, size=20)
    return root


@pytest.fixture(scope="session")
def shelf(launch, shelf_data):
    """shelf(recipe, config, *extra, launch_args=FP32, check=True, env=None) -> Run of recipes/<recipe>.py."""
    def _shelf(recipe, config, *extra, launch_args=FP32, check=True, env=None):
        return launch(config, *recipe_args(recipe, config, shelf_data), *extra, launch_args=launch_args,
                      recipe=f"recipes/{recipe}.py", check=check, env=env)
    return _shelf
