"""The CPU route: run the GPU configs (DeepSpeed, FSDP, --sync-bn) as processes on a machine without a GPU.

    PYTHONPATH=cpu_route accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml \
        --mixed_precision no recipes/mnist.py

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
3. The first DeepSpeed run on a CPU builds DeepSpeed's CPU ops, silently, for about a minute or
   two: this says so before it starts.
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


# DeepSpeed compiles these on first use (torch's JIT extensions); seconds measured on a 2-core VM, idle.
DEEPSPEED_CPU_OPS = {"deepspeed_shm_comm": 40, "cpu_adam": 110}


def _optimizer_offload():
    """Where the launch puts DeepSpeed's optimizer: from the YAML's key, or from the DeepSpeed JSON it names."""
    device = os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE")
    config_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if device is None and config_file != "none":
        import json
        try:
            with open(config_file) as f:
                zero = json.load(f).get("zero_optimization", {})
        except (OSError, ValueError, AttributeError):
            return "none"  # accelerate itself reports an unreadable JSON
        device = (zero.get("offload_optimizer") or {}).get("device")
    return device or "none"


def deepspeed_ops_to_build(torch):
    """The DeepSpeed CPU ops this worker is about to compile: not yet in torch's extension cache."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return []
    ops = ["deepspeed_shm_comm"]  # built when DeepSpeed sets up its process group, inside Accelerator()
    if _optimizer_offload() == "cpu":
        ops.append("cpu_adam")  # built inside prepare() for the offloaded optimizer
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:  # torch.utils.cpp_extension's default, without importing it (it warns about CUDA)
        import sys
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        flavour = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(os.path.realpath(os.path.join(cache, "torch_extensions")), f"{python}_{flavour}")
    return [op for op in ops if not os.path.isfile(os.path.join(root, op, op + ".so"))]


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
    if "LOCAL_RANK" not in os.environ:  # not a worker started by accelerate launch / torchrun
        return
    import torch

    if torch.cuda.is_available():
        return
    building = deepspeed_ops_to_build(torch)
    if building and os.environ.get("RANK", "0") == "0":
        import sys
        seconds = sum(DEEPSPEED_CPU_OPS[op] for op in building)
        print(f"cpu_route: DeepSpeed compiles its CPU ops {', '.join(building)} on this first run: about {seconds} s "
              f"on an idle 2-core machine, and silent meanwhile; later runs reuse them.", file=sys.stderr, flush=True)
    if "true" in (os.environ.get("ACCELERATE_USE_DEEPSPEED", ""), os.environ.get("ACCELERATE_USE_FSDP", "")):
        _force_gpu_like_state()  # DDP configs need no help: ACCELERATE_USE_CPU=1 is accelerate's own route
        _idle_gloo_threads_after_end_training()
    _sync_batchnorm_on_cpu()


install()
