"""OneProcessOrDDP: one process, or DDP (accelerate's MULTI_GPU, MULTI_CPU and the like): every process holds the
whole model and optimizer, and accelerate saves them whole.

Owns what differs from the Engine defaults: its label ("" for one process, "ddp" otherwise), its checkpoint format
(accelerate's model.safetensors and optimizer.bin; the model file's keys read from the safetensors header; LoRA's
frozen weights left out by a save hook), what a world-size change needs (nothing: every rank loads it whole) and the
one float8 combination it refuses (compiled under DDP).
"""

import json
import os
import re

from .base import Engine, numbered, uncompiled_name


class OneProcessOrDDP(Engine):
    """1 process and DDP: accelerate's model.safetensors and optimizer.bin, the whole state."""

    family = "full"
    world_size_change = {"full": "every rank loads the whole model and optimizer state (1 process and DDP save it "
                                 "whole)"}

    def label_name(self):
        return "ddp" if self.in_process_group else ""

    def float8_problem(self, compiled):
        """float8 with torch.compile under DDP fails upstream (torchao issue 1308); one process compiles it."""
        if compiled and self.accelerator.num_processes > 1:
            return ("mixed precision fp8 with torch.compile under DDP fails upstream (torchao issue 1308): use "
                    "accelerate_configs/fsdp_fp8.yaml, or this config without its dynamo_config")
        return None

    @classmethod
    def engine_files(cls, layout, models, optimizers, files):
        needed = [re.escape(numbered("model", i, ".safetensors")) for i in range(models)]
        needed += [re.escape(numbered("optimizer", i, ".bin")) for i in range(optimizers)]
        return needed, []

    def model_keys(self, held):
        """The safetensors header, read through the held descriptor (bounded: at most the file and 100 MB)."""
        rel = "model.safetensors"
        fd, size = held.held[rel].fileno(), held.files[rel]["size"]
        length = int.from_bytes(os.pread(fd, 8, 0), "little") if size >= 8 else -1
        if not 0 <= length <= min(size - 8, 100 << 20):
            return rel, ["<a header this code does not write>"]
        try:
            header = json.loads(os.pread(fd, length, 8))
        except (ValueError, RecursionError):
            return rel, ["<a header this code does not write>"]
        return rel, [k for k in header if k != "__metadata__"] if isinstance(header, dict) else ["<no table>"]

    def frozen_kwargs(self, frozen):
        def trainable_only(models, weights, output_dir):  # accelerate calls it with each model's state dict
            for state in weights:  # named as in the model, or behind DDP's module. and compile's _orig_mod.
                for key in [k for k in state if uncompiled_name(k.removeprefix("module.")) in frozen]:
                    del state[key]
        self.accelerator.register_save_state_pre_hook(trainable_only)
        return {}, {"strict": False}, frozen
