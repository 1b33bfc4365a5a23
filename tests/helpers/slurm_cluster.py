"""Start and stop a real Slurm cluster for the launch tests (Debian's slurm-wlm 22.05 and munge).

Everything lives in a temporary directory: config, munge key and socket, state, spool,
pid files and logs. The daemons run as root (SlurmUser=root) without systemd, and
are stopped by the PIDs this module started; then every process that still carries this
cluster's SLURM_CONF in its environment (a job's leftovers) is killed, nothing else.

Layouts (every node has `gpus` fake GPUs, 2 by default, gres on /dev/tty0-1 and up, so
tasks get SLURM_GPUS_ON_NODE, SLURM_STEP_GPUS and CUDA_VISIBLE_DEVICES as on a GPU node):
  * nodes=1: slurmctld and one slurmd on 127.0.0.1, the node named as this machine.
  * nodes=2: three network namespaces made here (controller, node1, node2), joined by
    a bridge inside the controller's namespace on 10.213.7.0/24, so nothing outside
    them is touched. Each daemon gets its own hostname and /etc/hosts (unshare -mu and
    a bind mount); jobs inherit them, so a launcher that wrongly used 127.0.0.1 would
    fail as on a real cluster. Namespaces are entered with `nsenter --net`, because
    `ip netns exec` remounts /sys and slurmd then finds no cgroup filesystem.

Settings that differ from a default cluster, for the requeue tests: cred_expire=15
(default 120), since a requeued job may only start again cred_expire + 1 s after the
requeue; and a scheduler that looks at pending jobs every second or two (bf_interval=1,
sched_interval=2; defaults 30 and 60 s), since nothing else wakes it when that time has
come: a requeued job started again 22 to 69 s after its requeue, 17 s with these.
"""

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from accelrun.launcher import process_state
from launching import free_port

SLURM_BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol")


def unavailable_reason():
    """Why a cluster cannot be started here, or None."""
    if os.geteuid() != 0:
        return "starting slurmctld/slurmd needs root"
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install slurmctld slurmd slurm-client munge)"
    return None


SLURM_CONF = """\
ClusterName=recipes-test
SlurmctldHost={controller}({controller_addr})
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire=15
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillOnBadExit=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
GresTypes=gpu
{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


SUBNET = "10.213.7"  # only ever assigned inside the namespaces this module creates


class SlurmCluster:
    def __init__(self, root, nodes=1, gpus=2):
        self.root = Path(root)
        self.gpus = gpus
        # One node is this machine under its own name, which resolves here as a compute node's would.
        self.nodes = [f"node{i + 1}" for i in range(nodes)] if nodes > 1 else [socket.gethostname().split(".")[0]]
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.pids = []
        self.netns = []
        tag = f"{os.getpid() % 100000}"
        self.ns = {"ctl": f"slt{tag}c", **{n: f"slt{tag}{n[-1]}" for n in self.nodes}} if nodes > 1 else {}
        self.addr = ({"ctl": f"{SUBNET}.1", **{n: f"{SUBNET}.{10 + i + 1}" for i, n in enumerate(self.nodes)}}
                     if nodes > 1 else {"ctl": "127.0.0.1", self.nodes[0]: "127.0.0.1"})

    # --- lifecycle -----------------------------------------------------------------------
    def start(self):
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self):
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o755)  # munged refuses a socket directory others can write
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        controller = "ctlhost" if self.ns else socket.gethostname().split(".")[0]
        node_lines = "\n".join(f"NodeName={n} NodeAddr={self.addr[n]} CPUs={os.cpu_count()} Gres=gpu:{self.gpus} "
                               f"State=UNKNOWN" for n in self.nodes)
        self.conf.write_text(SLURM_CONF.format(controller=controller, controller_addr=self.addr["ctl"],
                                               root=self.root, ctld_port=free_port(), slurmd_port=free_port(),
                                               node_lines=node_lines))
        (self.root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")  # 22.05 refuses other mounts
        (self.root / "gres.conf").write_text(f"Name=gpu File=/dev/tty[0-{self.gpus - 1}]\n")  # fake GPUs
        if self.ns:
            self._make_network()
        m = self.root / "munge"
        self._daemon(["munged", f"--socket={m}/munge.socket", f"--key-file={key}", f"--pid-file={m}/munged.pid",
                      f"--log-file={m}/munged.log", f"--seed-file={m}/seed", "--force"], m / "munged.pid")
        self._daemon(self._in("ctl", ["slurmctld", "-f", str(self.conf)], host=controller),
                     self.root / "slurmctld.pid")
        # slurmd registers only with a controller that answers.
        self._wait(lambda: "is UP" in self.run(["scontrol", "ping"]).stdout, 15, "slurmctld to answer")
        for n in self.nodes:
            self._daemon(self._in(n, ["slurmd", "-f", str(self.conf), "-N", n], host=n),
                         self.root / f"slurmd.{n}.pid")
        self._wait(lambda: self.run(["sinfo", "-h", "-N", "-o", "%T"]).stdout.split().count("idle") == len(self.nodes),
                   30, "every node to be idle")
        return self

    def _make_network(self):
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{self.addr[k]} {'ctlhost' if k == 'ctl' else k}\n" for k in self.addr)
        (self.root / "hosts").write_text(hosts)
        ctl = self.ns["ctl"]
        for name in self.ns.values():
            _ip("netns", "add", name)
            self.netns.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", ctl, "link", "add", "br0", "type", "bridge")
        _ip("-n", ctl, "addr", "add", f"{self.addr['ctl']}/24", "dev", "br0")
        _ip("-n", ctl, "link", "set", "br0", "up")
        for i, n in enumerate(self.nodes):
            _ip("-n", ctl, "link", "add", f"veth{i}", "type", "veth", "peer", "name", "eth0", "netns", self.ns[n])
            _ip("-n", ctl, "link", "set", f"veth{i}", "master", "br0", "up")
            _ip("-n", self.ns[n], "addr", "add", f"{self.addr[n]}/24", "dev", "eth0")
            _ip("-n", self.ns[n], "link", "set", "eth0", "up")

    def _in(self, where, cmd, host=None):
        """`cmd` inside `where`'s network namespace, with its own hostname and /etc/hosts."""
        if not self.ns:
            return cmd
        setup = f"mount --bind {self.root / 'hosts'} /etc/hosts && hostname {host} && exec \"$@\""
        return ["nsenter", f"--net=/run/netns/{self.ns[where]}", "unshare", "--mount", "--uts",
                "sh", "-c", setup, "sh", *cmd]

    def stop(self):
        """End every job, then the daemons, then whatever this cluster started that outlived them."""
        if self.pids:
            self._end_jobs()
        for pid in reversed(self.pids):
            try:
                os.kill(pid, 15)
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        for pid in self.pids:
            while time.time() < deadline and _alive(pid):
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, 9)
        self.pids = []
        self._kill_leftovers()
        for name in reversed(self.netns):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.netns = []

    def _end_jobs(self, timeout=30):
        """Cancel the jobs a failed test left running (a stopped daemon does not end its jobs' processes)."""
        try:
            jobs = self.run(["squeue", "-h", "-o", "%A"], timeout=20).stdout.split()
            if jobs:
                self.run(["scancel", *jobs], timeout=20)
            deadline = time.time() + timeout
            while jobs and time.time() < deadline:
                time.sleep(0.5)
                jobs = self.run(["squeue", "-h", "-o", "%A"], timeout=20).stdout.split()
        except (OSError, subprocess.SubprocessError):
            pass  # the controller is gone: the sweep below still finds the jobs' processes

    def _kill_leftovers(self):
        """SIGKILL every process that carries this cluster's SLURM_CONF in its environment: daemons,
        slurmstepd and everything a job started, inherited down to a timer's `sleep`. Nothing else has it."""
        mark = f"SLURM_CONF={self.conf}".encode()
        for _ in range(50):
            found = []
            for entry in filter(str.isdigit, os.listdir("/proc")):
                pid = int(entry)
                if pid == os.getpid():
                    continue
                try:
                    if mark in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                        found.append(pid)
                        os.kill(pid, 9)
                except (OSError, ProcessLookupError):
                    continue  # gone meanwhile, or a zombie
            if not found:
                return
            time.sleep(0.1)

    def job_processes(self, job_id):
        """Live processes that job `job_id` started, on any node (the nodes' namespaces share this /proc):
        the batch script and everything below it carry this cluster's SLURM_CONF and SLURM_JOB_ID."""
        marks = {f"SLURM_CONF={self.conf}".encode(), f"SLURM_JOB_ID={job_id}".encode()}
        found = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                environ = set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"))
            except OSError:
                continue
            if marks <= environ and process_state(entry) not in (None, "Z"):
                found.append(int(entry))
        return found

    def _daemon(self, cmd, pid_file):
        subprocess.run(cmd, env=self.env, check=True, capture_output=True, timeout=30)  # they daemonise
        self._wait(lambda: pid_file.exists() and pid_file.read_text().strip(), 10, f"{pid_file.name}")
        self.pids.append(int(pid_file.read_text().strip()))

    def _wait(self, predicate, timeout, what):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate():
                return
            time.sleep(0.2)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in (self.root / "log").glob("*.log"))
        raise RuntimeError(f"Slurm test cluster: timed out waiting for {what}\n{logs}")

    # --- use ------------------------------------------------------------------------------
    def run(self, cmd, **kwargs):
        """A Slurm client command, from the controller's network when the nodes are namespaced."""
        if self.ns:
            cmd = ["nsenter", f"--net=/run/netns/{self.ns['ctl']}", *cmd]
        return subprocess.run(cmd, env={**self.env, **kwargs.pop("env", {})}, capture_output=True, text=True,
                              timeout=kwargs.pop("timeout", 60), **kwargs)

    def sbatch(self, args, cwd, env=None):
        out = self.run(["sbatch", "--parsable", *args], cwd=cwd, env=env or {})
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().split(";")[0]

    def job_state(self, job_id):
        out = self.run(["scontrol", "show", "job", job_id]).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        return fields.get("JobState"), fields

    def wait(self, job_id, timeout=600):
        """Poll until the job ends (sbatch --wait polls slowly); return (state, fields)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            state, fields = self.job_state(job_id)
            if state not in (None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                return state, fields
            time.sleep(0.5)
        self.run(["scancel", job_id])
        raise AssertionError(f"job {job_id} still running after {timeout}s")


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
