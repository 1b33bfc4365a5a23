"""The CPU route: run the GPU configs (DeepSpeed, FSDP, --sync-bn) as processes on a machine without a GPU.

    PYTHONPATH=cpu_route accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml \
        --deepspeed_config_file accelerate_configs/deepspeed_zero2_fp32.json recipes/mnist.py

Python imports `sitecustomize` at start-up in every process, so this file acts in each worker
that `accelerate launch` starts. On a machine with a GPU it does nothing. DDP configs need no
help (ACCELERATE_USE_CPU=1 is accelerate's own switch); this route is for the rest:

1. DeepSpeed and FSDP configs (accelerate 1.15, torch 2.14). ACCELERATE_USE_CPU=1 silently turns
   both off. Without it, accelerate finds no GPU, picks no backend and declares every rank alone,
   under DeepSpeed too; FSDP is only enabled on top of a MULTI_GPU state. So in each worker this
   makes accelerate choose what it chooses on a GPU node (a MULTI_GPU state, which DeepSpeed or
   FSDP then take over) with the gloo backend and the CPU as the device.
2. torch.nn.SyncBatchNorm (--sync-bn). Its kernels exist for CUDA only, its forward refuses CPU
   tensors and DistributedDataParallel refuses a CPU module holding one. This gives it a CPU path
   that computes the same global batch statistics with an autograd-aware all-reduce.
3. DeepSpeed compiles its CPU ops (torch's JIT extensions) on first use, silently: 40 s to 2 minutes on an idle
   2-core machine, several minutes on a busy one. This says so when a compilation really starts (ninja has work to
   do), with the time to expect, and how long it took.
   Each Python environment gets its own extensions directory (TORCH_EXTENSIONS_DIR, unless you set
   it): torch's default, ~/.cache/torch_extensions/py311_cpu, is shared by every environment of one
   Python version, and an environment whose torch or DeepSpeed differs rebuilds the ops of the other
   one at every switch. DeepSpeed's own start-up lines on a CPU are quieted: "Setting accelerator to
   CPU" (the CPU is named for it, DS_ACCELERATOR=cpu, on a machine without NVIDIA devices), torch's
   "No CUDA runtime is found" and DeepSpeed's "... built successfully", printed by every process.
4. accelerator.end_training() at the end of a script. Under DeepSpeed and FSDP the gloo process group
   outlives destroy_process_group (DeepSpeed's groups and FSDP's mesh still hold it), and so do gloo's
   worker threads. One that is still letting go of a finished collective when Python starts to finalize
   aborts the process ("terminate called without an active exception": docs/troubleshooting.md). Here
   end_training() also waits until those threads are idle, which takes milliseconds.

It exists for learning and testing on a laptop or CI; it is not a way to train fast.
"""

import os


def _force_gpu_like_state():
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")

    cpu_backend = PartialState._prepare_backend

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        if cpu:  # ACCELERATE_USE_CPU=1 was asked for: accelerate's own MULTI_CPU route
            return cpu_backend(self, cpu, sagemaker_dp, backend)
        return "gloo", DistributedType.MULTI_GPU

    prepare_backend.cpu_route = True  # what accelrun's refusals look for: this worker is on the route
    PartialState._prepare_backend = prepare_backend


def _sync_batchnorm_on_cpu():
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_fn

    gpu_forward = torch.nn.SyncBatchNorm.forward

    def forward(self, x):
        if not (self.training and x.device.type == "cpu" and dist.is_initialized() and dist.get_world_size() > 1):
            return gpu_forward(self, x)
        channels = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        count = torch.tensor([x.numel() / channels], dtype=x.dtype)
        totals = dist_fn.all_reduce(torch.cat([x.sum(dims), (x * x).sum(dims), count]))
        n = totals[-1]
        mean = totals[:channels] / n
        var = totals[channels:2 * channels] / n - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - momentum).add_(momentum * mean)
                self.running_var.mul_(1 - momentum).add_(momentum * var * n / (n - 1))
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y

    torch.nn.SyncBatchNorm.forward = forward
    torch.nn.parallel.DistributedDataParallel._passing_sync_batchnorm_handle = lambda self, module: None


# DeepSpeed compiles these on first use (torch's JIT extensions); seconds measured on a 2-core VM, idle (44 s for the
# first on 2026-11-26). On a busy one the same build took 266 s and 376 s: several minutes.
DEEPSPEED_CPU_OPS = {"deepspeed_shm_comm": 40, "cpu_adam": 110}


def extensions_dir(torch_version_cuda=None):
    """torch's JIT extensions directory for this Python environment: TORCH_EXTENSIONS_DIR when set, else one of its
    own beside torch's default (~/.cache/torch_extensions/py311_cpu-ENV-HASH, HASH from the environment's path)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    import hashlib
    import sys

    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    flavour = f"cu{torch_version_cuda.replace('.', '')}" if torch_version_cuda else "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    prefix = os.path.realpath(sys.prefix)
    tag = f"{os.path.basename(prefix)}-{hashlib.sha256(prefix.encode()).hexdigest()[:8]}"
    return os.path.join(cache, "torch_extensions", f"{python}_{flavour}-{tag}")


def ninja_has_work(build_directory):
    """Whether ninja would compile anything in build_directory (a dry run, milliseconds); True when it cannot say."""
    import subprocess

    try:
        out = subprocess.run(["ninja", "-n", "-C", build_directory], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return True
    return out.returncode != 0 or "no work to do" not in out.stdout


def _announce_builds(cpp_extension):
    """Say when torch really compiles an extension (ninja has work), in the process that compiles it, and how long
    it took: the other processes wait for its lock meanwhile, silent."""
    import sys
    import time

    run_ninja_build = cpp_extension._run_ninja_build

    def announced(build_directory, verbose, error_prefix):
        pending = ninja_has_work(build_directory)
        name = os.path.basename(os.path.normpath(build_directory))
        if pending:
            expected = DEEPSPEED_CPU_OPS.get(name.split("_v")[0], 60)
            print(f"cpu_route: compiling DeepSpeed's CPU op {name} into {build_directory}, once for this "
                  f"environment: about {expected} s on an idle 2-core machine, several minutes on a busy one; silent "
                  f"meanwhile", file=sys.stderr, flush=True)
        started = time.monotonic()
        run_ninja_build(build_directory, verbose, error_prefix)
        if pending:
            print(f"cpu_route: compiled {name} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)

    cpp_extension._run_ninja_build = announced


class _QuietCudaHome:
    """A logging filter: torch's "No CUDA runtime is found, using CUDA_HOME=..." is expected on the CPU route."""

    @staticmethod
    def filter(record):
        return not record.getMessage().startswith("No CUDA runtime is found")


def _quiet_deepspeed_op_loads():
    """DeepSpeed prints "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" from every process at
    every start, built or not (deepspeed/comm/torch.py's build_shm_op): run that function without its print."""
    import contextlib
    import importlib.abc
    import importlib.util
    import io
    import sys

    def quiet(build):
        def quiet_build():
            with contextlib.redirect_stdout(io.StringIO()):
                return build()
        return quiet_build

    class AfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != "deepspeed.comm.torch":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_then_quiet(module):
                exec_module(module)
                if callable(getattr(module, "build_shm_op", None)):
                    module.build_shm_op = quiet(module.build_shm_op)
            spec.loader.exec_module = exec_then_quiet
            return spec

    sys.meta_path.insert(0, AfterImport())


def _deepspeed_on_cpu(torch):
    """A DeepSpeed worker: its own extensions directory, builds announced, the start-up lines quieted."""
    import logging

    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir(torch.version.cuda)
    logging.getLogger("torch.utils.cpp_extension").addFilter(_QuietCudaHome)
    from torch.utils import cpp_extension

    if hasattr(cpp_extension, "_run_ninja_build"):  # torch's private builder: announce what it really builds
        _announce_builds(cpp_extension)
    _quiet_deepspeed_op_loads()


def _name_the_cpu_for_deepspeed():
    """Without NVIDIA devices, tell DeepSpeed that it runs on the CPU (DS_ACCELERATOR=cpu) instead of letting it find
    out and warn "Setting accelerator to CPU. If you have GPU ..." in the launcher and every worker."""
    import glob

    if "DS_ACCELERATOR" not in os.environ and not glob.glob("/dev/nvidia[0-9]*"):
        os.environ["DS_ACCELERATOR"] = "cpu"


def _idle_gloo_threads_after_end_training():
    from accelerate import Accelerator

    end_training = Accelerator.end_training

    def end_training_then_wait(self):
        end_training(self)
        wait_for_idle_gloo_threads()

    Accelerator.end_training = end_training_then_wait


def wait_for_idle_gloo_threads(polls=3, interval=0.002, deadline=2.0):
    """True once every gloo worker thread (pt_gloo_runloop) of this process has been asleep, without a single
    context switch, for `polls` intervals in a row (at once when there is none); False when `deadline` seconds
    pass first, or where Linux's /proc cannot tell. The intervals are sleeps, which hand the GIL to a thread
    waiting for it, so a thread still letting go of a collective's tensors runs, and is seen running, until
    it is done."""
    import time

    def snapshot():
        seen = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() != "pt_gloo_runloop":
                        continue
                with open(f"/proc/self/task/{tid}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
            except OSError:
                continue  # a thread that just ended
            seen[tid] = tuple(fields[k].strip() for k in ("State", "voluntary_ctxt_switches",
                                                         "nonvoluntary_ctxt_switches"))
        return seen

    if not os.path.isdir("/proc/self/task"):
        return False
    before, quiet, end = snapshot(), 0, time.monotonic() + deadline
    while before and quiet < polls:
        if time.monotonic() > end:
            return False
        time.sleep(interval)
        now = snapshot()
        asleep = all(state.startswith("S") for state, _, _ in now.values())
        quiet = quiet + 1 if asleep and now == before else 0
        before = now
    return True


def install():
    _name_the_cpu_for_deepspeed()  # the launcher too: accelerate launch imports DeepSpeed for DeepSpeed configs
    if "LOCAL_RANK" not in os.environ:  # not a worker started by accelerate launch / torchrun
        return
    import torch

    if torch.cuda.is_available():
        return
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        _deepspeed_on_cpu(torch)
    if "true" in (os.environ.get("ACCELERATE_USE_DEEPSPEED", ""), os.environ.get("ACCELERATE_USE_FSDP", "")):
        _force_gpu_like_state()  # DDP configs need no help: ACCELERATE_USE_CPU=1 is accelerate's own route
        _idle_gloo_threads_after_end_training()
    _sync_batchnorm_on_cpu()


install()
