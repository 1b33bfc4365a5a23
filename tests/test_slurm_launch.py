"""launch/: the translation of Slurm's variables (unit tests on environments captured from real
srun/sbatch runs) and the sbatch templates on a real Slurm cluster of one and two nodes."""

import ast
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from launching import (
    CPU_SHIM,
    DATA_ARGS,
    EXPECTED,
    REPO,
    TRAINING,
    LaunchResult,
    check_exit,
    cpu_route,
    deepspeed_json_in,
    recipe_processes,
    skip_unless_ci,
)
from run_checks import assert_identical_params, assert_same_steps

sys.path.insert(0, str(REPO / "launch"))
import slurm_launch  # noqa: E402
from slurm_cluster import SlurmCluster, unavailable_reason  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "slurm_env"
_real_first_host = slurm_launch.first_host  # the autouse fixture below replaces it in the module


def captured(name):
    """An environment captured inside a real job of tests/helpers/slurm_cluster.py (see fixtures/slurm_env)."""
    env = {}
    for line in (FIXTURES / f"{name}.env").read_text().splitlines():
        key, _, value = line.partition("=")
        env[key] = value
    return env


def plan(argv, env):
    """The launcher's decisions for this task (captured host names need not resolve here)."""
    return slurm_launch.plan(slurm_launch.parse_args(argv), env, resolve=False)


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


CONFIG, RECIPE = "accelerate_configs/2gpu.yaml", "recipes/mnist.py"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)
    # No scontrol in the unit tests (the host's own would answer): test our expansion.
    monkeypatch.setattr(slurm_launch, "first_host", lambda nodelist: _real_first_host(nodelist, "no-scontrol"))


def test_one_stop_exit_code_for_the_recipes_the_launcher_and_the_templates(tmp_path):
    """75 ("stopped with a checkpoint: run me again") has one definition, accelrun/stopping.py's EXIT_STOPPED:
    slurm_launch.py defines none and reads that one, run by path from any directory without torch, and the sbatch
    templates test for and exit with that number."""
    from accelrun import stopping

    tree = ast.parse((REPO / "launch" / "slurm_launch.py").read_text())
    assigned = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assert "EXIT_STOPPED" not in assigned and slurm_launch.EXIT_STOPPED == stopping.EXIT_STOPPED == 75
    for template in ("single_node.sbatch", "multinode.sbatch"):
        text = (REPO / "launch" / template).read_text()
        assert f'[ "${{status}}" -eq {stopping.EXIT_STOPPED} ]' in text, template
        assert f"        exit {stopping.EXIT_STOPPED}\n" in text, template
    # Run by path from elsewhere, as srun runs it: it finds accelrun by itself, and imports no torch (-X importtime
    # lists every module a process imports).
    out = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "launch" / "slurm_launch.py"), "--help"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "accelrun.stopping" in imported and "torch" not in imported, sorted(imported)
    assert out.returncode == 0 and "usage: slurm_launch.py" in out.stdout, out.stderr[-2000:]


# --- unit tests: the translation ---------------------------------------------------------------

def test_one_node_step():
    env = captured("step_1node_1task")
    cmd, extra = plan([CONFIG, RECIPE, "--epochs", "2"], env)
    assert cmd[:4] == ["accelerate", "launch", "--config_file", CONFIG]
    assert flag(cmd, "--num_machines") == "1" and flag(cmd, "--machine_rank") == "0"
    assert flag(cmd, "--num_processes") == "2"  # SLURM_GPUS_ON_NODE=2
    assert flag(cmd, "--main_process_ip") == "node1"
    assert flag(cmd, "--main_process_port") == str(15000 + int(env["SLURM_JOB_ID"]) % 15000)
    assert cmd[-3:] == [RECIPE, "--epochs", "2"] and extra == {"OMP_NUM_THREADS": "1"}


def test_rendezvous_port_below_the_ephemeral_range_and_taken_port_refused():
    env = captured("step_1node_1task")
    ports = {int(flag(plan([CONFIG, RECIPE], {**env, "SLURM_JOB_ID": str(job)})[0], "--main_process_port"))
             for job in (1, 14999, 15000, 123456789)}
    assert all(15000 <= p < 30000 < 32768 for p in ports)  # Linux picks outgoing ports from 32768 up
    assert flag(plan([CONFIG, RECIPE], {**env, "RECIPE_PORT": "23456"})[0], "--main_process_port") == "23456"
    assert flag(plan(["--port", "24680", CONFIG, RECIPE], env)[0], "--main_process_port") == "24680"
    with socket.socket() as taken:  # the node that hosts the rendezvous checks its port before launching
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = slurm_launch.parse_args(["--port", str(port), CONFIG, RECIPE])
        with pytest.raises(slurm_launch.LaunchError, match=f"rendezvous port {port} on .* is taken"):
            slurm_launch.plan(args, {**env, "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_NODELIST": "localhost"})
    with pytest.raises(slurm_launch.LaunchError, match="not a port number"):
        plan([CONFIG, RECIPE], {**env, "RECIPE_PORT": "http"})


def test_each_process_gets_its_share_of_the_cores():
    """torch's launcher would set OMP_NUM_THREADS=1 and leave DeepSpeed's CPU Adam (offload) on one core."""
    env = captured("step_1node_1task")  # 2 GPUs on the node
    assert env["SLURM_CPUS_ON_NODE"] == "1"  # the test cluster's node: 1 core for 2 processes, still 1 each
    assert plan([CONFIG, RECIPE], env)[1] == {"OMP_NUM_THREADS": "1"}
    for extra_env, threads in [({"SLURM_CPUS_ON_NODE": "32"}, "16"), ({"SLURM_CPUS_PER_TASK": "12"}, "6"),
                               ({"SLURM_CPUS_ON_NODE": "32", "OMP_NUM_THREADS": "3"}, "3"),
                               ({"SLURM_CPUS_ON_NODE": "32", "OMP_NUM_THREADS": "0"}, "16"),
                               ({"SLURM_CPUS_ON_NODE": "1"}, "1")]:
        # In the environment of accelerate launch: its DeepSpeed launcher drops --num_cpu_threads_per_process,
        # and torchrun keeps an OMP_NUM_THREADS it finds set.
        _, extra = plan(["accelerate_configs/deepspeed_zero3_offload.yaml", "recipes/gpt.py"], {**env, **extra_env})
        assert extra == {"OMP_NUM_THREADS": threads}, extra_env
    # per-gpu: the task is one process; 2 tasks share the node's 32 cores.
    per_gpu = captured("step_1node_2tasks_rank0")
    _, extra = plan(["--mode", "per-gpu", CONFIG, RECIPE], {**per_gpu, "SLURM_CPUS_ON_NODE": "32"})
    assert extra["OMP_NUM_THREADS"] == "16"


@pytest.mark.parametrize("rank", [0, 1])
def test_two_node_step_ranks_come_from_each_task(rank):
    env = captured(f"step_2nodes_rank{rank}")
    cmd, _ = plan(["accelerate_configs/deepspeed_zero2.yaml", RECIPE], env)
    assert flag(cmd, "--num_machines") == "2"
    assert flag(cmd, "--machine_rank") == str(rank)
    assert flag(cmd, "--num_processes") == "4"
    assert flag(cmd, "--main_process_ip") == "node1"
    assert flag(cmd, "--deepspeed_multinode_launcher") == "standard"  # no pdsh/ssh


@pytest.mark.parametrize("rank", [0, 1])
def test_per_gpu_mode_sets_the_ranks_slurm_gave(rank):
    env = captured(f"step_1node_2tasks_rank{rank}")
    cmd, extra = plan(["--mode", "per-gpu", "accelerate_configs/deepspeed_zero2.yaml", RECIPE], env)
    assert cmd[1:] == [RECIPE]
    assert (extra["RANK"], extra["LOCAL_RANK"], extra["WORLD_SIZE"]) == (str(rank), str(rank), "2")
    assert extra["MASTER_ADDR"] == "node1" and extra["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert extra["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == "accelerate_configs/deepspeed_zero2.json"


def test_per_gpu_mode_keeps_the_configs_parallelism():
    """A sequence-parallel config in mode per-gpu: each task gets the parallelism sizes accelerate launch would give
    (they were dropped, and the workers trained without sequence parallelism)."""
    env = captured("step_1node_2tasks_rank0")
    _, extra = plan(["--mode", "per-gpu", "accelerate_configs/deepspeed_zero3_sp2.yaml", RECIPE], env)
    assert extra.get("ACCELERATE_USE_PARALLELISM_CONFIG") == "true", extra
    assert extra.get("PARALLELISM_CONFIG_SP_SIZE") == "2" and extra.get("PARALLELISM_CONFIG_SP_BACKEND") == "deepspeed"


HSDP = "accelerate_configs/hsdp.yaml"


def mesh_of(cmd):
    """(dp_replicate_size, dp_shard_size) an accelerate launch command gives, or None without them."""
    if "--parallelism_config_dp_replicate_size" not in cmd:
        return None
    return (int(flag(cmd, "--parallelism_config_dp_replicate_size")),
            int(flag(cmd, "--parallelism_config_dp_shard_size")))


@pytest.mark.parametrize("rank", [0, 1])
def test_hsdp_sizes_come_from_slurm_on_each_node(rank):
    """Issue 50, item 2: an HSDP config on 2 nodes of 2 GPUs, one task per node: each node's accelerate launch gets a
    copy of the model per node (dp_replicate_size = nodes) sharded over the node's processes (dp_shard_size =
    processes per node), whatever the YAML says; other configs get no mesh. A launcher that passed the YAML's own
    sizes would start 2 x 2 on 4 nodes of 8 GPUs too."""
    env = captured(f"step_2nodes_rank{rank}")
    cmd, _ = plan([HSDP, RECIPE], env)
    assert mesh_of(cmd) == (2, 2) and flag(cmd, "--num_processes") == "4" and flag(cmd, "--machine_rank") == str(rank)
    four_nodes = {**env, "SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "4", "SLURM_GPUS_ON_NODE": "8"}
    cmd, _ = plan([HSDP, RECIPE], four_nodes)
    assert mesh_of(cmd) == (4, 8) and flag(cmd, "--num_processes") == "32"
    assert mesh_of(plan(["accelerate_configs/fsdp.yaml", RECIPE], env)[0]) is None
    assert mesh_of(plan([CONFIG, RECIPE], env)[0]) is None


def test_hsdp_sizes_reach_each_process_in_per_gpu_mode():
    """Per-gpu, 2 nodes of 2 tasks (step_2nodes_rank1 with 2 tasks per node, as Slurm writes them): the worker's
    environment holds the sizes accelerate launch would give it, the ones from Slurm (PARALLELISM_CONFIG_*), not the
    YAML's."""
    env = {**captured("step_2nodes_rank1"), "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4",
           "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)",
           "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_GPUS_ON_NODE": "2"}
    _, extra = plan(["--mode", "per-gpu", HSDP, RECIPE], env)
    assert (extra["RANK"], extra["WORLD_SIZE"], extra["ACCELERATE_USE_FSDP"]) == ("3", "4", "true")
    assert extra["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    assert (extra["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], extra["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("2", "2")
    _, one_node = plan(["--mode", "per-gpu", HSDP, RECIPE], captured("step_1node_2tasks_rank0"))
    assert (one_node["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], one_node["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == (
        "1", "2")  # one node: FSDP2 over its processes


def test_hsdp_with_one_process_per_node_is_refused_in_one_line():
    """One GPU per node leaves HSDP nothing to shard over within a node (accelerate refuses it once every process has
    started): refused before anything starts, naming DDP's config."""
    env = {**captured("step_2nodes_rank0"), "SLURM_GPUS_ON_NODE": "1"}
    with pytest.raises(slurm_launch.LaunchError, match=r"is HSDP, .* this job has 1 per node: .*multinode.yaml"):
        plan([HSDP, RECIPE], env)


def test_dry_run_shows_the_hsdp_sizes(tmp_path):
    """--dry-run prints the two sizes Slurm decided, in the command each node runs."""
    env = {**os.environ, **captured("step_2nodes_rank1"), "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run([sys.executable, "launch/slurm_launch.py", "--dry-run", HSDP, RECIPE], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert ("--num_processes 4 " in out.stdout and "--parallelism_config_dp_replicate_size 2 "
            "--parallelism_config_dp_shard_size 2 recipes/mnist.py" in out.stdout), out.stdout


def test_port_override_and_job_ids_differ():
    env = captured("step_1node_1task")
    assert flag(plan(["--port", "31234", CONFIG, RECIPE], env)[0], "--main_process_port") == "31234"
    other = dict(env, SLURM_JOB_ID=str(int(env["SLURM_JOB_ID"]) + 1))
    assert flag(plan([CONFIG, RECIPE], env)[0], "--main_process_port") != \
        flag(plan([CONFIG, RECIPE], other)[0], "--main_process_port")


@pytest.mark.parametrize("name, gpus", [("SLURM_GPUS_ON_NODE", "4"), ("SLURM_STEP_GPUS", "0,1,2,3"),
                                        ("SLURM_JOB_GPUS", "4,5,6,7"), ("CUDA_VISIBLE_DEVICES", "0,1,2,3")])
def test_gpu_count_from_any_slurm_variable(name, gpus):
    env = {k: v for k, v in captured("step_1node_1task").items()
           if k not in ("SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES")}
    env[name] = gpus
    assert flag(plan([CONFIG, RECIPE], env)[0], "--num_processes") == "4"


@pytest.mark.parametrize("nodelist, first, count", [
    ("n[1-2]", "n1", 2), ("gpu[01-04,07]", "gpu01", 5), ("r13i5n[7-8],r13i6n0", "r13i5n7", 3),
    ("rack[1-2]-n[01-02]", "rack1-n01", 4), ("node17", "node17", 1),
    ("node-[1-3]-ib", "node-1-ib", 3)])  # Slurm 22.05's scontrol rejects this one: "Invalid hostlist"
def test_every_hostlist_form(nodelist, first, count, monkeypatch, tmp_path):
    hosts = slurm_launch.expand_hostlist(nodelist)
    assert hosts[0] == first and len(hosts) == count
    # The real first_host with the real scontrol, which needs a slurm.conf but no controller for
    # `show hostnames`; and our expansion host for host against Slurm's own, where Slurm accepts the form.
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=unit\nSlurmctldHost=localhost\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    assert _real_first_host(nodelist) == first
    if shutil.which("scontrol") is None:
        skip_unless_ci("scontrol not installed: our expansion was not compared with Slurm's")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=20)
    assert out.stdout.split() == ([] if nodelist == "node-[1-3]-ib" else hosts), out.stderr


def test_first_host_asks_scontrol_and_falls_back(tmp_path):
    """scontrol's answer wins; scontrol installed without a slurm.conf fails ('Could not establish a
    configuration source') and our own expansion answers."""
    answers = tmp_path / "scontrol"
    answers.write_text("#!/bin/sh\necho from-scontrol-1; echo from-scontrol-2\n")
    answers.chmod(0o755)
    assert _real_first_host("gpu[03-04]", str(answers)) == "from-scontrol-1"
    fails = tmp_path / "scontrol-fails"
    fails.write_text("#!/bin/sh\necho 'scontrol: error: Could not establish a configuration source' >&2\nexit 1\n")
    fails.chmod(0o755)
    assert _real_first_host("gpu[03-04]", str(fails)) == "gpu03"
    assert _real_first_host("node-[1-3]-ib", str(fails)) == "node-1-ib"


@pytest.mark.parametrize("change, message", [
    ({"SLURM_JOB_ID": None}, "not inside a Slurm job"),
    ({"SLURM_STEP_ID": None, "SLURM_STEPID": None}, "run inside a job step"),
    ({"SLURM_NODEID": None}, "SLURM_NODEID is not set"),
    ({"SLURM_STEP_NODELIST": "node[1-", "SLURM_JOB_NODELIST": "node[1-"}, "cannot parse the Slurm node list"),
    ({"SLURM_STEP_NODELIST": "node 1,node2", "SLURM_JOB_NODELIST": "node 1,node2"},
     "the job's first host 'node 1' is not a valid host name"),
    ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_TASKS_PER_NODE": "2"}, "mode per-node needs one task per node"),
    ({"SLURM_GPUS_ON_NODE": "0", "SLURM_STEP_GPUS": None, "SLURM_JOB_GPUS": None, "CUDA_VISIBLE_DEVICES": None},
     "GPU config (MULTI_GPU) but Slurm gave this task no GPU"),
])
def test_each_error_is_one_clear_message(change, message):
    env = captured("step_1node_1task")
    for key, value in change.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    with pytest.raises(slurm_launch.LaunchError, match=re.escape(message)):
        plan([CONFIG, RECIPE], env)


def test_missing_config_and_cli_exit_code():
    env = {**os.environ, **captured("step_1node_1task")}
    out = subprocess.run([sys.executable, "launch/slurm_launch.py", "accelerate_configs/nope.yaml", RECIPE],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == ("slurm_launch: error: config file 'accelerate_configs/nope.yaml' does not "
                                  "exist (see accelerate_configs/)")


def test_dry_run_prints_the_command_and_starts_nothing(tmp_path):
    env = {**os.environ, **captured("step_2nodes_rank1"), "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    (tmp_path / "accelerate").write_text("#!/bin/sh\necho accelerate must not run >&2; exit 9\n")
    (tmp_path / "accelerate").chmod(0o755)
    out = subprocess.run([sys.executable, "launch/slurm_launch.py", "--dry-run", CONFIG, RECIPE, "--epochs", "1"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("[node 1 task 1] OMP_NUM_THREADS=1 accelerate launch "
                                 "--config_file accelerate_configs/2gpu.yaml --num_machines 2 --machine_rank 1 "
                                 "--num_processes 4 --main_process_ip node1 ")
    assert out.stdout.rstrip().endswith("recipes/mnist.py --epochs 1")


def test_a_first_host_that_does_not_resolve_is_refused():
    env = {**os.environ, **captured("step_1node_1task"), "SLURM_STEP_NODELIST": "no-such-host-x7"}
    out = subprocess.run([sys.executable, "launch/slurm_launch.py", CONFIG, RECIPE], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot resolve the job's first host 'no-such-host-x7'" in out.stderr


def test_outside_slurm_exits_before_anything_starts():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run([sys.executable, "launch/slurm_launch.py", CONFIG, RECIPE], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not inside a Slurm job" in out.stderr


@pytest.mark.parametrize("name", ["batch_1node", "batch_2nodes"])
def test_in_the_batch_script_itself_is_refused(name):
    """Run once in the batch script, the launcher would start node 0 only and the job would hang."""
    with pytest.raises(slurm_launch.LaunchError, match="run inside a job step"):
        plan([CONFIG, RECIPE], captured(name))


def test_tasks_per_node_forms():
    assert slurm_launch.tasks_per_node({"SLURM_TASKS_PER_NODE": "1(x2)"}) == 1
    assert slurm_launch.tasks_per_node({"SLURM_STEP_TASKS_PER_NODE": "4(x3)"}) == 4
    with pytest.raises(slurm_launch.LaunchError, match="uneven tasks per node"):
        slurm_launch.tasks_per_node({"SLURM_STEP_TASKS_PER_NODE": "2,1"})


def test_per_gpu_mode_needs_one_task_per_gpu():
    with pytest.raises(slurm_launch.LaunchError, match="mode per-gpu needs one task per GPU"):
        plan(["--mode", "per-gpu", CONFIG, RECIPE], captured("step_1node_1task"))


# --- a real Slurm ---------------------------------------------------------------------------------

def _cluster(tmp_path_factory, nodes, gpus):
    reason = unavailable_reason()
    if reason:
        skip_unless_ci(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp(f"slurm{nodes}"), nodes=nodes, gpus=gpus)
    cluster.start()
    return cluster


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    cluster = _cluster(tmp_path_factory, 1, gpus=4)  # room for two 2-GPU jobs at once
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    cluster = _cluster(tmp_path_factory, 2, gpus=2)
    yield cluster
    cluster.stop()


def submit(cluster, sbatch_args, launch_args, data_dir, out_dir, env=None, wait=True,
           training=("--max-steps", "6", "--log-every", "1"), recipe_args=None):
    """sbatch a template from the repo root; return (state, log text, job id). recipe_args: instead of mnist's."""
    recipe_args = ["--output-dir", str(out_dir), *(
        recipe_args if recipe_args is not None else ["--data-dir", str(data_dir), *DATA_ARGS, *training])]
    log = out_dir.parent / f"{out_dir.name}.log"
    config = next((a for a in launch_args if a.endswith(".yaml")), "")
    shipped = config.startswith("accelerate_configs/") and (REPO / config).is_file()
    route_env = cpu_route(Path(config).name)[1] if shipped else {}
    job_env = {"OMP_NUM_THREADS": "1", **route_env, **(env or {})}  # the CPU route of launching.py
    job = cluster.sbatch(["-o", str(log), *sbatch_args, *launch_args, *recipe_args], cwd=REPO, env=job_env)
    if not wait:
        return job, log
    state, _ = cluster.wait(job, timeout=400)
    return state, job_log(log), job


def job_log(log):
    """A finished job's output, once checked that none of its processes aborted (launching.check_exit)."""
    text = log.read_text()
    check_exit(text, f"the Slurm job logging to {log}")
    return text


def summary(out_dir):
    return json.loads((out_dir / "summary.json").read_text())


def steps_logged(out_dir):
    path = out_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def listening_ports():
    """TCP ports listened on in this network namespace, the one the one-node cluster's jobs run in."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def logged_port(log_text):
    return int(re.search(r"--main_process_port (\d+)", log_text).group(1))


def master_port(pid):
    """The rendezvous port torchrun gave this training process (from its environment)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"MASTER_PORT="))[len("MASTER_PORT="):])


@pytest.mark.slow
def test_two_jobs_on_one_node_at_once(one_node, data_dir, tmp_path):
    """The single-node template twice on one node of 4 fake GPUs at the same time, each job asking
    for 2 GPUs (the template's --gres=gpu:2): mode per-node (one task; its accelerate launch starts
    one process per GPU Slurm gave) and mode per-gpu in the tutorials' layout (--ntasks-per-node =
    GPUs, one process per task). The test holds the first job to train mid-training until the
    other trains too: the two training intervals overlap whatever the machine's speed. Then each
    job's processes use the port its launcher derived from the job id, a different one per job,
    and both ports are listening."""
    steps = 12
    training = ("--max-steps", str(steps), "--log-every", "1")
    env = {"TEST_STEP_SECONDS": "0.5"}  # at least 6 s of training per job: time to see both mid-training
    layouts = {"per_node": ["launch/single_node.sbatch"],
               "per_gpu": ["--ntasks-per-node=2", "launch/single_node.sbatch", "--mode", "per-gpu"]}
    jobs = {name: submit(one_node, args, [CONFIG, RECIPE], data_dir, tmp_path / name, env=env, wait=False,
                         training=training) for name, args in layouts.items()}

    def training_now():
        for name, (job, log) in jobs.items():
            state, fields = one_node.job_state(job)
            assert state in ("PENDING", "CONFIGURING", "RUNNING"), log.read_text()
            assert fields.get("Reason") != "Resources", f"job {name} waits for the other's resources"
        return [name for name in jobs if steps_logged(tmp_path / name) >= 1]

    wait_for(training_now, "a step of either job")
    first = training_now()[0]
    second = next(name for name in jobs if name != first)
    held = recipe_processes(str(tmp_path / first))
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: second in training_now(), f"a step of job {second} while job {first} is held")
        during = {name: steps_logged(tmp_path / name) for name in jobs}  # both read after `second` trained
        listening = listening_ports()
        used = {name: {master_port(pid) for pid in recipe_processes(str(tmp_path / name))} for name in jobs}
    finally:
        for pid in held:
            os.kill(pid, signal.SIGCONT)
    results = {name: one_node.wait(job, timeout=400)[0] for name, (job, _) in jobs.items()}
    logs = {name: job_log(log) for name, (_, log) in jobs.items()}
    for name, state in results.items():
        assert state == "COMPLETED", logs[name]
    for name, (job, _) in jobs.items():  # nothing a completed job started lives on (the timer's sleep included)
        wait_for(lambda: not one_node.job_processes(job), f"the end of every process of job {name}", timeout=30)
    # Both had trained and neither had finished at one moment: the training intervals overlap.
    assert all(1 <= during[name] < steps for name in jobs), during
    assert all(steps_logged(tmp_path / name) == steps for name in jobs)
    # Each job's processes met on one port, its own, and both ports were listening then. Per-node,
    # it is the port the launcher passed to accelerate launch, which on one machine moves to a
    # free port when that one is taken: a collision would not fail the job, it would show here.
    assert all(len(used[name]) == 1 for name in jobs), used
    ports = {name: min(used[name]) for name in jobs}
    assert ports["per_node"] != ports["per_gpu"], ports
    assert ports["per_node"] == logged_port(logs["per_node"]), (ports, logs["per_node"])
    assert set(ports.values()) <= listening, (ports, sorted(listening))
    for name in jobs:
        s = summary(tmp_path / name)
        assert (s["world_size"], s["distributed_type"]) == (2, "MULTI_CPU")  # 2 GPUs -> 2 processes
        assert len(set(s["param_checksum_per_rank"])) == 1
    assert "--num_processes 2" in logs["per_node"]
    assert {task for _, task in task_hosts(logs["per_gpu"])} == {"0", "1"}  # one launcher line per task


def launch_lines(log):
    """slurm_launch's lines that give a node's accelerate launch (host, node, task, the command), not its lines at a
    run's end (a stop's exit code)."""
    return [line for line in log.splitlines()
            if re.match(r"slurm_launch: \S+ node \d+ task \d+: accelerate launch ", line)]


def assert_one_launch_per_node(log):
    """Mode per-node: slurm_launch's one line per node, each on its own host, each node's accelerate launch meeting
    the first node at the namespace's address (not localhost), with its own machine rank."""
    lines = launch_lines(log)
    assert len(lines) == 2 and {line.split()[1] for line in lines} == {"node1", "node2"}, log  # one on each host
    assert all("--main_process_ip node1" in line for line in lines)  # the namespace address, not localhost
    assert {line.split("--machine_rank ")[1].split()[0] for line in lines} == {"0", "1"}


# DDP on two nodes (2gpu.yaml) is the preemption test's per-node job below, and 2 processes per node across two nodes
# the preflight job's; a DeepSpeed training here.
@pytest.mark.slow
@pytest.mark.parametrize("config", ["deepspeed_zero2.yaml"])
def test_two_node_job(two_nodes, data_dir, tmp_path, config):
    cfg = f"accelerate_configs/{config}"
    args = ["launch/multinode.sbatch", "--processes-per-node=1"]  # keep DeepSpeed at 2 processes on 2 cores
    state, log, _ = submit(two_nodes, args, [cfg, RECIPE], data_dir, tmp_path / "out")
    assert state == "COMPLETED", log
    s = summary(tmp_path / "out")
    assert s["world_size"] == 2
    assert s["distributed_type"] == "DEEPSPEED"
    assert_one_launch_per_node(log)
    assert len(set(s["param_checksum_per_rank"])) == 1  # every rank ends with the same weights


@pytest.mark.slow
def test_two_node_finetune_under_zero3(two_nodes, tmp_path):
    """recipes/finetune_lm.py through the multi-node template: one DeepSpeed ZeRO-3 process per node, the
    Hugging Face model loaded partitioned across the nodes and exported whole, loadable with from_pretrained."""
    from accelrun.data.tiny_hf import write_all
    hf = write_all(tmp_path / "hf")
    args = ["--model", str(hf / "model"), "--data-files", str(hf / "pairs.jsonl"), "--block-size", "32", "--max-steps",
            "4", "--batch-size", "16", "--log-every", "1", "--sample-tokens", "0"]
    state, log, _ = submit(two_nodes, ["launch/multinode.sbatch", "--processes-per-node=1"],
                           [str(fp32_config(tmp_path, "deepspeed_zero3.yaml")), "recipes/finetune_lm.py"], None,
                           tmp_path / "out", env={"PYTHONPATH": str(CPU_SHIM)}, recipe_args=args)
    assert state == "COMPLETED", log
    s = summary(tmp_path / "out")
    assert (s["world_size"], s["deepspeed_stage"], s["steps"]) == (2, 3, 4)
    assert s["model_init"] == "partitioned while loaded (transformers, zero.Init)"
    assert {line.split()[1] for line in launch_lines(log)} == {"node1", "node2"}, log
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    assert sum(p.numel() for p in model.parameters()) == s["param_elements"]


def task_hosts(log_text):
    """{(host, task)} of the launcher's one line per task ('slurm_launch: node2 node 1 task 1: ...')."""
    return set(re.findall(r"^slurm_launch: (\S+) node \d+ task (\d+): ", log_text, flags=re.M))


PER_GPU_TWO_NODES = ["--ntasks-per-node=1", "launch/multinode.sbatch", "--mode", "per-gpu", "--processes-per-node",
                     "1"]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["deepspeed_zero2.yaml", "fsdp.yaml"])  # DDP: the preemption test below
def test_per_gpu_mode_on_two_nodes(two_nodes, data_dir, tmp_path, reference, config):
    """One task per process on each node; the training of the fp32 reference run of this config
    (2 processes on one machine, shared with the resume tests; its checkpoints left out) ends with
    the same weights."""
    ref, _ = reference(config)
    out = tmp_path / "out"
    state, log, _ = submit(two_nodes, PER_GPU_TWO_NODES, [str(fp32_config(tmp_path, config)), RECIPE], data_dir,
                           out, env={"PYTHONPATH": str(CPU_SHIM)},  # its CPU route (launching.py)
                           training=TRAINING)
    assert state == "COMPLETED", log
    s = summary(out)
    assert s["world_size"] == 2
    assert s["distributed_type"] == {"deepspeed_zero2.yaml": "DEEPSPEED", "fsdp.yaml": "FSDP"}[config]
    assert task_hosts(log) == {("node1", "0"), ("node2", "1")}, log  # a process on each host
    if not EXPECTED[config][3]:  # each rank holds all the weights unless they are sharded (FSDP)
        assert len(set(s["param_checksum_per_rank"])) == 1
    run = LaunchResult(0, log, out)
    assert_identical_params(ref.params(), run.params())
    assert_same_steps(ref.metrics, run.metrics, after_step=0)


@pytest.mark.slow
def test_preflight_on_two_slurm_nodes(two_nodes, tmp_path):
    """launch/preflight.py through the same template and launcher as a training job, with the template's own number
    of processes per node (one per GPU Slurm gives: 2), so 4 ranks on 2 hosts: the multi-node template starting
    several processes on each node (the training jobs here run one per node, on 2 cores)."""
    log = tmp_path / "preflight.log"
    job = two_nodes.sbatch(["-o", str(log), "launch/multinode.sbatch", "accelerate_configs/multinode.yaml",
                            "launch/preflight.py", "--max-bytes", "65536"],
                           cwd=REPO, env={"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"})
    state, _ = two_nodes.wait(job, timeout=400)
    text = job_log(log)
    assert state == "COMPLETED", text
    rows = [line for line in text.splitlines() if line.startswith("rank ")]
    assert sorted(row.split("| host ")[1].split()[0] for row in rows) == ["node1", "node1", "node2", "node2"], text
    assert "preflight: 4 ranks on 2 host(s), backend gloo, main address node1:" in text
    assert "preflight: ok, 4 ranks agree on world size 4 and backend gloo" in text
    assert_one_launch_per_node(text)
    assert {line.split("--num_processes ")[1].split()[0] for line in launch_lines(text)} == {"4"}, text


@pytest.mark.slow
@pytest.mark.parametrize("sbatch_args, launch_args, env, message", [
    (["--ntasks-per-node=2"], [CONFIG, RECIPE], {}, "mode per-node needs one task per node"),
    (["--gres=none"], [CONFIG, RECIPE], {"ACCELERATE_USE_CPU": ""}, "but Slurm gave this task no GPU"),
    ([], ["accelerate_configs/missing.yaml", RECIPE], {}, "does not exist"),
])
def test_template_errors_fail_the_job_with_one_message(one_node, data_dir, tmp_path, sbatch_args, launch_args,
                                                       env, message):
    state, log, _ = submit(one_node, [*sbatch_args, "launch/single_node.sbatch"], launch_args, data_dir,
                           tmp_path / "out", env=env)
    assert state == "FAILED"
    assert message in log
    assert not (tmp_path / "out").exists()  # no process started


@pytest.mark.parametrize("remaining, expected", [
    ("1:02", 62), ("59:59", 3599), ("1:00:00", 3600), ("2-03:04:05", 2 * 86400 + 3 * 3600 + 4 * 60 + 5),
    ("UNLIMITED", None), ("NOT_SET", None), ("", None)])
def test_time_left_reads_squeue(remaining, expected):
    import time_left
    assert time_left.seconds(remaining) == expected


def test_shell_scripts_are_clean():
    scripts = [*sorted((REPO / "launch").glob("*.sbatch")), REPO / ".ci" / "run", REPO / "gpu_check" / "run.sh"]
    for script in scripts:
        text = script.read_text()
        assert "set -euo pipefail" in text, script
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
    if shutil.which("shellcheck") is None:
        skip_unless_ci("shellcheck not installed (apt-get install shellcheck; .ci/run does)")
    out = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


# --- preemption and time limits: the templates requeue a stopped job, which resumes ------------------

CPU_ROUTE_DDP = {"ACCELERATE_USE_CPU": "1", "PYTHONPATH": str(CPU_SHIM)}


def fp32_config(tmp_path, name="2gpu.yaml"):
    """A shipped config in fp32, as the reference runs: exact comparisons, and bf16 on a CPU is 7x slower."""
    config = tmp_path / name.replace(".yaml", "_fp32.yaml")
    text = (REPO / "accelerate_configs" / name).read_text()
    ds_file = (yaml.safe_load(text).get("deepspeed_config") or {}).get("deepspeed_config_file")
    if ds_file:  # with a DeepSpeed JSON only the JSON sets the dtype
        config.write_text(text.replace(ds_file, str(deepspeed_json_in(name, "no", tmp_path))))
        return config
    assert "mixed_precision: bf16" in text
    config.write_text(text.replace("mixed_precision: bf16", "mixed_precision: 'no'"))
    return config


FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


def wait_final(cluster, job, timeout=500):
    """Wait through requeues (REQUEUED, PENDING again) until the job really ends."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        state, fields = cluster.job_state(job)
        if state in FINAL_STATES:
            return state, fields
        time.sleep(0.5)
    cluster.run(["scancel", job])
    raise AssertionError(f"job {job} did not end within {timeout}s (last state {state})")


def pending_signals(pid):
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    return int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)


def wait_for(condition, what, timeout=300):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"no {what} after {timeout}s"
        time.sleep(0.1)


def srun_exit_codes(log_text):
    """The exit codes srun reports for tasks that exited non-zero ('srun: error: node2: task 1: Exited with
    exit code 75'); a task that srun ended itself (--kill-on-bad-exit) is reported 'Terminated' instead."""
    return re.findall(r"^srun: error: \S+: task \d+: Exited with exit code (\d+)$", log_text, flags=re.M)


def runs_of(log_text):
    """The appended log of a requeued job, one text per run ('job 7: run 2 on node[1-2]' starts each)."""
    return re.split(r"^job \d+: run \d+ on .*$", log_text, flags=re.M)[1:]


@pytest.mark.slow
@pytest.mark.parametrize("mode, stop, config, shrink", [
    pytest.param("per-node", "TERM", "2gpu.yaml", False, id="per-node-TERM"),
    pytest.param("per-gpu", "USR1", "2gpu.yaml", False, id="per-gpu-USR1"),
    pytest.param("per-node", "TERM", "fsdp.yaml", True, id="per-node-TERM-fsdp-back-on-1-node"),
])
def test_two_node_job_preempted_requeues_resumes_and_matches(two_nodes, data_dir, tmp_path, reference, mode, stop,
                                                             config, shrink):
    """A stop signal reaches every training process on both nodes mid-training; the job checkpoints,
    requeues itself, resumes and, back on the same nodes, ends with exactly the weights of the
    uninterrupted reference run.

    per-node, SIGTERM as a preemption sends it: Slurm 22.05 with PreemptMode=REQUEUE and a GraceTime
    signals every process of the job's steps (here: slurm_launch, torchrun and the training
    processes), not the batch script, as `scancel --signal=TERM` does. The batch script alone gets
    one too, as from `scancel --batch` or `--signal=B:TERM`: it must stay alive to requeue. (A signal
    to the batch script's children as well, `scancel --full`, would reach srun, which answers
    SIGTERM by killing the tasks: no template can checkpoint then.) slurm_launch turns the
    training's stop marker back into exit code 75, which srun reports.
    per-gpu, SIGUSR1 as the templates' own timer sends it: to the batch script, which passes it to
    srun, which passes it to the tasks, the training processes themselves.
    Back on 1 node (FSDP): the requeued job, pending, is moved to 1 node and 1 task (`scontrol update`,
    as a user or an admin does to get it started sooner): the same command and checkpoint directory
    on another allocation. The FSDP checkpoint of 2 processes is resharded onto 1 and the run says so
    (docs/checkpoints.md, "Another number of GPUs")."""
    ref, _ = reference(config)  # 2 processes, fp32, the same training (20 steps), uninterrupted
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    sbatch_args = (["launch/multinode.sbatch", "--processes-per-node=1"] if mode == "per-node"
                   else PER_GPU_TWO_NODES)
    route = CPU_ROUTE_DDP if config == "2gpu.yaml" else {"PYTHONPATH": CPU_ROUTE_DDP["PYTHONPATH"]}
    # Steps of at least 0.3 s (the CPU shim's TEST_STEP_SECONDS): the run is caught mid-training,
    # with 17 steps (5 s) to go, however fast the machine is.
    job, log = submit(two_nodes, sbatch_args, [str(fp32_config(tmp_path, config)), RECIPE], data_dir, out,
                      env={**route, "TEST_STEP_SECONDS": "0.3"},
                      wait=False, training=(*TRAINING, "--checkpoint-dir", str(ckpt)))
    signal_mid_training(two_nodes, job, log, out, stop)
    if shrink:
        move_to_one_node(two_nodes, job, log)
    state, fields = wait_final(two_nodes, job)
    text = job_log(log)
    assert state == "COMPLETED", text
    assert fields["Restarts"] == "1", fields
    stopped, resumed_run = runs_of(text)
    assert_stopped_and_requeued(stopped, mode, stop)
    if mode == "per-node" and not shrink:  # DDP on two nodes (2gpu.yaml), both runs of the job
        for run_log in (stopped, resumed_run):
            assert_one_launch_per_node(run_log)
    assert f"resumed from {ckpt}" in resumed_run and not srun_exit_codes(resumed_run)
    resumed = LaunchResult(0, text, out)
    s = resumed.summary
    assert s["steps"] == 20 and s["resumed_from_step"] >= 3 and s["resumed_from_world_size"] == 2
    assert s["distributed_type"] == {"2gpu.yaml": "MULTI_CPU", "fsdp.yaml": "FSDP"}[config]
    if not shrink:
        assert task_hosts(resumed_run) == {("node1", "0"), ("node2", "1")}, resumed_run
        assert s["world_size"] == 2 and s["resume_changes"] == []
        if not EXPECTED[config][3]:  # every rank ends with the same weights unless they are sharded
            assert len(set(s["param_checksum_per_rank"])) == 1
        assert_identical_params(ref.params(), resumed.params())
        assert_same_steps(ref.metrics, resumed.metrics, after_step=0)
    else:
        assert_resharded_onto_one_process(ref, resumed, resumed_run)


@pytest.mark.slow
def test_two_node_hsdp_job_preempted_requeues_resumes_and_matches(two_nodes, data_dir, tmp_path, reference):
    """Issue 50, item 2: HSDP (hsdp.yaml, fp32) on 2 nodes of 2 processes each (the template's one per GPU Slurm
    gives), per node: slurm_launch gives each node's accelerate launch dp_replicate_size 2 (nodes) and dp_shard_size 2
    (processes per node), so a node's 2 processes shard one copy of the model and each node holds a copy. SIGTERM
    mid-training, as a preemption sends it: the job checkpoints, requeues, resumes on the same nodes and ends with the
    weights and steps of the same training uninterrupted on one machine (test_hsdp.py's 2 x 2 run, conftest's
    reference). Its own job (145 s measured on a loaded 2-core machine, the reference's launch included: 2 runs of 4
    processes and the requeue's wait): the per-node preemption job above runs 1 process per node, and HSDP needs 2 or
    more; the preflight job runs no model."""
    ref, _ = reference("hsdp.yaml", "--no-batchnorm")
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    job, log = submit(two_nodes, ["launch/multinode.sbatch"], [str(fp32_config(tmp_path, "hsdp.yaml")), RECIPE],
                      data_dir, out, env={"PYTHONPATH": str(CPU_SHIM), "TEST_STEP_SECONDS": "0.3"}, wait=False,
                      training=(*TRAINING, "--no-batchnorm", "--checkpoint-dir", str(ckpt)))
    signal_mid_training(two_nodes, job, log, out, "TERM", processes=4)
    state, fields = wait_final(two_nodes, job)
    text = job_log(log)
    assert state == "COMPLETED", text
    assert fields["Restarts"] == "1", fields
    stopped, resumed_run = runs_of(text)
    assert_stopped_and_requeued(stopped, "per-node", "TERM")
    for run_log in (stopped, resumed_run):
        assert_one_launch_per_node(run_log)
        assert [mesh_of(line.split()) for line in launch_lines(run_log)] == [(2, 2), (2, 2)], run_log
    assert f"resumed from {ckpt}" in resumed_run and not srun_exit_codes(resumed_run)
    resumed = LaunchResult(0, text, out)
    s = resumed.summary
    assert (s["distributed_type"], s["world_size"], s["steps"], s["resume_changes"]) == ("FSDP", 4, 20, [])
    assert s["resumed_from_step"] >= 3 and s["resumed_from_world_size"] == 4
    checksums = s["param_checksum_per_rank"]  # ranks 0 and 1 on node1, 2 and 3 on node2: a copy per node
    assert checksums[0] == checksums[2] and checksums[1] == checksums[3] and checksums[0] != checksums[1], checksums
    assert s["param_elements_per_rank"] == [s["param_elements"] // 2] * 4
    assert_identical_params(ref.params(), resumed.params())
    assert_same_steps(ref.metrics, resumed.metrics, after_step=0)


def signal_mid_training(cluster, job, log, out, stop, processes=2):
    """At step 3 on both nodes, the training (`processes` of it) frozen: SIG`stop` as Slurm sends it (TERM: to the
    job's steps and the batch script, as preemption does; USR1: to the batch script, as the templates' timer does),
    until it is pending in every training process; then the training goes on, and meets it mid-training."""
    def at_step_3():
        if steps_logged(out) < 3:
            assert cluster.job_state(job)[0] in ("PENDING", "CONFIGURING", "RUNNING"), log.read_text()
            return False
        return len(recipe_processes(str(out))) == processes

    wait_for(at_step_3, "step 3 on both nodes")
    # Freeze the training so the signal lands mid-training, not after it ended.
    workers = recipe_processes(str(out))
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        if stop == "TERM":
            assert cluster.run(["scancel", "--signal=TERM", job]).returncode == 0
            assert cluster.run(["scancel", "--batch", "--signal=TERM", job]).returncode == 0
        else:  # what Slurm does at --signal=B:USR1@T, and the templates' timer: signal the batch script
            assert cluster.run(["scancel", "--batch", "--signal=USR1", job]).returncode == 0
        number = getattr(signal, f"SIG{stop}")
        wait_for(lambda: all(pending_signals(pid) & (1 << (number - 1)) for pid in workers),
                 f"SIG{stop} pending in {workers} (stopped at step {steps_logged(out)})", timeout=60)
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)


def move_to_one_node(cluster, job, log):
    """The requeued job, pending, moved to 1 node and 1 task, as a user or an admin does to get it started sooner.
    A requeued job may start only cred_expire + 1 s (15 + 1 here) after the requeue."""
    def requeued():
        state, fields = cluster.job_state(job)
        assert state in ("RUNNING", "COMPLETING", "REQUEUED", "PENDING"), log.read_text()
        return state == "PENDING" and fields["Restarts"] == "1"

    wait_for(requeued, "the job requeued and pending", timeout=120)
    # `NumNodes=1 NumTasks=1` in one update left the job pending on BadConstraints (NumNodes stayed 2);
    # one setting at a time, the node count as a range, moves it.
    for setting in ("NumNodes=1-1", "NumTasks=1", "NumCPUs=1"):
        moved = cluster.run(["scontrol", "update", f"JobId={job}", setting])
        assert moved.returncode == 0, moved.stderr


def assert_stopped_and_requeued(stopped, mode, stop):
    """The first run's log: the stop, the checkpoint, the requeue, exit code 75 from every task that exited on
    its own, and a training process on each host."""
    assert f"stopped by SIG{stop}" in stopped and "checkpoint saved, requeueing" in stopped
    if stop == "TERM":
        assert "SIGTERM, waiting for the training to checkpoint" in stopped
    else:
        assert "asking the training to checkpoint" in stopped
    # The step's exit status: every task that exited on its own exited 75 (per-node: slurm_launch
    # turning the training's stop marker back into 75, and saying so).
    assert srun_exit_codes(stopped) and set(srun_exit_codes(stopped)) == {"75"}, stopped
    if mode == "per-node":
        assert "slurm_launch: training stopped on a signal after saving a checkpoint (exit 75)" in stopped
    assert task_hosts(stopped) == {("node1", "0"), ("node2", "1")}, stopped  # a process on each host


def assert_resharded_onto_one_process(ref, resumed, resumed_run):
    """Back on 1 node: one task, one process, on the checkpoint of 2, resharded, and said so."""
    s = resumed.summary
    assert len(task_hosts(resumed_run)) == 1 and {task for _, task in task_hosts(resumed_run)} == {"0"}, resumed_run
    assert s["world_size"] == 1 and "written by 2 processes" in resumed_run
    assert s["resume_changes"][0] == ("world size 2 -> 1: torch.distributed.checkpoint reshards the model and "
                                      "optimizer by parameter name onto the new ranks"), s["resume_changes"]
    # The steps of 2 processes are the reference's exactly; after the resume every step is there once, in order,
    # with the reference's learning rate and epoch. Losses and weights follow the reference's to BatchNorm's
    # difference, not 1e-4: its statistics are per rank, over 100 samples with 2 processes and 200 with 1
    # (measured 2026-11-24: losses at most 9e-4 relative, all the weights 1.9e-3). A run that started over
    # instead would be far outside (step 5: about 2.5 against 1.9).
    assert [r["step"] for r in resumed.metrics] == list(range(1, 21))
    start = s["resumed_from_step"]
    assert_same_steps([r for r in ref.metrics if r["step"] <= start],
                      [r for r in resumed.metrics if r["step"] <= start], after_step=0)
    reference_steps = {r["step"]: r for r in ref.metrics}
    for r in resumed.metrics[start:]:
        expected = reference_steps[r["step"]]
        assert (r["lr"], r["epoch"]) == (expected["lr"], expected["epoch"]), r["step"]
        assert r["loss"] == pytest.approx(expected["loss"], rel=1e-2), r["step"]
    weights = [(ref.params()[name], weight) for name, weight in resumed.params().items() if weight.is_floating_point()]
    a, b = (torch.cat([pair[i].flatten() for pair in weights]) for i in (0, 1))
    assert ((a - b).norm() / a.norm()).item() < 1e-2


@pytest.mark.slow
def test_time_limit_warning_requeues_until_done(one_node, data_dir, tmp_path):
    """--time=2 and the template's timer 75 s before the limit: a run has at most 45 s from its
    start, start-up included. The training is sized by a fixed time per step (the CPU shim's
    TEST_STEP_SECONDS), not by this machine's speed: 60 steps of at least 1 s need more than one
    run on any machine, and finish through requeues, each run resuming the last. (Slurm's own
    --signal is not used: see launch/time_left.py.)"""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    config = fp32_config(tmp_path)
    training = ("--epochs", "6", "--batch-size", "200", "--log-every", "5", "--checkpoint-dir", str(ckpt))
    job, log = submit(one_node, ["--gres=none", "--time=2", "launch/single_node.sbatch", "--processes-per-node", "1"],
                      [str(config), RECIPE], data_dir, out, wait=False, training=training,
                      env={**CPU_ROUTE_DDP, "STOP_BEFORE_LIMIT": "75", "TEST_STEP_SECONDS": "1"})
    state, fields = wait_final(one_node, job, timeout=900)
    text = job_log(log)
    assert state == "COMPLETED", text
    restarts = int(fields["Restarts"])
    assert restarts >= 1, fields
    assert text.count("asking the training to checkpoint") >= restarts, text
    # The run's own line, once per stop (torchrun's report quotes it again, as "traceback : stopped by ...").
    assert sum(line.startswith("stopped by SIGUSR1") for line in text.splitlines()) == restarts, text
    # Each stop: slurm_launch turned the training's marker back into 75, and srun saw it.
    assert text.count("slurm_launch: training stopped on a signal after saving a checkpoint (exit 75)") == restarts
    assert srun_exit_codes(text) == ["75"] * restarts, text
    assert text.count(f"resumed from {ckpt}") == restarts
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["resumed_from_step"] > 0
    # Requeued and completed: no process of any of its runs lives on.
    wait_for(lambda: not one_node.job_processes(job), "the end of every process of the job", timeout=30)


@pytest.mark.slow
def test_cancelled_job_leaves_no_process(one_node, data_dir, tmp_path):
    """scancel of a training job: the batch script, its timer and sleep, srun, the launcher and the workers
    all end (the templates' EXIT trap ends the helpers Slurm's process tracking may lose)."""
    out = tmp_path / "out"
    job, log = submit(one_node, ["--gres=none", "launch/single_node.sbatch", "--processes-per-node", "2"],
                      [CONFIG, RECIPE], data_dir, out, wait=False, env=CPU_ROUTE_DDP,
                      training=("--epochs", "50", "--log-every", "1"))
    wait_for(lambda: steps_logged(out) >= 1, "a training step")
    assert len(one_node.job_processes(job)) >= 4, log.read_text()  # script, timer, sleep, srun, workers...
    assert one_node.run(["scancel", job]).returncode == 0
    state, _ = wait_final(one_node, job)
    assert state == "CANCELLED", log.read_text()
    wait_for(lambda: not one_node.job_processes(job), "the end of every process of the job", timeout=30)
