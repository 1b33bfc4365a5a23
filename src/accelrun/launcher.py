"""The launcher a worker runs under: who turns its exit code into its own, and a worker that dies with its launcher.

Owns the tie between a training process and the launcher that started it (accelerate launch, torchrun's elastic
agent): whether such a launcher stands between the process and the user (launcher_in_between: it reports the
workers' exit code 75 as 1, so the run's first line names the stop command instead, stopping.how_to_stop), which
process it is (elastic_agent), what Linux's /proc/<pid>/stat says of a process (parent_of, process_state: its
one reading), and the orphan guard (die_with_launcher): a worker whose launcher dies, by a kill -9 or
an OOM kill, is killed with it, so that no orphan trains on and writes the checkpoints and logs of the rerun the user
starts next. Linux's /proc tells; elsewhere nothing is done. Standard library only.
"""

import ctypes
import os
import signal
import sys


def _stat_fields(pid):
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces and parentheses: it ends at the
    last one): [state, parent pid, ...]. OSError where /proc cannot tell: not Linux, or the process has ended."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    if len(fields) < 2:
        raise OSError(f"/proc/{pid}/stat holds no state and parent")
    return fields


def parent_of(pid):
    """The parent's pid of process `pid`; OSError where /proc cannot tell."""
    return int(_stat_fields(pid)[1])


def process_state(pid):
    """The state Linux gives process `pid` (R, S, D, Z for a zombie...), or None where /proc cannot tell: not Linux,
    or it has ended. The one reading of /proc/<pid>/stat for the lock (checkpoint/lock.py's alive) and the tests."""
    try:
        return _stat_fields(pid)[0]
    except OSError:
        return None


def _runs_torch(pid):
    """Whether the process has torch's libraries loaded, as the elastic agent (a torch program) has."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("libtorch" in line for line in f)
    except OSError:
        return False  # gone, or another user's process: the agent runs as the user of the workers it starts


def elastic_agent():
    """The pid of the torch elastic agent that started this process, or None if it is gone (or there is none).

    Under torchrun and accelerate launch (more than one process) the agent is torch's LocalElasticAgent: it
    gives every worker TORCHELASTIC_RUN_ID (and RANK, LOCAL_RANK, ...) and starts it as its own child
    (torch.distributed.elastic.multiprocessing: SubprocessHandler, Popen with start_new_session=True), or
    starts a program that starts the recipe (torchrun --no-python). So the agent is the nearest ancestor that
    runs torch. Once the agent is dead, the worker belongs to init or a subreaper (systemd, tini,
    slurmstepd), none of which runs torch; torchrun as a container's pid 1 is still found."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    pid, seen = os.getppid(), set()
    while pid > 0 and pid not in seen:  # 0: the parent is outside this pid namespace
        if _runs_torch(pid):
            return pid
        seen.add(pid)
        try:
            pid = parent_of(pid) if pid != 1 else 0
        except OSError:
            return None
    return None


def _argv_of(pid):
    """The command line of a process, each word's base name; None where Linux's /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [os.path.basename(a) for a in f.read().decode(errors="replace").split("\0")]
    except OSError:
        return None


def launcher_in_between():
    """Whether a launcher that turns this process's exit code into its own stands between it and the user: torchrun
    (accelerate launch with several processes) reports any exit that is not 0 as 1, accelerate launch with one
    process raises CalledProcessError and exits 1."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return True
    argv = _argv_of(os.getppid()) or []
    return "accelerate" in argv and "launch" in argv


def die_with_launcher():
    """Under accelerate launch / torchrun (Linux): SIGKILL this worker when its launcher dies. The launcher
    starts its workers in sessions of their own, so a kill -9 or an OOM kill of the launcher would leave
    them training as orphans, writing the same checkpoints and logs as the rerun the user starts next.

    Call it first thing (Run(...) does). A launcher killed while this worker was still importing torch is
    already gone: its worker belongs to init or a subreaper now, and exits at once."""
    parent = os.getppid()
    argv = _argv_of(parent)
    if argv is None:
        return  # not Linux
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's workers (several processes)
        if elastic_agent() is None:
            _exit_orphaned()
    elif not ("accelerate" in argv and "launch" in argv):  # accelerate launch's single child
        return  # a shell, srun, or no launcher at all
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: sent when the parent dies
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the line above: act now (a launcher may itself be pid 1)
        _exit_orphaned()


def _exit_orphaned():
    try:
        print(f"error: rank {os.environ.get('RANK', '?')} (pid {os.getpid()}): its launcher is gone (killed while "
              "this process started); exiting instead of training on alone", file=sys.stderr, flush=True)
    except OSError:
        pass  # the launcher held the other end of stderr
    os.kill(os.getpid(), signal.SIGKILL)
