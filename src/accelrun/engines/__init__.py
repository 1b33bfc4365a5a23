"""One engine object per way of running: what accelerate set up, asked once (Engine.of(accelerator)), and everything
that depends on it. No other module of accelrun branches on accelerate's distributed type or an engine's name
(tests/test_engines.py holds that): they ask the engine.

    base.py   Engine: what every way of running shares (facts, label, sequence parallelism, the layout a checkpoint
              records, the export) and the defaults each engine overrides; Engine.of
    ddp.py    OneProcessOrDDP: one process, or DDP (accelerate's MULTI_GPU, MULTI_CPU...): the whole state everywhere
    zero.py   DeepSpeed: ZeRO stages 0-3 with or without optimizer offload, and Ulysses sequence parallelism
    fsdp2.py  FSDP2: accelerate's fully_shard, sharded or full state dict

docs/writing-a-recipe.md, "Adding a way of running", says what a new one takes.
"""

from .base import Engine, exported_weights, run_label, uncompiled_name
from .ddp import OneProcessOrDDP
from .fsdp2 import FSDP2
from .zero import DeepSpeed, name_the_cpu_for_deepspeed, precision_source, quiet_deprecated_collectives

# The engines, in the order the launch checks ask them which one a config wants (refusals.py).
Engine.kinds = (OneProcessOrDDP, DeepSpeed, FSDP2)

__all__ = ["DeepSpeed", "Engine", "FSDP2", "OneProcessOrDDP", "exported_weights", "name_the_cpu_for_deepspeed",
           "precision_source", "quiet_deprecated_collectives", "run_label", "uncompiled_name"]
