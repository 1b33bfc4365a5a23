"""Test-only shim: run the DeepSpeed and FSDP configs on a machine without GPUs.

Put this folder on PYTHONPATH of an `accelerate launch` (Python imports
`sitecustomize` at start-up in every process it starts). A GPU user never needs it.

Why it exists (accelerate 1.15, torch 2.14, no GPU):
  * ACCELERATE_USE_CPU=1 gives DDP over gloo, but silently turns DeepSpeed and FSDP off.
  * Without it, accelerate finds no GPU, picks no backend and declares every rank
    alone (distributed type NO), under DeepSpeed too; FSDP is only enabled on top
    of a MULTI_GPU state.
So in each launched worker the shim makes accelerate choose what it would choose on
a GPU node (a MULTI_GPU state, which DeepSpeed/FSDP then take over), with the gloo
backend instead of NCCL and the CPU as the device. Nothing else is changed.
"""

import os


def _install():
    if "LOCAL_RANK" not in os.environ:  # not a worker started by accelerate launch / torchrun
        return
    if "true" not in (os.environ.get("ACCELERATE_USE_DEEPSPEED", ""), os.environ.get("ACCELERATE_USE_FSDP", "")):
        return  # DDP configs need no shim: ACCELERATE_USE_CPU=1 is accelerate's own CPU route
    import torch

    if torch.cuda.is_available():
        return
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        return "gloo", DistributedType.MULTI_GPU

    PartialState._prepare_backend = prepare_backend


_install()
