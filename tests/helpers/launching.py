"""Real `accelerate launch` runs of the recipes on this CPU-only machine, for every test file.

Owns what a test needs to launch a recipe and read what the run left: the CPU route of each config,
the launch command, the shared training arguments, the run's results (LaunchResult), a run in the background
(Background), and the process helpers that find, freeze and signal its workers. The pytest fixtures
built on these (launch, reference, start, shelf) are in conftest.py.

How each config runs on CPU (the "CPU route"), found with accelerate 1.15 / torch 2.14:
  * distributed_type NO or MULTI_GPU: ACCELERATE_USE_CPU=1, accelerate's own switch.
    The launcher still starts one process per requested GPU, and the workers form
    a gloo process group (MULTI_CPU).
  * DEEPSPEED or FSDP: tests/helpers/cpu_shim on PYTHONPATH (it loads cpu_route/, the users' CPU route, plus two
    test-only hooks), because ACCELERATE_USE_CPU=1 silently turns both off. The shim is on the path of every
    launch: it also gives SyncBatchNorm (--sync-bn) a CPU path, and does nothing else.
  * multi-node configs: overridden to one machine at 127.0.0.1, with the processes of EXPECTED (2; HSDP's 2 x 2: 4).
A free port is given to every launch so runs never collide.
"""

import functools
import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "launch"))
from accelrun.exits import SELF_INFLICTED  # noqa: E402  (one pattern for a process that aborted, here and in bench/)
from accelrun.launcher import process_state  # noqa: E402  (the one reading of /proc/<pid>/stat)
from precision import deepspeed_json_in  # noqa: E402  (launch/: the one copy of a DeepSpeed JSON in a precision)

CONFIG_DIR = REPO / "accelerate_configs"
CPU_SHIM = REPO / "tests" / "helpers" / "cpu_shim"
YAML_FILES = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))  # every shipped config
# Sequence parallelism (Ulysses) is finetune_lm.py's alone: tests/test_sequence_parallel.py launches it, the other
# recipes refuse it in one line (accelrun/refusals.py), and the recipes' matrices (CONFIG_FILES) leave it out.
SEQUENCE_PARALLEL_CONFIGS = ["deepspeed_zero3_sp2.yaml"]
# HSDP (2 copies of the model x 2 shards: 4 processes) is FSDP2's code over a 2-D mesh: tests/test_hsdp.py launches
# mnist under it against FSDP2 over 4 processes, and test_slurm_launch.py a 2-node job; 4 processes per recipe would
# double the matrices' cost, so they leave it out.
HSDP_CONFIGS = ["hsdp.yaml"]
# float8 (fsdp_fp8.yaml) is for full fine-tunes of pretrained models: tests/test_float8.py launches finetune_lm under
# it; the recipes' matrices leave it out (their models' linear layers are too small for float8: none would convert).
FLOAT8_CONFIGS = ["fsdp_fp8.yaml"]
CONFIG_FILES = [c for c in YAML_FILES if c not in SEQUENCE_PARALLEL_CONFIGS + HSDP_CONFIGS + FLOAT8_CONFIGS]
# The compiled variants are DDP / one GPU plus torch.compile: tests/test_compile.py launches gpt and mnist under
# them (with dynamo's logs), the other recipes' matrices take every config (CONFIG_FILES); ALL_CONFIGS is the rest.
COMPILE_CONFIGS = [c for c in CONFIG_FILES if c.endswith("_compile.yaml")]
ALL_CONFIGS = [c for c in CONFIG_FILES if c not in COMPILE_CONFIGS]

# A tiny synthetic set: learnable in 2 epochs, an odd test size so the last
# evaluation batch does not divide by 2 processes.
TRAIN_SIZE, TEST_SIZE = 2000, 501
DATA_ARGS = ["--synthetic-train-size", str(TRAIN_SIZE), "--synthetic-test-size", str(TEST_SIZE)]


# The resume tests' training (fp32 for exact comparisons): 2 epochs of 10 optimizer steps, a
# checkpoint every 4 steps and at each epoch end, all kept.
FP32 = ("--mixed_precision", "no")
TRAINING = ("--epochs", "2", "--batch-size", "200", "--log-every", "1", "--checkpoint-every", "5", "--keep-last", "0")


def write_corpus(path, lines):
    """gpt.py's test text: `lines` short numbered lines of a handful of words."""
    path.write_text("\n".join(f"{i % 97:02d}: the {('quick', 'lazy', 'small')[i % 3]} fox number {i * 7 % 13} jumps "
                              f"over dog {i % 5}." for i in range(lines)))


def launch_environment(env=None):
    """The environment of a launched run: this one's, one thread per process, unbuffered output, `env` on top, and
    this repository's src/ first on PYTHONPATH, so that every process imports this tree's accelrun (a worktree's, not
    the one `pip install -e` points at) whatever PYTHONPATH `env` sets (the CPU route's tests/cpu_shim)."""
    full = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), full.get("PYTHONPATH")) if p)
    return full


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def unknown_uid():
    """A uid this system does not know, the tests' "another user" (12345 is a real user on some machines): the suite
    runs as root, so it can plant entries as them."""
    for uid in range(50000, 60000):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
    raise AssertionError("no unknown uid in 50000-59999")


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
                 "--num_processes", str(EXPECTED.get(config_name, (None, 2))[1])]
    return args, env


def deepspeed_precision(config, launch_args, out_dir):
    """A run asked for in fp32 (--mixed_precision no) under a DeepSpeed config gets the config's fp32 JSON, shipped
    beside it (accelerate_configs/*_fp32.json), or for another precision a copy of its JSON in that precision
    (bench/benchmark.py's deepspeed_json_in): accelerate ignores the flag there."""
    launch_args = list(launch_args)
    if "--mixed_precision" not in launch_args:
        return []
    precision = launch_args[launch_args.index("--mixed_precision") + 1]
    try:
        ds_file = (load_yaml(config).get("deepspeed_config") or {}).get("deepspeed_config_file")
    except (yaml.YAMLError, FileNotFoundError, AttributeError):
        ds_file = None  # a test of a broken config: accelerate must reject it
    if precision == "no" and ds_file and (REPO / ds_file.replace(".json", "_fp32.json")).is_file():
        return ["--deepspeed_config_file", str(REPO / ds_file.replace(".json", "_fp32.json"))]
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
    "deepspeed_zero3_sp2.yaml": ("DEEPSPEED", 2, 3, True),
    "fsdp.yaml": ("FSDP", 2, None, True),
    "hsdp.yaml": ("FSDP", 4, None, True),
    "fsdp_fp8.yaml": ("FSDP", 2, None, True),
    "1gpu_compile.yaml": ("NO", 1, None, False),
    "2gpu_compile.yaml": ("MULTI_CPU", 2, None, False),
}


# The smaller recipes' matrix runs (conftest's `shelf` fixture): every recipe under every config.
OFFLOAD = "deepspeed_zero3_offload.yaml"  # the config that swaps the optimizer for DeepSpeed's CPU Adam


def process_group(config):
    """What a config makes of the processes on this CPU machine: (distributed type, world size)."""
    return EXPECTED[config][:2]


# pi.py and data_sharding.py build no model and no optimizer: what a config changes for them is only the process group
# it makes, so each runs under one config of every (distributed type, world size) the shipped configs make (4 kinds,
# not 11 configs; test_configs.py keeps the lists complete as configs are added). cpu.yaml (and 2gpu.yaml for
# data_sharding) are their references anyway; the others are spread so that the two recipes meet different configs.
NO_MODEL_CONFIGS = {"pi": ["cpu.yaml", "multinode.yaml", "deepspeed_zero3_offload.yaml", "fsdp.yaml"],
                    "data_sharding": ["cpu.yaml", "2gpu.yaml", "deepspeed_zero1.yaml", "fsdp.yaml"]}


def recipe_args(recipe, config, data):
    """The matrix run's arguments: small, fp32 where runs are compared, checkpoints where resumes are tested."""
    ckpt = ["--checkpoint-dir", str(data / f"ckpt-{recipe}-{config}"), "--keep-last", "0"]
    return {
        "linear_regression": ["--epochs", "2", "--num-points", "256", "--batch-size", "32", "--log-every", "4",
                              "--checkpoint-every", "4", "--plot", "--compare-batch-sizes", *ckpt],
        "pi": ["--intervals", "1e3,1e5,1e6"],
        "data_sharding": [],
        "resnet": ["--data-dir", str(data / "images"), "--image-size", "16", "--batch-size", "16", "--epochs", "1",
                   "--max-steps", "3", "--num-workers", "1", "--log-every", "1"],
        "gpt": ["--preset", "tiny", "--data-files", str(data / "corpus.txt"), "--max-steps", "12", "--batch-size", "16",
                "--log-every", "1", "--eval-every", "6", "--eval-batches", "4", "--warmup-steps", "2",
                "--sample-tokens", "16", "--peak-tflops", "1", "--checkpoint-every", "4", *ckpt],
    }[recipe]


# finetune_lm.py's test runs, on accelrun.data.tiny_hf's model and data (conftest's hf, finetune and lora fixtures):
# 8 steps of 16 blocks of 64 tokens, the uneven pairs packed about 1.5 to a block (every engine runs packed
# blocks); LoRA of rank 4, in the precision each engine runs it in.
FINETUNE_STEPS, FINETUNE_BATCH, FINETUNE_BLOCK = 8, 16, 64
LORA = ("--lora-r", "4", "--merge-lora")
LORA_PRECISION = {"2gpu.yaml": "no", "fsdp.yaml": "bf16", "deepspeed_zero3.yaml": "no"}  # FSDP2: a bf16 frozen base


def lora_launch_args(config, out_dir):
    """The launch arguments of the tests' LoRA runs: the precision each engine runs LoRA in; under ZeRO-3 a copy of
    the config's JSON in it with stage3_param_persistence_threshold 0, so that the adapters are partitioned like a
    real model's larger ones. DeepSpeed keeps a parameter below 1e5 elements whole on every rank, and every adapter
    of the tiny model is below it: an export that read the main process's own parameters passed (issue 36)."""
    if config != "deepspeed_zero3.yaml":
        return ("--mixed_precision", LORA_PRECISION[config])
    copy = deepspeed_json_in(config, LORA_PRECISION[config], out_dir,
                             {"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    return ("--deepspeed_config_file", str(copy))


def finetune_args(hf, model="model", data="uneven.jsonl"):
    """finetune_lm.py's arguments for the tests: the tiny model (or a copy of it) in `hf` and one of its data files."""
    return ["--model", str(hf / model), "--data-files", str(hf / data), "--block-size", str(FINETUNE_BLOCK),
            "--max-steps", str(FINETUNE_STEPS), "--batch-size", str(FINETUNE_BATCH), "--lr", "3e-3",
            "--warmup-steps", "2", "--log-every", "1", "--eval-every", "4", "--eval-batches", "2",
            "--sample-tokens", "6", "--save-dtype", "float32", "--peak-tflops", "1"]


@dataclass
class LaunchResult:
    """What a finished launch left: its exit code, its output, and the results in its output directory."""

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


def check_exit(output, what="the launch"):
    """Fail the test when any process of a launch ended by a signal it raised itself (std::terminate, a segfault:
    the tests themselves only send SIGKILL, SIGTERM, SIGINT, SIGUSR1, SIGSTOP and SIGCONT), whatever its exit code
    and whatever the test expects of it: one check for every launch (run_command, Background, the Slurm jobs)."""
    found = SELF_INFLICTED.search(output)
    if found:
        pytest.fail(f"{what}: a process aborted or crashed ({found.group(0).strip()!r}); every process must exit "
                    f"cleanly, after its work too:\n{output[-4000:]}")


def run_command(cmd, env=None, timeout=600, cwd=REPO):
    """(exit code, output) of cmd, run in its own process group; on a timeout kill the whole group so nothing is
    left behind. A process of it that aborts fails the test (check_exit)."""
    return run_commands([(cmd, env)], timeout, cwd)[0]


def run_commands(commands, timeout=600, cwd=REPO):
    """run_command for several (cmd, env) at once: for short runs that spend most of their time starting Python.
    Whatever ends the wait (a hang, an abort, an error), no process of any of them is left running."""
    procs = []
    try:
        for cmd, env in commands:
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=launch_environment(env),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        outputs = []
        for (cmd, _), proc in zip(commands, procs):
            try:
                outputs.append(proc.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"{' '.join(map(str, cmd))} hung for {timeout}s; output:\n{proc.communicate()[0][-5000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
    for (cmd, _), output in zip(commands, outputs):
        check_exit(output, " ".join(map(str, cmd[:6])))
    return [(proc.returncode, output) for proc, output in zip(procs, outputs)]


def on_a_terminal(cmd, answer=b"", columns=150, timeout=300, cwd=REPO):
    """(exit code, output) of cmd run on a pseudo-terminal `columns` wide, as a user runs it at a prompt (progress
    bars drawn, questions asked on it), `answer` typed at once. A process still running at `timeout` is killed."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    pid, fd = pty.fork()
    if pid == 0:  # the child: never returns into pytest
        os.chdir(cwd)
        os.execvpe(cmd[0], cmd, launch_environment())
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    os.write(fd, answer)
    output, deadline, finished, status = b"", time.monotonic() + timeout, 0, 0
    while time.monotonic() < deadline and not finished:
        if select.select([fd], [], [], 0.1)[0]:
            try:
                output += os.read(fd, 65536)
            except OSError:  # the terminal closed: the process is ending
                pass
        finished, status = os.waitpid(pid, os.WNOHANG)
    try:
        while select.select([fd], [], [], 0)[0] and (chunk := os.read(fd, 65536)):
            output += chunk
    except OSError:
        pass
    os.close(fd)
    if not finished:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"{' '.join(map(str, cmd[:6]))} still running after {timeout} s:\n"
                    f"{output.decode(errors='replace')[-3000:]}")
    return os.waitstatus_to_exitcode(status), output.decode(errors="replace")


def terminal_lines(output):
    """What a terminal shows of output, line by line: within a line, each carriage return starts it over (a line
    of spaces only clears it); the last text written on it is what stays."""
    shown = []
    for line in output.replace("\r\n", "\n").split("\n"):
        parts = [part for part in line.split("\r") if part.strip()]
        shown.append(parts[-1] if parts else "")
    return shown


# A stop signal ends a run within this time: the next agreement (a progress line), a checkpoint and the
# processes' exit take seconds here; a rank that ignores the agreement would hang until the collective timeout.
STOP_SECONDS = 60


class Background:
    """A launch running in its own session, its output in a file."""

    def __init__(self, cmd, env, log_path, recipe="mnist.py"):
        self.log_path, self.recipe = log_path, recipe
        full_env = launch_environment(env)
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
            except OSError:
                continue
            if self.marker in argv and process_state(entry) not in (None, "Z"):
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
        """Wait for the launcher; note which processes outlived it (self.left), then kill those. A process of
        the run that aborted fails the test (check_exit)."""
        try:
            code = self.proc.wait(timeout=deadline)
        finally:
            self.left = self.leftovers()
            for pid in self.left:
                os.kill(pid, signal.SIGKILL)
        check_exit(self.output, f"the run in {self.marker}")
        return code

    def stops_within(self, seconds=STOP_SECONDS):
        """After a stop signal: the launcher's exit code, once every rank has stopped, saved and exited within
        `seconds`. A rank that ignores the stop agreement trains on, or waits in a collective that the others
        left, until the collective timeout (300 s): that fails here, at the deadline, and says so."""
        try:
            return self.finish(deadline=seconds)
        except subprocess.TimeoutExpired:
            pass  # fail outside the handler: the message, not the timeout's traceback
        pytest.fail(f"the run did not end within {seconds}s of the stop signal (a rank that ignores the stop "
                    f"agreement, or a rank left waiting in a collective); processes killed: {self.left}\n"
                    f"{self.output[-4000:]}")


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
