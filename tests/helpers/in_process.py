"""A recipe's main(argv) run in the test's own process, for the refusals that need no launch to show: no interpreter
to start, no torch, accelerate or torchvision to import again (seconds each), the recipe's own code from its first line.

What a process of its own would give back is given back here: its exit code (SystemExit's, or what main returns), what
it printed (stdout and stderr, as Python writes them), and its exit handlers run when it ends (a run releases its
--checkpoint-dir lock in one), so that "nothing left behind" is checked as after a real exit. What a run changes in its
process is put back afterwards: the environment, the stop signals' handlers, the accelerate state, the working
directory, the random number generators. A run that would hang fails the test after `timeout` seconds instead (SIGALRM
interrupts a blocking open).

Each refusal checked this way keeps one real launch elsewhere that shows its line and exit code from a process of its
own (the test that uses this module names it).
"""

import atexit
import contextlib
import io
import os
import signal
import sys

import pytest

from launching import REPO

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


class Hung(Exception):
    pass


@contextlib.contextmanager
def kept_process_state(timeout=None):
    """Whatever a recipe's main() changes in this process is put back when the block ends; yields the exit handlers
    it registered, which run then (in reverse order, as at interpreter exit)."""
    import random

    import numpy as np
    import torch

    environ, cwd = dict(os.environ), os.getcwd()
    rngs = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    handlers = {number: signal.getsignal(number) for number in (*STOP_SIGNALS, signal.SIGALRM)}
    registered, register = [], atexit.register

    def at_exit(function, *args, **kwargs):
        registered.append((function, args, kwargs))
        return function

    def hung(signum, frame):
        raise Hung(f"still running after {timeout} s")

    atexit.register = at_exit
    if timeout:
        signal.signal(signal.SIGALRM, hung)
        signal.alarm(timeout)
    try:
        yield registered
    finally:
        signal.alarm(0)
        atexit.register = register
        try:
            for function, args, kwargs in reversed(registered):
                function(*args, **kwargs)
        finally:
            from accelerate.state import AcceleratorState, GradientState
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            for number, handler in handlers.items():
                signal.signal(number, handler)
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(environ)
            random.setstate(rngs[0])
            np.random.set_state(rngs[1])
            torch.random.set_rng_state(rngs[2])


def run_main(recipe, argv, timeout=120):
    """(exit code, output) of recipes/<recipe>.py's main(argv) in this process, as `python recipes/<recipe>.py ARGV`
    would end: SystemExit's code or main's return value, stdout and stderr together."""
    if str(REPO / "recipes") not in sys.path:
        sys.path.insert(0, str(REPO / "recipes"))
    module = __import__(recipe)
    output = io.StringIO()
    code = None
    try:
        with kept_process_state(timeout), contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            try:
                code = module.main(list(map(str, argv)))
            except SystemExit as exc:
                code = exc.code
    except Hung as exc:
        pytest.fail(f"{recipe}.py {' '.join(map(str, argv))}: {exc}:\n{output.getvalue()[-3000:]}")
    return (code or 0) if isinstance(code, int) or code is None else 1, output.getvalue()
