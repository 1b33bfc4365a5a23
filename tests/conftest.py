"""The pytest fixtures shared by the test files: the synthetic data, cached launches, the uninterrupted
reference runs, runs started in the background, the matrix runs of the smaller recipes, and finetune_lm.py's
tiny model with its cached runs (test_finetune_lm.py, and the stops in test_stop_and_crash.py); DeepSpeed's CPU ops,
built once before the first slow test, their time reported on its own at the end of the run; the launches per
file, added up from the pytest-xdist workers; the files' order, longest first (pytest.ini runs them on 2 workers).

What they are built on (the CPU route, launch commands, LaunchResult, Background) is in launching.py.
"""

import collections
import json
import os
import pty
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accelrun.data.image_folder import write_image_folder
from accelrun.data.tiny_hf import write_all
from launching import (
    CPU_SHIM,
    FP32,
    LORA,
    TEST_SIZE,
    TRAIN_SIZE,
    TRAINING,
    Background,
    LaunchResult,
    finetune_args,
    launch_command,
    lora_launch_args,
    recipe_args,
    run_command,
    write_corpus,
)

# What a DeepSpeed launch on the CPU route compiles on first use in a fresh environment (cpu_route/sitecustomize.py:
# deepspeed_shm_comm at start-up, cpu_adam for optimizer offload), through the very calls the launches make.
BUILD_DEEPSPEED_OPS = """
from deepspeed.comm.torch import build_shm_op
from deepspeed.ops.op_builder import CPUAdamBuilder
assert build_shm_op() is not None, "deepspeed_shm_comm is not compatible here"
CPUAdamBuilder().load()
"""
DEEPSPEED_OPS = pytest.StashKey()


@pytest.fixture(scope="session")
def deepspeed_ops(pytestconfig):
    """DeepSpeed's CPU ops built before any launch needs them, in a process of their own that takes the CPU route as a
    DeepSpeed worker does (the same extensions directory, cpu_route's announcement of a real build): a fresh
    environment compiles them once (40 s to 2 minutes idle, minutes on a busy machine), here, instead of inside
    the first DeepSpeed launch's time limit. The time is reported on its own at the end of the run (the terminal
    summary), and is the setup time of the first slow test in the duration list."""
    started = time.monotonic()
    code, output = run_command([sys.executable, "-c", BUILD_DEEPSPEED_OPS], timeout=1800,
                               env={"PYTHONPATH": str(CPU_SHIM), "LOCAL_RANK": "0", "ACCELERATE_USE_DEEPSPEED": "true"})
    assert code == 0, f"building DeepSpeed's CPU ops failed:\n{output[-6000:]}"
    built = [line for line in output.splitlines() if line.startswith("cpu_route: compiled ")]
    pytestconfig.stash[DEEPSPEED_OPS] = (time.monotonic() - started, built)


@pytest.fixture(autouse=True)
def _deepspeed_ops_before_the_first_slow_test(request):
    if request.node.get_closest_marker("slow"):
        request.getfixturevalue("deepspeed_ops")


# Launches per test file, for the terminal summary: what a test starts that imports torch or runs a job (a Python
# interpreter, accelerate launch, torchrun, a recipe on a terminal, sbatch), counted where it is started. Where the
# suite's time goes, beside pytest's duration list: a new capability pays for its tests out of this budget.
LAUNCHERS = ("python", "accelerate", "torchrun", "sbatch")
LAUNCHES = collections.Counter()
_counting = {"file": None}


def _launched(argv):
    program = os.path.basename(str(argv[0] if isinstance(argv, (list, tuple)) else str(argv).split()[0]))
    if _counting["file"] and program.startswith(LAUNCHERS):
        LAUNCHES[_counting["file"]] += 1


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _counting["file"] = item.nodeid.split("::")[0]
    try:
        return (yield)
    finally:
        _counting["file"] = None


# The files that take longest, first: under pytest-xdist (`-n 2`) each file runs whole on one worker (its module
# fixtures, its shared launches), and a long file started last would leave the other worker idle at the end.
LONGEST_FIRST = ("test_slurm_launch.py", "test_checkpoint_resume.py", "test_stop_and_crash.py", "test_finetune_lm.py",
                 "test_mnist.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # stable: each file keeps its own order


def pytest_configure(config):
    popen_init = subprocess.Popen.__init__

    def counted(self, args, *rest, **kwargs):
        _launched(args)
        popen_init(self, args, *rest, **kwargs)
    subprocess.Popen.__init__ = counted
    fork = pty.fork

    def counted_fork():  # launching.on_a_terminal: a launch on a terminal of its own
        _launched(["python"])
        return fork()
    pty.fork = counted_fork


def pytest_sessionfinish(session):
    """Under pytest-xdist, a worker hands its launch counts and its DeepSpeed build time to the controller, which
    prints the terminal summary (pytest_testnodedown below)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["launches"] = dict(LAUNCHES)
        if DEEPSPEED_OPS in session.config.stash:
            workeroutput["deepspeed_ops"] = list(session.config.stash[DEEPSPEED_OPS])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    output = getattr(node, "workeroutput", {})
    LAUNCHES.update(output.get("launches", {}))
    if "deepspeed_ops" in output:
        seconds, built = output["deepspeed_ops"]
        before = node.config.stash.get(DEEPSPEED_OPS, (0, []))
        node.config.stash[DEEPSPEED_OPS] = (max(seconds, before[0]), before[1] + built)


def pytest_terminal_summary(terminalreporter, config):
    if DEEPSPEED_OPS in config.stash:
        seconds, built = config.stash[DEEPSPEED_OPS]
        what = "; ".join(line.removeprefix("cpu_route: ") for line in built) or "already built, nothing compiled"
        terminalreporter.write_line(f"DeepSpeed's CPU ops, before the first slow test: {seconds:.0f} s ({what})")
    if LAUNCHES:
        per_file = ", ".join(f"{path.removeprefix('tests/')} {count}" for path, count in LAUNCHES.most_common())
        terminalreporter.write_line(f"launches: {sum(LAUNCHES.values())} (Python, accelerate launch, torchrun, "
                                    f"sbatch); per file: {per_file}")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """Synthetic digits generated once for the whole session, in MNIST's idx format."""
    from accelrun.data.synthetic_mnist import write_synthetic_mnist
    root = tmp_path_factory.mktemp("data")
    write_synthetic_mnist(root / f"synthetic-{TRAIN_SIZE}-{TEST_SIZE}", TRAIN_SIZE, TEST_SIZE, seed=0)
    return root


@pytest.fixture(scope="session")
def launch(data_dir, tmp_path_factory):
    """launch(config, *recipe_args, launch_args=(), env=None, check=True) -> LaunchResult.

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
            cache[key] = LaunchResult(returncode, output, out_dir)
        run = cache[key]
        if check:
            assert run.returncode == 0, f"launch failed ({run.returncode}):\n{run.output[-6000:]}"
        return run

    return _launch


@pytest.fixture(scope="session")
def reference(launch, tmp_path_factory):
    """reference(config, *extra) -> (LaunchResult, checkpoint dir) of the uninterrupted run."""
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
    """shelf(recipe, config, *extra, launch_args=FP32, check=True, env=None) -> LaunchResult of
    recipes/<recipe>.py."""
    def _shelf(recipe, config, *extra, launch_args=FP32, check=True, env=None):
        return launch(config, *recipe_args(recipe, config, shelf_data), *extra, launch_args=launch_args,
                      recipe=f"recipes/{recipe}.py", check=check, env=env)
    return _shelf


@pytest.fixture(scope="session")
def hf(tmp_path_factory):
    """The tiny model (tokenizer with a pad token), a copy whose pad token is its end-of-sequence token,
    the data files, and a 'model' the size of Llama 3.1 70B: its config.json and the tiny tokenizer, no weights."""
    root = write_all(tmp_path_factory.mktemp("tiny_hf"))
    shutil.copytree(root / "model", root / "model_pad_is_eos")
    config_path = root / "model_pad_is_eos" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["pad_token"] = "</s>"
    config_path.write_text(json.dumps(config))
    big = json.loads((root / "model" / "config.json").read_text())
    big.update(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
               num_key_value_heads=8, vocab_size=128256)
    (root / "big").mkdir()
    (root / "big" / "config.json").write_text(json.dumps(big))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "model" / name, root / "big" / name)
    return root


@pytest.fixture(scope="session")
def finetune(launch, hf):
    """finetune(config, *extra, model=..., data=..., env=..., recipe=...) -> LaunchResult, fp32, one launch per
    distinct argument list (recipe: a script that runs finetune_lm.py, such as test_finetune_lm.py's watch)."""
    def _finetune(config, *extra, model="model", data="uneven.jsonl", check=True,
                  launch_args=("--mixed_precision", "no"), env=None, recipe="recipes/finetune_lm.py"):
        return launch(config, *finetune_args(hf, model, data), *extra, launch_args=launch_args,
                      recipe=recipe, check=check, env=env)
    return _finetune


@pytest.fixture(scope="session")
def lora(finetune, hf):
    """lora(config, checkpoint_dir=None) -> LaunchResult: a LoRA fine-tune with the merged export too,
    checkpointing every 3 steps (keeping all) into a directory of the session's, or the one given."""
    def _lora(config, checkpoint_dir=None):
        ckpt = checkpoint_dir or hf / f"ckpt-lora-{config}"
        return finetune(config, *LORA, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3", "--keep-last", "0",
                        launch_args=lora_launch_args(config, hf))
    return _lora


@pytest.fixture(scope="session")
def dpo(launch, hf):
    """dpo(config, *extra) -> LaunchResult of recipes/dpo.py: LoRA on the tiny model and a learnable preference set
    (test_dpo.py's DPO_ARGS), fp32, one launch per distinct argument list."""
    from accelrun.finetune.preference import write_toy_pairs
    from test_dpo import dpo_args
    if not (hf / "prefs.jsonl").exists():
        write_toy_pairs(hf / "prefs.jsonl")

    def _dpo(config, *extra, check=True):
        return launch(config, *dpo_args(hf), *extra, launch_args=("--mixed_precision", "no"), recipe="recipes/dpo.py",
                      check=check)
    return _dpo
