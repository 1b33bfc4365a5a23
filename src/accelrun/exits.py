"""How a run ends when something is wrong, and how every run ends: one message, one exit code, no hang.

Owns:
  * fail: one clear line from the main process and the same non-zero exit on every rank;
  * one_line: a message that must stay one line (an exception's text runs over several: urllib's, torchvision's);
  * cut: a text cut short for a message, the one way every module cuts (each length a named decision of its user);
  * main_print: print() on the main process only;
  * report: the line on stderr and in torch elastic's error file, so the launcher's summary ends with it;
  * teardown: the end of every run: the process group destroyed and, in a run of several processes, the
    process ended without Python's interpreter finalization (see teardown's docstring for why).
"""

import atexit
import json
import multiprocessing
import os
import re
import signal
import sys
import time

# What a process that ended itself by a signal leaves in a launch's output (C++'s std::terminate, a segfault;
# torchrun's failure report names the signal): teardown() exists so that no run of this project shows it. The tests'
# check_exit and bench/exit_stress.py look for it.
SELF_INFLICTED = re.compile(r"terminate called[^\n]*|Signal \d+ \((?:SIGABRT|SIGSEGV|SIGBUS|SIGILL|SIGFPE)\)[^\n]*"
                            r"|exitcode\s*:\s*-(?:6|11|7|4|8)\b[^\n]*|Segmentation fault|Aborted \(core dumped\)")


def main_print(accelerator):
    """print() on the main process only (accelerator.print prints once per node)."""
    def log(*message, **kwargs):
        if accelerator.is_main_process:
            print(*message, **kwargs, flush=True)
    return log


def fail(accelerator, message, code=2, everyone=False):
    """One clear message from the main process, and exit `code` from every process that calls it.

    Under accelerate launch / torchrun each worker also writes the line to its torch elastic error file,
    so the launcher's failure summary ends with it ("traceback : error: ...") instead of a pointer to
    the docs; a real crash writes no such file and keeps its Python traceback. everyone=True: every
    rank calls this at the same point, so they meet once more before closing their connections (a
    rank that leaves first can break a peer still setting up gloo).
    """
    report(message, accelerator.is_main_process)
    if everyone and accelerator.num_processes > 1:
        accelerator.wait_for_everyone()
    sys.exit(teardown(accelerator, code))


def one_line(text, limit=400):
    """`text` as one line: its lines joined, at most `limit` characters."""
    return cut(" ".join(line.strip() for line in str(text).splitlines() if line.strip()), limit)


def cut(text, limit):
    """`text` when it has at most `limit` characters, else its start and "..." in `limit` characters."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def report(message, main, prefix="error: ", stream=None):
    """Write `error: message` (or `prefix` + message) to stderr (or `stream`; main process) and to this worker's torch
    elastic error file, whose line torchrun's failure report shows as the root cause."""
    line = f"{prefix}{one_line(message, limit=2000)}"
    if main:
        print(line, file=stream or sys.stderr, flush=True)
    reply = os.environ.get("TORCHELASTIC_ERROR_FILE")  # one per worker, set by the launcher
    if reply:
        try:
            with open(reply + ".tmp", "w") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
            os.replace(reply + ".tmp", reply)  # the launcher reads it whole or not at all
        except OSError:
            pass  # the message is on stderr anyway


def teardown(accelerator, code=0):
    """The end of a run on every rank: memory freed, trackers closed, the process group destroyed; returns `code`
    in a run of one process, and ends the process with it in a run of several.

    Why several processes end here, without Python's interpreter finalization: gloo's worker threads (the
    pt_gloo_runloop threads that run every collective on a CPU) wake the caller when a collective is done and
    only then drop their reference to it. If the caller has already dropped the tensors, that drop frees their
    Python objects, which needs the GIL; when it lands as the interpreter starts finalizing, CPython ends the
    thread inside a C++ destructor and the process aborts: "terminate called without an active exception",
    SIGABRT, a failed launch after the work was done (torch issue #190489). destroy_process_group does not stop
    those threads while anything else holds the group (a DDP module, DeepSpeed's groups, FSDP's mesh do), so the
    rank that leaves right after its last collective could meet it. Here the atexit handlers still run (trackers,
    logging, DataLoader workers), the output is flushed, and os._exit ends the process with no finalization for a
    thread to fall into. One process has no process group, and returns normally."""
    accelerator.free_memory()
    accelerator.end_training()
    _end_data_workers()
    if accelerator.num_processes == 1:
        return code
    atexit._run_exitfuncs()  # what interpreter exit runs first, while everything is alive
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _end_data_workers():
    """DataLoader workers still alive here (persistent_workers=True keeps them for the next epoch) are killed.

    Interpreter exit would send them SIGTERM and join them, but a worker ignores the stop signals (Slurm signals
    every task of a step: stopping.ignore_stop_signals), so that join waited forever: the run had written its
    results and never exited. One process too: its loaders may outlive main() (a signal handler's closure holds
    the run), so their workers are still there at exit. SIGKILL cannot be taken so;
    the workers hold nothing to save. torch's SIGCHLD handler is set back first: it raises for a worker that
    dies by a signal, which here is on purpose."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join()
