"""float8 training: torchao's Float8Linear, through accelerate's `mixed_precision: fp8` with the AO backend
(accelerate_configs/fsdp_fp8.yaml): which linear layers compute in float8, the hardware it runs on, what it refuses.

Owns:
  * whether a run computes in float8 (asked: the accelerator's; launched: the launch's environment, before
    Accelerator());
  * the weights behind torchao's float8 wrapper, for the export (plain);
  * the choice of layers (Float8Layers, accelerate's module filter, bound to the model prepare() converts): every
    nn.Linear except the model's first and last (float8 there hurts convergence) and those too small to gain (below);
    the count, for the first line and the summary (facts);
  * the backend: torchao's (AO), refused otherwise before Accelerator();
  * the hardware: a visible GPU without float8 matmuls (compute capability below 8.9, before Hopper and Ada) refused
    before Accelerator(), which would switch the run to fp16 with only a log warning; on the CPU torch runs the
    float8 matmuls too, slowly, so a CPU run goes ahead as a check of the wiring, and its first line says so;
  * the flags it refuses: LoRA and 4-bit bases (flags_problem; no source reports a gain for LoRA, whose adapters are
    too small for float8, and a 4-bit layer is no plain nn.Linear to convert).
The engines say what their way of running refuses (Engine.float8_problem: compile under DDP, DeepSpeed) and how it
builds the model (FSDP2: on every process, engines/fsdp2.py).
"""

import functools
import os
import sys

import torch

# torchao's H100 measurements for tensorwise scaling: a linear layer of input width K and output width N runs slower
# in float8 than in bf16 when K <= 4096 and N <= 1024 (the casts cost more than the faster matmul saves).
SMALL_INPUT, SMALL_OUTPUT = 4096, 1024
MULTIPLE = 16  # the float8 matmul's widths are multiples of 16 (torch._scaled_mm)
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9) and Hopper (9.0) on
BACKEND = "AO"  # torchao, which requirements.txt installs and the tests run
BACKEND_FIX = f"write backend: {BACKEND} (fsdp_fp8.yaml)"  # the fix the launch check and check_config name
ODD = f"not a multiple of {MULTIPLE}"  # Float8Layers' reason for widths float8 matmuls cannot take


def launched(environ=os.environ):
    """Whether the launch asks for float8 (accelerate launch sets ACCELERATE_MIXED_PRECISION from the config)."""
    return environ.get("ACCELERATE_MIXED_PRECISION", "").lower() == "fp8"


def asked(accelerator):
    """Whether this accelerator computes in float8."""
    return getattr(accelerator, "mixed_precision", None) == "fp8"


def backend_problem(backend):
    """None, or why accelerate's float8 backend `backend` (fp8_config's backend; NO: accelerate picks the installed
    one, torchao) is not one accelrun runs."""
    from accelerate.utils.dataclasses import FP8BackendType
    if str(backend).upper() in (BACKEND, FP8BackendType.NO.value, ""):
        return None
    return "accelrun runs torchao's float8 (AO); Transformer Engine and MS-AMP are neither installed nor tested here"


def launch_problem(environ=os.environ):
    """Before Accelerator(): None, or why this launch cannot compute in float8 (one line naming what can): a backend
    accelrun does not run (accelerate's Accelerator() would end in an ImportError's traceback), or a visible GPU
    without float8 (Accelerator() would switch to fp16 with only a log warning, even for a CPU run). A machine
    without a GPU runs the float8 path as a wiring check (facts says so)."""
    if not launched(environ):
        return None
    backend = environ.get("ACCELERATE_FP8_BACKEND", "")
    if problem := backend_problem(backend):
        return f"mixed precision fp8 with fp8_config backend {backend}: {problem}: {BACKEND_FIX}"
    if not torch.cuda.is_available():  # a CPU run, even with --cpu, is decided by the GPU accelerate sees
        return None
    capability = torch.cuda.get_device_capability()
    if capability >= MIN_CAPABILITY:
        return None
    name = torch.cuda.get_device_name()
    return (f"mixed precision fp8 needs float8 matmuls (an H100, H200 or L40S: compute capability 8.9 or more); "
            f"this {name} has {capability[0]}.{capability[1]}, and accelerate would run fp16 instead without a word: "
            f"use fsdp.yaml (bf16), which fsdp_fp8.yaml is with float8 added (for a wiring check on the CPU, hide the "
            f"GPU: CUDA_VISIBLE_DEVICES=)")


def flags_problem(accelerator, lora_r=0, load_in_4bit=False):
    """None, or why float8 does not go with these flags (one line)."""
    if not asked(accelerator):
        return None
    if load_in_4bit:
        return ("mixed precision fp8 is for full fine-tunes: a 4-bit base's layers are not plain linear layers to run "
                "in float8; drop --load-in-4bit, or use fsdp.yaml for QLoRA")
    if lora_r:
        return ("mixed precision fp8 is for full fine-tunes: with --lora-r the frozen base computes in bf16 either way "
                "and the adapters are too small to gain; use fsdp.yaml (or 2gpu.yaml) for LoRA")
    return None


class Float8Layers:
    """accelerate's module filter for torchao's conversion (AORecipeKwargs.module_filter_func): float8 for every
    nn.Linear of the bound models but their first and last, those too small to gain (SMALL_INPUT, SMALL_OUTPUT) and
    those whose widths are not multiples of MULTIPLE. Records what it decided, by reason."""

    def __init__(self):
        self.ends, self.kept = set(), {"first and last": 0, "too small": 0, ODD: 0}

    def bind(self, model):
        """The model prepare() converts next: its first and last linear layers stay in bf16."""
        names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
        self.ends |= {names[0], names[-1]} if names else set()

    def __call__(self, module, fqn):
        if not isinstance(module, torch.nn.Linear):
            return False
        out_features, in_features = module.weight.shape
        reason = ("first and last" if fqn in self.ends else
                  ODD if in_features % MULTIPLE or out_features % MULTIPLE else
                  "too small" if in_features <= SMALL_INPUT and out_features <= SMALL_OUTPUT else None)
        if reason:
            self.kept[reason] += 1
        return reason is None


def install(accelerator):
    """Before prepare() (accelerate chose torchao: accelerator.ao_recipe_handler exists): accelerate converts each
    model prepare() is given with Float8Layers, bound to that model (accelerate's own filter keeps only the first and
    last in bf16, and would convert the small layers)."""
    layers = Float8Layers()
    accelerator.ao_recipe_handler.module_filter_func = layers
    prepare = accelerator.prepare

    @functools.wraps(prepare)
    def binding(*args, **kwargs):
        for arg in args:
            if isinstance(arg, torch.nn.Module):
                layers.bind(arg)
        return prepare(*args, **kwargs)

    accelerator.prepare = binding
    return layers


def plain(tensor):
    """The tensor behind torchao's float8 weight wrapper (FSDP2's float8 all-gather wraps each converted weight, and on
    one process the full state dict hands the wrapper out, which safetensors cannot write); any other as it is."""
    wrapper = getattr(sys.modules.get("torchao.float8.fsdp_utils"), "WeightWithDynamicFloat8CastTensor", None)
    return tensor._tensor if wrapper is not None and isinstance(tensor, wrapper) else tensor


def facts(model, layers, device_type):
    """After prepare(): {float8_linears, linears, float8_kept: {reason: count}, float8_note}, for the summary and the
    first line."""
    from torchao.float8.float8_linear import Float8Linear
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    converted = sum(isinstance(m, Float8Linear) for m in linears)
    note = "" if device_type == "cuda" else f"on the {device_type}: a wiring check of the float8 path, not its speed"
    return {"float8_linears": converted, "linears": len(linears),
            "float8_kept": {k: v for k, v in layers.kept.items() if v}, "float8_note": note}


def describe(facts_):
    """The first line's words for the float8 facts: '4 of 15 linear layers in float8 (bf16: 2 first and last, 9 too
    small)'; "" without float8."""
    if "float8_linears" not in facts_:
        return ""
    kept = ", ".join(f"{n} {why}" for why, n in facts_["float8_kept"].items())
    note = f"; {facts_['float8_note']}" if facts_["float8_note"] else ""
    return (f" ({facts_['float8_linears']} of {facts_['linears']} linear layers in float8"
            f"{f'; bf16: {kept}' if kept else ''}{note})")
