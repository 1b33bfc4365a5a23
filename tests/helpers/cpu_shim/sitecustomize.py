"""Test-only hooks on top of the CPU route (cpu_route/sitecustomize.py, which this file loads).

The tests put this folder on PYTHONPATH of every launch (Python imports only the first
`sitecustomize` it finds, so this one loads the CPU route itself). Hooks, each off unless
its variable is set, for the test that needs it:

* TEST_SLOW_SAVE_SECONDS: a slow file system. Accelerator.save_state into a directory whose
  name contains TEST_SLOW_SAVE_MATCH prints "TEST-SHIM: slow save" after writing its files and
  then sleeps, so a test can kill the run while that checkpoint is half-made.
* TEST_SLOW_LOAD_SECONDS: the same for Accelerator.load_state ("TEST-SHIM: slow load"), so a test
  can kill a rank in the middle of a resume.
* TEST_SLOW_CONVERT_SECONDS: the same for the universal conversion of a ZeRO checkpoint (resharding.py): at the
  first fragment DeepSpeed's ds_to_universal saves into its temporary folder, "TEST-SHIM: slow conversion" and a
  sleep, so a test can change the checkpoint, or the conversion's directory, while the conversion runs.
* TEST_SLOW_DATA_SECONDS: a slow data set. Reading MNIST (torchvision's MNIST()) prints "TEST-SHIM: slow data" and
  sleeps first, so a test can stop a run while it loads its data, before training begins.
* TEST_FAKE_GPUS: a worker sees this many GPUs (torch.cuda reports them; none is usable), to test
  the refusal of more processes than GPUs on a machine without any.
* TEST_COUNT_SYNCS=DIR: each worker counts, per optimizer step, the calls that make the host wait
  (.item(), .tolist(), .cpu(), torch.cuda.synchronize, collectives) and writes DIR/rank<R>.json.
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


def _slow_data(seconds):
    import time

    from torchvision.datasets import MNIST

    init = MNIST.__init__

    def slow_init(self, *args, **kwargs):
        print("TEST-SHIM: slow data", flush=True)
        time.sleep(seconds)
        init(self, *args, **kwargs)

    MNIST.__init__ = slow_init


def _slow_load(seconds):
    import time

    from accelerate import Accelerator

    load_state = Accelerator.load_state

    def slow_load_state(self, input_dir=None, **kwargs):
        result = load_state(self, input_dir, **kwargs)
        print(f"TEST-SHIM: slow load from {input_dir}", flush=True)
        time.sleep(seconds)
        return result

    Accelerator.load_state = slow_load_state


def _slow_convert(seconds):
    import time

    import torch

    save, paused = torch.save, []
    # The run's own stdout, kept now: the conversion runs with descriptors 1 and 2 caught (resharding.converter_quiet),
    # and the test waits for this line in the run's output.
    out = os.dup(1)

    def slow_save(obj, f, *args, **kwargs):
        result = save(obj, f, *args, **kwargs)
        if not paused and "pytorch_model/tmp/" in str(f):
            paused.append(f)
            os.write(out, b"TEST-SHIM: slow conversion\n")
            time.sleep(seconds)
        return result

    torch.save = slow_save


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


def _fake_gpus(count):
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: count


def _count_syncs(directory):
    """Count the calls that make the host wait for the device or for other ranks, per optimizer step
    (index k: from the end of step k's optimizer step to the end of step k+1's), written at exit."""
    import atexit
    import collections
    import json
    import sys

    import torch
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook

    state = {"step": 0}
    counts = collections.defaultdict(list)

    def wrap(owner, name):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if "/torch/" not in caller:  # torch's own bookkeeping (CPU-side step counters) is not ours
                counts[state["step"]].append(f"{name} from {caller.rsplit('/', 2)[-2:]}")
            return original(*args, **kwargs)
        setattr(owner, name, counted)

    for name in ("item", "tolist", "cpu"):
        wrap(torch.Tensor, name)
    wrap(torch.cuda, "synchronize")
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                 "barrier", "all_gather_object", "broadcast_object_list", "gather", "reduce", "scatter"):
        wrap(dist, name)

    def stepped(optimizer, args, kwargs):
        state["step"] += 1
    register_optimizer_step_post_hook(stepped)

    def write():
        path = os.path.join(directory, f"rank{os.environ.get('RANK', '0')}.json")
        with open(path, "w") as f:
            json.dump({str(k): v for k, v in counts.items()}, f)
    atexit.register(write)


def _install():
    if os.environ.get("TEST_COUNT_SYNCS") and "LOCAL_RANK" in os.environ:
        _count_syncs(os.environ["TEST_COUNT_SYNCS"])
    if os.environ.get("TEST_FAKE_GPUS") and "LOCAL_RANK" in os.environ:
        _fake_gpus(int(os.environ["TEST_FAKE_GPUS"]))
    if os.environ.get("TEST_STEP_SECONDS") and "LOCAL_RANK" in os.environ:
        _slow_steps(float(os.environ["TEST_STEP_SECONDS"]))
    if os.environ.get("TEST_SLOW_SAVE_SECONDS"):
        _slow_save(float(os.environ["TEST_SLOW_SAVE_SECONDS"]))
    if os.environ.get("TEST_SLOW_CONVERT_SECONDS"):
        _slow_convert(float(os.environ["TEST_SLOW_CONVERT_SECONDS"]))
    if os.environ.get("TEST_SLOW_LOAD_SECONDS"):
        _slow_load(float(os.environ["TEST_SLOW_LOAD_SECONDS"]))
    if os.environ.get("TEST_SLOW_DATA_SECONDS"):
        _slow_data(float(os.environ["TEST_SLOW_DATA_SECONDS"]))
    route = os.path.join(os.path.dirname(__file__), "..", "..", "..", "cpu_route", "sitecustomize.py")
    spec = importlib.util.spec_from_file_location("cpu_route_sitecustomize", route)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


_install()
