"""Shared helpers: real `accelerate launch` runs of the recipes on this CPU-only machine.

How each config runs on CPU (the "CPU route"), found with accelerate 1.15 / torch 2.14:
  * distributed_type NO or MULTI_GPU: ACCELERATE_USE_CPU=1, accelerate's own switch.
    The launcher still starts one process per requested GPU, and the workers form
    a gloo process group (MULTI_CPU).
  * DEEPSPEED or FSDP: tests/cpu_shim on PYTHONPATH (it loads cpu_route/, the users' CPU route, plus two test-only hooks), because
    ACCELERATE_USE_CPU=1 silently turns both off. The shim is on the path of every
    launch: it also gives SyncBatchNorm (--sync-bn) a CPU path, and does nothing else.
  * multi-node configs: overridden to one machine at 127.0.0.1.
A free port is given to every launch so runs never collide.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from benchmark import deepspeed_json_in  # noqa: E402  (one place that makes a DeepSpeed JSON's fp32 copy)
CONFIG_DIR = REPO / "accelerate_configs"
CPU_SHIM = REPO / "tests" / "cpu_shim"
CONFIG_FILES = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))  # every shipped config
# The compiled variants are DDP / one GPU plus torch.compile: tests/test_compile.py launches them; the engine
# matrix (every recipe under every config) runs the others.
COMPILE_CONFIGS = [c for c in CONFIG_FILES if c.endswith("_compile.yaml")]
ALL_CONFIGS = [c for c in CONFIG_FILES if c not in COMPILE_CONFIGS]

# A tiny synthetic set: learnable in 2 epochs, an odd test size so the last
# evaluation batch does not divide by 2 processes.
TRAIN_SIZE, TEST_SIZE = 2000, 501
DATA_ARGS = ["--synthetic-train-size", str(TRAIN_SIZE), "--synthetic-test-size", str(TEST_SIZE)]


# The resume tests' training (fp32 for exact comparisons): 2 epochs of 10 optimizer steps, a
# checkpoint every 4 steps and at each epoch end, all kept.
FP32 = ("--mixed_precision", "no")
TRAINING = ("--epochs", "2", "--batch-size", "200", "--log-every", "1", "--checkpoint-every", "4", "--keep-last", "0")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def skip_unless_ci(reason):
    """Skip a test that this machine cannot run; under CI (CI=true) that is a failure, never a silent skip."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run this test: {reason}")
    pytest.skip(reason)


def load_yaml(config_name):
    with open(CONFIG_DIR / config_name) as f:
        return yaml.safe_load(f)


def cpu_route(config_name):
    """The launch arguments and environment that run `config_name` on this CPU machine."""
    try:
        cfg = load_yaml(config_name)
    except yaml.YAMLError:
        cfg = {"distributed_type": "MULTI_GPU"}  # a test of a broken file: accelerate must reject it
    # The shim only acts on DeepSpeed/FSDP state and on SyncBatchNorm (--sync-bn); see its docstring.
    args, env = ["--main_process_port", str(free_port())], {"PYTHONPATH": str(CPU_SHIM)}
    if cfg["distributed_type"] not in ("DEEPSPEED", "FSDP"):
        env["ACCELERATE_USE_CPU"] = "1"
    if cfg.get("num_machines", 1) > 1:
        args += ["--num_machines", "1", "--machine_rank", "0", "--main_process_ip", "127.0.0.1",
                 "--num_processes", "2"]
    return args, env


def deepspeed_precision(config, launch_args, out_dir):
    """A run asked for in fp32 (--mixed_precision no) under a DeepSpeed config gets a copy of the config's
    JSON in that precision (bench/benchmark.py's deepspeed_json_in): accelerate ignores the flag there."""
    launch_args = list(launch_args)
    if "--mixed_precision" not in launch_args:
        return []
    precision = launch_args[launch_args.index("--mixed_precision") + 1]
    try:
        copy = deepspeed_json_in(config, precision, out_dir.parent / f"{out_dir.name}-deepspeed")
    except (yaml.YAMLError, FileNotFoundError, AttributeError):
        return []  # a test of a broken config: accelerate must reject it
    return ["--deepspeed_config_file", str(copy)] if copy else []


def launch_command(config, data_dir, out_dir, *recipe_args, launch_args=(), recipe="recipes/mnist.py"):
    """(command, environment) of an `accelerate launch` of `recipe` under `config` on this machine."""
    route_args, route_env = cpu_route(config)
    route_args += deepspeed_precision(config, launch_args, Path(out_dir))
    data = ["--data-dir", str(data_dir)] if recipe.endswith("mnist.py") else []
    cmd = ["accelerate", "launch", "--config_file", str(CONFIG_DIR / config), *route_args, *launch_args,
           recipe, *data, "--output-dir", str(out_dir), *(DATA_ARGS if data else []), *recipe_args]
    return cmd, route_env


def recipe_processes(marker, recipe="mnist.py"):
    """PIDs of the recipe's processes (not launchers; DataLoader workers included) whose command line holds `marker`."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        # python -u recipes/mnist.py ...: not the batch shell, srun, slurm_launch or accelerate launch
        if marker in argv and Path(argv[0]).name.startswith("python") and any(a.endswith(recipe) for a in argv[1:3]):
            pids.append(int(entry))
    return pids


# What must really run on this machine under each config: (distributed type, world size, ZeRO stage,
# parameters sharded). The GPU configs' MULTI_GPU becomes MULTI_CPU on the CPU route.
EXPECTED = {
    "cpu.yaml": ("NO", 1, None, False),
    "1gpu.yaml": ("NO", 1, None, False),
    "2gpu.yaml": ("MULTI_CPU", 2, None, False),
    "multinode.yaml": ("MULTI_CPU", 2, None, False),
    "deepspeed_zero1.yaml": ("DEEPSPEED", 2, 1, False),
    "deepspeed_zero2.yaml": ("DEEPSPEED", 2, 2, False),
    "deepspeed_zero3.yaml": ("DEEPSPEED", 2, 3, True),
    "deepspeed_zero3_offload.yaml": ("DEEPSPEED", 2, 3, True),
    "fsdp.yaml": ("FSDP", 2, None, True),
    "1gpu_compile.yaml": ("NO", 1, None, False),
    "2gpu_compile.yaml": ("MULTI_CPU", 2, None, False),
}


@dataclass
class Run:
    returncode: int
    output: str
    out_dir: Path

    @property
    def summary(self):
        with open(self.out_dir / "summary.json") as f:
            return json.load(f)

    @property
    def metrics(self):
        with open(self.out_dir / "metrics.jsonl") as f:
            return [json.loads(line) for line in f]

    def params(self):
        from safetensors.torch import load_file
        return load_file(str(self.out_dir / "model.safetensors"))


def run_command(cmd, env=None, timeout=600, cwd=REPO):
    """Run in its own process group; on a timeout kill the whole group so nothing is left behind."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} hung for {timeout}s; output:\n{output[-5000:]}")
    return proc.returncode, output


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """Synthetic digits generated once for the whole session, in MNIST's idx format."""
    sys.path.insert(0, str(REPO / "recipes"))
    from runkit.synthetic_mnist import write_synthetic_mnist
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
            assert "terminate called" not in run.output, run.output[-3000:]
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


class Background:
    """A launch running in its own session, its output in a file."""

    def __init__(self, cmd, env, log_path, recipe="mnist.py"):
        self.log_path, self.recipe = log_path, recipe
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.marker = str(log_path.parent)  # the output dir is on every process's command line

    @property
    def output(self):
        return self.log_path.read_text()

    def workers(self):
        """PIDs of the recipe processes (not the launcher; DataLoader workers included) of this run."""
        return recipe_processes(self.marker, self.recipe)

    def leftovers(self):
        """Every live process of this run, launcher included (zombies do not count)."""
        alive = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().decode(errors="replace")
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if self.marker in argv and state != "Z":
                alive.append(int(entry))
        return alive

    def wait_until(self, condition, what, deadline=300):
        end = time.monotonic() + deadline
        while not condition():
            if self.proc.poll() is not None:
                pytest.fail(f"the run ended ({self.proc.returncode}) before {what}:\n{self.output[-4000:]}")
            if time.monotonic() > end:
                pytest.fail(f"no {what} after {deadline}s:\n{self.output[-4000:]}")
            time.sleep(0.05)

    def steps_logged(self):
        path = self.log_path.parent / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def finish(self, deadline=300):
        """Wait for the launcher; note which processes outlived it (self.left), then kill those."""
        try:
            return self.proc.wait(timeout=deadline)
        finally:
            self.left = self.leftovers()
            for pid in self.left:
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def start(data_dir, tmp_path):
    runs = []

    def _start(config, *recipe_args, env=None, name="run", recipe="recipes/mnist.py"):
        out_dir = tmp_path / name
        out_dir.mkdir()
        cmd, route_env = launch_command(config, data_dir, out_dir, *recipe_args, launch_args=FP32, recipe=recipe)
        run = Background(cmd, {**route_env, **(env or {})}, out_dir / "launch.log", os.path.basename(recipe))
        runs.append(run)
        return run

    yield _start
    for run in runs:  # never leave a process behind, whatever the test did
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
        run.finish(deadline=60)


def rank_of(pid):
    """The RANK the launcher gave this process (from its environment, not guessed from PIDs)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK="))[5:])


def frozen(pids):
    """Stop the processes so a signal sent now is handled at a known step, not after training ended."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)


def thawed(pids):
    for pid in pids:
        os.kill(pid, signal.SIGCONT)
