"""The GPU pack's hook in every process a test of tests/test_gpu.py launches (the tests put this folder on
PYTHONPATH; unlike tests/helpers/cpu_shim it does not load the CPU route). Off unless its variable is set:

* TEST_SYNC_DEBUG_STEPS=A:B: after the optimizer step A, torch.cuda.set_sync_debug_mode("error") makes every
  operation that makes the host wait for the GPU raise (a blocking copy, .item(), a device-to-host read...);
  after the optimizer step B it is switched back off, before the next progress line reads the loss. Steps A..B
  are steady steps: no recipe, run service or engine may synchronise there. The recipe runs unchanged.
"""

import os


def _sync_debug(first, last):
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    state = {"step": 0}

    def stepped(optimizer, args, kwargs):
        state["step"] += 1
        if state["step"] == first:
            torch.cuda.set_sync_debug_mode("error")
            print(f"TEST-SHIM: synchronising CUDA operations raise from step {first}", flush=True)
        elif state["step"] == last:
            torch.cuda.set_sync_debug_mode("default")
            print(f"TEST-SHIM: synchronising CUDA operations allowed again after step {last}", flush=True)
    register_optimizer_step_post_hook(stepped)


def _install():
    # Every process with this PYTHONPATH (the launcher, the recipe, compile workers): only a process whose
    # optimizer steps has the mode switched (1gpu.yaml's recipe process has no LOCAL_RANK to tell it by).
    if os.environ.get("TEST_SYNC_DEBUG_STEPS"):
        first, last = (int(step) for step in os.environ["TEST_SYNC_DEBUG_STEPS"].split(":"))
        _sync_debug(first, last)


_install()
