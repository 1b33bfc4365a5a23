"""How a run ends when something is wrong, and how every run ends: one message, one exit code, no hang.

Owns:
  * fail: one clear line from the main process and the same non-zero exit on every rank;
  * main_print: print() on the main process only;
  * report: the line on stderr and in torch elastic's error file, so the launcher's summary ends with it;
  * teardown: the process group destroyed while the interpreter is still alive.
"""

import json
import os
import sys
import time


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
    accelerator.end_training()  # tear down the process group before exiting
    sys.exit(code)


def report(message, main):
    """Write `error: message` to stderr (main process) and to this worker's torch elastic error file."""
    line = f"error: {message}"
    if main:
        print(line, file=sys.stderr, flush=True)
    reply = os.environ.get("TORCHELASTIC_ERROR_FILE")  # one per worker, set by the launcher
    if reply:
        try:
            with open(reply + ".tmp", "w") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
            os.replace(reply + ".tmp", reply)  # the launcher reads it whole or not at all
        except OSError:
            pass  # the message is on stderr anyway


def teardown(accelerator):
    """Destroy the process group while the interpreter is alive: left to interpreter shutdown, gloo's C++
    side is torn down after Python and can abort a run that succeeded ("terminate called without an
    active exception")."""
    accelerator.free_memory()
    accelerator.end_training()
