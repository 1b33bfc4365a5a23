#!/usr/bin/env python3
"""Turn Slurm's variables into an `accelerate launch` of a recipe, evaluated inside each task.

Run it under `srun` from an sbatch script (see launch/*.sbatch):

    srun --kill-on-bad-exit=1 python3 launch/slurm_launch.py CONFIG RECIPE [RECIPE ARGS...]

The config chooses DDP, DeepSpeed or FSDP; Slurm decides the sizes. For an HSDP config (FSDP with
parallelism_config's dp_replicate_size, accelerate_configs/hsdp.yaml) that includes the mesh: one copy of the
model per node (dp_replicate_size = nodes), sharded over the node's processes (dp_shard_size = processes per node).

Mode `per-node` (default, `--ntasks-per-node=1`): each task is one node's
`accelerate launch`, which starts one process per GPU of that node.
Mode `per-gpu` (`--ntasks-per-node` = GPUs per node, as the national centres'
tutorials do): each task is one training process. accelerate's own code turns
the config into the environment the recipe reads, and the ranks come from
SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS.

Before anything starts, every task runs launch/check_config.py on the config and recipe.
`--dry-run` prints the command (and, per-gpu, the rank variables) and exits.

Stop signals (Slurm's `--signal=USR1@120`, a preemption's SIGTERM) must reach the
training processes, which then checkpoint and exit with code 75. Per-gpu, the task
is the recipe itself. Per-node, torchrun (inside accelerate launch) sits in between:
it dies on SIGUSR1 unless told otherwise and reports any worker failure as exit
code 1. So this launcher stays as the task's parent, passes SIGUSR1/SIGUSR2/SIGTERM/
SIGINT on to the training processes, keeps torchrun deaf to SIGUSR1/SIGUSR2, and
turns the recipes' "stopped" marker back into exit code 75 for the sbatch script.
"""

import argparse
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import yaml

import check_config  # launch/check_config.py, next to this file

# The recipes' code for "stopped on a signal, checkpoint saved": its one definition is accelrun's, installed with the
# recipes (requirements.txt); this checkout's src/ goes last on sys.path, shadowing nothing installed, for a node that
# runs the script from the checkout alone. accelrun/stopping.py imports the standard library alone.
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from accelrun.launcher import parent_of  # noqa: E402  (the one reading of /proc/<pid>/stat; standard library only)
from accelrun.stopping import EXIT_STOPPED  # noqa: E402

GPU_TYPES = ("MULTI_GPU", "DEEPSPEED", "FSDP")
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


class LaunchError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""


def expand_hostlist(nodelist):
    """Every host of a Slurm node list, in order: `n[1-2]`, `gpu[01-04,07]`, `rack[1-2]-n[01-02]`, ..."""
    try:
        import hostlist  # python-hostlist, the package the IDRIS course code uses
        hosts = hostlist.expand_hostlist(nodelist)
    except Exception as exc:  # BadHostlist, or an empty or malformed string
        raise LaunchError(f"cannot parse the Slurm node list {nodelist!r} ({exc})") from None
    if not hosts:
        raise LaunchError(f"the Slurm node list {nodelist!r} names no host")
    return hosts


def first_host(nodelist, scontrol="scontrol"):
    """The job's first host: `scontrol show hostnames` when it works, else our own expansion."""
    if shutil.which(scontrol):
        try:  # scontrol can be installed without a slurm.conf ("Could not establish a configuration source")
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=20)
            if out.returncode == 0 and out.stdout.split():
                return valid_host(out.stdout.split()[0])
        except (OSError, subprocess.TimeoutExpired):
            pass
    return valid_host(expand_hostlist(nodelist)[0])


LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"  # one dot-separated part of a host name
HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){LABEL}(\.{LABEL})*$")


def valid_host(host):
    """A host name every rank will be told to connect to: letters, digits, '-' and '.', nothing a shell splits."""
    if not HOSTNAME.match(host):
        raise LaunchError(f"the job's first host {host!r} is not a valid host name (RFC 1123: letters, digits, '-', "
                          f"'.'); check SLURM_JOB_NODELIST")
    return host


def count_gpus(env):
    """GPUs Slurm gave this task, from the first variable that says."""
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"])
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = env.get(name, "").strip()
        if value and value not in ("NoDevFiles", "-1"):
            return len(value.split(","))
    return 0


def require(env, *names):
    for name in names:
        if env.get(name, "") != "":
            return env[name]
    raise LaunchError(f"Slurm variable {' or '.join(names)} is not set: run this inside an sbatch job, under srun")


def tasks_per_node(env):
    """This step's tasks per node; Slurm writes e.g. '2(x3)' or '2,1'."""
    value = env.get("SLURM_NTASKS_PER_NODE") or require(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    counts = {int(m) for m in re.findall(r"(\d+)(?:\(x\d+\))?", value)}
    if len(counts) != 1:
        raise LaunchError(f"uneven tasks per node ({value}); give every node the same --ntasks-per-node")
    return counts.pop()


def threads_per_process(env, processes_here):
    """CPU threads for each training process of this task: the cores Slurm gave the task, shared evenly.
    torch's launcher sets OMP_NUM_THREADS=1 when it is unset, which leaves DeepSpeed's CPU Adam (optimizer
    offload: OpenMP) on one core. An OMP_NUM_THREADS set by the user wins."""
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"])
    if env.get("SLURM_CPUS_PER_TASK", "").isdigit():  # sbatch --cpus-per-task
        cpus = int(env["SLURM_CPUS_PER_TASK"])
    elif env.get("SLURM_CPUS_ON_NODE", "").isdigit():  # the job's cores on this node, shared by its tasks here
        cpus = int(env["SLURM_CPUS_ON_NODE"]) // max(tasks_per_node(env), 1)
    else:
        return 1
    return max(cpus // max(processes_here, 1), 1)


# Rendezvous ports: 15000-29999, above the registered services people run most (8000s, 9000s) and
# below Linux's ephemeral range (32768-60999), where the kernel picks the ports of outgoing connections.
PORT_BASE, PORT_SPAN = 15000, 15000


def job_port(env, override):
    """A rendezvous port derived from the job id: two jobs on one node differ unless their ids differ by a
    multiple of 15000. --port, or RECIPE_PORT in the environment, overrides it."""
    if override:
        return override
    if env.get("RECIPE_PORT"):
        try:
            return int(env["RECIPE_PORT"])
        except ValueError:
            raise LaunchError(f"RECIPE_PORT={env['RECIPE_PORT']!r} is not a port number") from None
    return PORT_BASE + int(require(env, "SLURM_JOB_ID")) % PORT_SPAN


def hosts_rendezvous(args, env):
    """True for the task whose process listens on the rendezvous port: node 0 (per-node), rank 0 (per-gpu)."""
    return env.get("SLURM_NODEID") == "0" and (args.mode == "per-node" or env.get("SLURM_PROCID") == "0")


def check_port_free(port):
    """Fail now, with the reason, instead of a hang or a torch traceback once the training has started."""
    with socket.socket() as probe:
        # As torch's TCPStore does: the sockets of a run that just ended (TIME_WAIT) do not make it "taken".
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as exc:
            raise LaunchError(f"rendezvous port {port} on {socket.gethostname()} is taken ({exc.strerror}): another "
                              f"job's rendezvous or a service listens there. Give a free one with --port N or "
                              f"RECIPE_PORT=N (docs/slurm.md)") from None


def plan(args, env, resolve=True):
    """Return (command, extra environment) for this task, or raise LaunchError."""
    config = check_job(args, env)
    distributed_type = config["distributed_type"]
    nodes = int(require(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES"))
    node_rank = int(require(env, "SLURM_NODEID"))
    main_host, port = rendezvous_address(args, env, resolve)
    ntasks_node = tasks_per_node(env)
    per_node = processes_per_node(args, env, distributed_type)
    mesh = hsdp_mesh(args, config, nodes, per_node)
    if args.mode == "per-node":
        if ntasks_node != 1:
            raise LaunchError(f"mode per-node needs one task per node, this step has {ntasks_node}: use "
                              f"--ntasks-per-node=1, or --mode per-gpu")
        cmd = ["accelerate", "launch", "--config_file", args.config,
               "--num_machines", str(nodes), "--machine_rank", str(node_rank),
               "--num_processes", str(nodes * per_node),
               "--main_process_ip", main_host, "--main_process_port", str(port),
               "--rdzv_backend", "static", "--same_network"]
        if distributed_type == "DEEPSPEED":
            cmd += ["--deepspeed_multinode_launcher", "standard"]  # torchrun on every node, no pdsh/ssh
        cmd += mesh
        # The environment, not --num_cpu_threads_per_process: accelerate's DeepSpeed launcher drops that flag.
        return cmd + [args.recipe, *args.recipe_args], {"OMP_NUM_THREADS": str(threads_per_process(env, per_node))}

    # per-gpu: this task is one process of nodes x tasks-per-node.
    if ntasks_node != per_node:
        raise LaunchError(f"mode per-gpu needs one task per GPU: {ntasks_node} tasks per node but {per_node} "
                          f"GPUs (or --processes-per-node); use --ntasks-per-node={per_node}")
    world = int(require(env, "SLURM_NTASKS"))
    ranks = {"RANK": require(env, "SLURM_PROCID"), "LOCAL_RANK": require(env, "SLURM_LOCALID"),
             "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(ntasks_node), "GROUP_RANK": str(node_rank),
             "MASTER_ADDR": main_host, "MASTER_PORT": str(port),
             "OMP_NUM_THREADS": str(threads_per_process(env, 1))}
    return [sys.executable, args.recipe, *args.recipe_args], {**accelerate_env(args.config, nodes, world, mesh),
                                                              **ranks}


def hsdp_mesh(args, config, nodes, per_node):
    """An HSDP config's sizes from Slurm, as accelerate launch's options: a copy of the model per node, sharded over
    the node's processes (only gradients cross between nodes); [] for any other config."""
    if not check_config.is_hsdp(config):
        return []
    if per_node < 2:
        raise LaunchError(f"{args.config} is HSDP, which shards each node's copy of the model over the node's "
                          f"processes, and this job has {per_node} per node: give each node 2 or more GPUs "
                          f"(--gres=gpu:N), or use accelerate_configs/multinode.yaml (DDP)")
    return ["--parallelism_config_dp_replicate_size", str(nodes), "--parallelism_config_dp_shard_size", str(per_node)]


def check_job(args, env):
    """The config (its YAML, read), once this task is a job step and the config and the recipe are usable."""
    if "SLURM_JOB_ID" not in env:
        raise LaunchError("not inside a Slurm job (SLURM_JOB_ID is unset): submit it with sbatch, "
                          "see launch/single_node.sbatch")
    if "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
        raise LaunchError("run inside a job step: `srun --kill-on-bad-exit=1 python3 launch/slurm_launch.py ...`")
    if not os.path.isfile(args.config):
        raise LaunchError(f"config file {args.config!r} does not exist (see accelerate_configs/)")
    try:
        with open(args.config) as f:
            config = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise LaunchError(f"{args.config} is not an accelerate config ({exc})") from None
    if not isinstance(config, dict) or "distributed_type" not in config:
        raise LaunchError(f"{args.config} is not an accelerate config (it has no distributed_type)")
    if not os.path.isfile(args.recipe):
        raise LaunchError(f"recipe {args.recipe!r} does not exist")
    # The traps that would bite only after start-up; an HSDP config's two sizes are this launcher's (hsdp_mesh).
    errors, _ = check_config.check(args.config, args.recipe, filled=True)
    if errors:
        raise LaunchError(errors[0] + (f" (and {len(errors) - 1} more problem(s): python3 launch/check_config.py "
                                       f"{args.config} --recipe {args.recipe})" if len(errors) > 1 else ""))
    return config


def rendezvous_address(args, env, resolve):
    """(main host, port) where every process meets: the job's first host, resolvable from here, and a usable
    port, free on the task that listens on it."""
    main_host = first_host(require(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"))
    if resolve and not args.dry_run:
        try:  # every rank connects to this name; a name the node cannot resolve would hang until the timeout
            socket.getaddrinfo(main_host, None)
        except socket.gaierror as exc:
            raise LaunchError(f"this node cannot resolve the job's first host {main_host!r} ({exc}); "
                              f"the processes could never meet") from None
    port = job_port(env, args.port)
    if not 1024 < port < 65536:
        raise LaunchError(f"rendezvous port {port} is not a usable port: give one between 1025 and 65535")
    if resolve and not args.dry_run and hosts_rendezvous(args, env):
        check_port_free(port)
    return main_host, port


def processes_per_node(args, env, distributed_type):
    """--processes-per-node, or the GPUs Slurm gave this task (1 without); a GPU config without a GPU is refused."""
    gpus = count_gpus(env)
    on_cpu = env.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    if distributed_type in GPU_TYPES and gpus == 0 and not (on_cpu or args.processes_per_node):
        raise LaunchError(f"{args.config} is a GPU config ({distributed_type}) but Slurm gave this task no GPU: "
                          f"the processes would train as independent copies. Ask for GPUs (--gres=gpu:N) or, "
                          f"on a CPU-only cluster, set ACCELERATE_USE_CPU=1 and --processes-per-node.")
    return args.processes_per_node or gpus or 1


def accelerate_env(config_file, nodes, world, mesh=()):
    """The environment `accelerate launch` would give a worker for this config (its own code); mesh: HSDP's sizes
    (hsdp_mesh), given as to accelerate launch."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    parsed = launch_command_parser().parse_args(
        ["--config_file", config_file, "--num_machines", str(nodes), "--num_processes", str(world),
         "--main_process_ip", "127.0.0.1", "--main_process_port", "1", *mesh, "placeholder.py"])
    parsed, defaults, mp_from_config = _validate_launch_command(parsed)
    if parsed.use_deepspeed:  # as accelerate's launch_command does before its DeepSpeed launcher
        fields = list(defaults.deepspeed_config) if defaults else []
        parsed.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * mp_from_config)
        parsed.deepspeed_multinode_launcher = "standard"
        _, env = prepare_deepspeed_cmd_env(parsed)
    else:
        env = prepare_multi_gpu_env(parsed)
    # PARALLELISM_CONFIG_*: the sequence-parallel (and data-parallel mesh) sizes; without them a per-gpu worker would
    # train without the parallelism its config names.
    kept = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")
    return {k: v for k, v in env.items() if k.startswith(kept) and os.environ.get(k) != v}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["per-node", "per-gpu"], default="per-node",
                   help="per-node: one srun task per node runs accelerate launch; per-gpu: one task per process")
    p.add_argument("--processes-per-node", type=int, default=0,
                   help="override the GPU count Slurm reports (CPU-only clusters)")
    p.add_argument("--port", type=int, default=0,
                   help="rendezvous port (default: RECIPE_PORT, else 15000 + SLURM_JOB_ID mod 15000)")
    p.add_argument("--dry-run", action="store_true", help="print what this task would run, and exit")
    p.add_argument("config", help="an accelerate config, e.g. accelerate_configs/2gpu.yaml")
    p.add_argument("recipe", help="the training script, e.g. recipes/mnist.py")
    p.add_argument("recipe_args", nargs=argparse.REMAINDER, help="passed to the recipe unchanged")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        cmd, extra_env = plan(args, os.environ)
    except LaunchError as exc:
        print(f"slurm_launch: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in sorted(extra_env.items()))
        print(f"[node {os.environ.get('SLURM_NODEID')} task {os.environ.get('SLURM_PROCID')}] {prefix}"
              + shlex.join(cmd), flush=True)
        return 0
    # One line per task in the job log: which host ran what (the test of the templates reads it).
    print(f"slurm_launch: {socket.gethostname()} node {os.environ.get('SLURM_NODEID')} task "
          f"{os.environ.get('SLURM_PROCID')}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if args.mode == "per-gpu":  # exec: Slurm's signals and exit status go straight to the recipe
        os.execvpe(cmd[0], cmd, {**os.environ, **extra_env})
    return run_accelerate_launch(cmd, {**os.environ, **extra_env})


def children(pid):
    """PIDs whose parent is `pid`: the training processes torchrun started."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if parent_of(entry) == pid:
                found.append(int(entry))
        except (OSError, ValueError):
            continue  # gone meanwhile
    return found


def run_accelerate_launch(cmd, env):
    marker_dir = None
    if not env.get("RECIPE_STOP_MARKER"):  # the sbatch templates set a job-wide one on shared storage
        marker_dir = tempfile.mkdtemp(prefix="slurm_launch.")
        env = {**env, "RECIPE_STOP_MARKER": os.path.join(marker_dir, "stopped")}
    # torchrun's own grace period after it passes a SIGTERM on (default 30 s) is too short for
    # the checkpoint of a large model.
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")
    # Ignored signals stay ignored across exec: torchrun survives SIGUSR1/SIGUSR2 (Slurm sends
    # them to every process of the step); the recipes install their own handlers.
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    child = subprocess.Popen(cmd, env=env)
    received = []

    def forward(signum, frame):
        received.append(signum)
        for pid in children(child.pid):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            returncode = child.wait(timeout=5)
            break
        except subprocess.TimeoutExpired:
            # A training process still importing torch ignores SIGUSR1 (inherited from here) until
            # the recipe installs its handler: repeat a stop request until everything has ended.
            if received and received[-1] != signal.SIGINT:
                forward(received[-1], None)
    stopped = os.path.exists(env["RECIPE_STOP_MARKER"])
    if marker_dir:
        shutil.rmtree(marker_dir, ignore_errors=True)
    if returncode != 0 and stopped:
        print(f"slurm_launch: training stopped on a signal after saving a checkpoint (exit {EXIT_STOPPED})",
              file=sys.stderr, flush=True)
        return EXIT_STOPPED
    return returncode if returncode >= 0 else 128 - returncode


if __name__ == "__main__":
    sys.exit(main())
