"""Test-only hooks on top of the CPU route (cpu_route/sitecustomize.py, which this file loads).

The tests put this folder on PYTHONPATH of every launch (Python imports only the first
`sitecustomize` it finds, so this one loads the CPU route itself). Two hooks, each off unless
its variable is set, for the one test that needs it:

* TEST_SLOW_SAVE_SECONDS: a slow file system. Accelerator.save_state into a directory whose
  name contains TEST_SLOW_SAVE_MATCH prints "TEST-SHIM: slow save" after writing its files and
  then sleeps, so a test can kill the run while that checkpoint is half-made.
* TEST_STEP_SECONDS (the Slurm time-limit test): every optimizer step of a worker takes at least
  that long, so a run's length is set by its step count, not by how fast the machine is.
"""

import importlib.util
import os


def _slow_save(seconds):
    import time

    from accelerate import Accelerator

    save_state = Accelerator.save_state

    def slow_save_state(self, output_dir=None, **kwargs):
        result = save_state(self, output_dir, **kwargs)
        if os.environ.get("TEST_SLOW_SAVE_MATCH", "") not in str(output_dir):
            return result
        print(f"TEST-SHIM: slow save in {output_dir}", flush=True)
        time.sleep(seconds)
        return result

    Accelerator.save_state = slow_save_state


def _slow_steps(seconds):
    import time

    from accelerate.optimizer import AcceleratedOptimizer

    step = AcceleratedOptimizer.step

    def slow_step(self, *args, **kwargs):
        started = time.monotonic()
        result = step(self, *args, **kwargs)
        time.sleep(max(0.0, seconds - (time.monotonic() - started)))
        return result

    AcceleratedOptimizer.step = slow_step


def _install():
    if os.environ.get("TEST_STEP_SECONDS") and "LOCAL_RANK" in os.environ:
        _slow_steps(float(os.environ["TEST_STEP_SECONDS"]))
    if os.environ.get("TEST_SLOW_SAVE_SECONDS"):
        _slow_save(float(os.environ["TEST_SLOW_SAVE_SECONDS"]))
    route = os.path.join(os.path.dirname(__file__), "..", "..", "cpu_route", "sitecustomize.py")
    spec = importlib.util.spec_from_file_location("cpu_route_sitecustomize", route)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


_install()
