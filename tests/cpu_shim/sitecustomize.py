"""Test-only shim: run GPU-only features on a machine without GPUs.

Put this folder on PYTHONPATH of an `accelerate launch` (Python imports
`sitecustomize` at start-up in every process it starts). It does nothing when a
GPU is present, so a GPU user never needs it. It patches two things, and
nothing else:

1. DeepSpeed and FSDP configs (accelerate 1.15, torch 2.14, no GPU).
   ACCELERATE_USE_CPU=1 gives DDP over gloo but silently turns DeepSpeed and
   FSDP off. Without it, accelerate finds no GPU, picks no backend and declares
   every rank alone (distributed type NO), under DeepSpeed too; FSDP is only
   enabled on top of a MULTI_GPU state. So in each launched worker the shim
   makes accelerate choose what it chooses on a GPU node (a MULTI_GPU state,
   which DeepSpeed/FSDP then take over) with the gloo backend and the CPU as
   the device.

2. torch.nn.SyncBatchNorm. Its kernels (batch_norm_stats & co.) exist for CUDA
   only, its forward refuses CPU tensors and DistributedDataParallel refuses a
   CPU module that holds one. The shim gives it a CPU path that computes the
   same global batch statistics with an autograd-aware all-reduce, and lifts
   DDP's check, so `--sync-bn` can be tested for real on CPU processes.

3. Only when TEST_SLOW_SAVE_SECONDS is set (one test): a slow file system.
   Accelerator.save_state into a directory whose name contains TEST_SLOW_SAVE_MATCH
   prints "TEST-SHIM: slow save" after writing its files and then sleeps, so a
   test can kill the run while that checkpoint is half-made.

4. Only when TEST_STEP_SECONDS is set (the Slurm time-limit test): every optimizer
   step of a worker takes at least that long, so a run's length is set by its step
   count, not by how fast the machine happens to be.
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
    if "LOCAL_RANK" not in os.environ:  # not a worker started by accelerate launch / torchrun
        return
    import torch

    if torch.cuda.is_available():
        return
    if "true" in (os.environ.get("ACCELERATE_USE_DEEPSPEED", ""), os.environ.get("ACCELERATE_USE_FSDP", "")):
        _force_gpu_like_state()  # DDP configs need no help: ACCELERATE_USE_CPU=1 is accelerate's own route
    _sync_batchnorm_on_cpu()


_install()
