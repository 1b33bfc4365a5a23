"""LoRA through PEFT: the adapters put on a frozen model, and folded back into its weights for export.

Owns finetune_lm.py's LoRA: its flags (add_lora_args) and the refusal of LoRA flags given without --lora-r
(flags_without_rank), the model wrapped by PEFT on the --lora-targets linear layers (with_lora, raising
LoraProblem with one message for targets the model does not have or that are not linear layers), how the
adapters compute (in the compute dtype: see with_lora), and the base model's weights with the adapters merged
in (merge_adapters), computed from the exported state dict, which holds every rank's shards gathered. It makes
no distributed call.
"""

import warnings


class LoraProblem(ValueError):
    """--lora-targets the model cannot take: one message that names its linear layers."""


LORA_FLAGS = ("--lora-alpha", "--lora-dropout", "--lora-targets", "--merge-lora")  # they act only with --lora-r


def add_lora_args(parser):
    """The flags with_lora() and the export read: the rank, the scaling, the dropout, the targets, the merge."""
    parser.add_argument("--lora-r", type=int, default=0,
                        help="LoRA rank: train low-rank adapters on a frozen base model (0: a full fine-tune)")
    parser.add_argument("--lora-alpha", type=float, default=16.0,
                        help="LoRA: the adapters' output is scaled by alpha/r")
    # 0, as torchtune's default: dropout copies the input of every adapted layer.
    parser.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA: dropout on the adapters' input")
    parser.add_argument("--lora-targets", default="all-linear",
                        help="LoRA: comma-separated names of the linear layers to adapt (all-linear: every linear "
                             "layer of the decoder blocks)")
    parser.add_argument("--merge-lora", action="store_true",
                        help="LoRA: also export the base model with the adapters merged in, to OUTPUT_DIR/model")


def flags_without_rank(args, argv):
    """The refusal of LoRA flags given (in argv) to a full fine-tune (no --lora-r), or None: they would be ignored,
    and the results would be a full fine-tune's where a LoRA run's were meant."""
    given = [flag for flag in LORA_FLAGS if any(a == flag or a.startswith(flag + "=") for a in argv)]
    if args.lora_r or not given:
        return None
    return (f"{' and '.join(given)} {'acts' if len(given) == 1 else 'act'} on LoRA adapters, and without --lora-r "
            f"this run is a full fine-tune that trains none: add --lora-r (16, say), or drop {' and '.join(given)}")


def with_lora(model, args, adapter_dtype=None):
    """The model wrapped by PEFT: every base parameter frozen in the dtype it was loaded in, LoRA adapters on
    the --lora-targets linear layers, trainable. They compute in the compute dtype, and their master weights and
    optimizer state stay fp32: PEFT keeps them in fp32 (autocast_adapter_dtype) and would cast each adapted
    layer's input to fp32 and back (a copy of every input, and of its gradient) where autocast (one process, DDP,
    FSDP2's mixed precision) computes them in bf16 anyway, to the same results; so the input stays as it comes.
    Where no autocast runs (DeepSpeed in bf16 or fp16) adapter_dtype is that dtype: the adapters are cast to it,
    and DeepSpeed keeps their fp32 master copy (ZeRO-1/2 cast them anyway; ZeRO-3 with zero.Init does not).
    Raises LoraProblem."""
    import torch  # here, as PEFT: finetune_lm's --help reads this module's flags without importing torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    targets = args.lora_targets if args.lora_targets == "all-linear" else args.lora_targets.split(",")
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=targets, task_type="CAUSAL_LM")
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, torch.nn.Linear)} - {"lm_head"})
    try:
        with warnings.catch_warnings():
            # PEFT 0.21 asks the model for transformers 5's deprecated is_gradient_checkpointing: every rank printed
            # that FutureWarning before the run's first line (or its error line). Nothing a user can change.
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            model = get_peft_model(model, config)
    except ValueError as exc:
        raise LoraProblem(f"--lora-targets {args.lora_targets!r}: {str(exc).splitlines()[0]}. This model's linear "
                          f"layers are {','.join(linear)}") from None
    adapted = [name for name, module in model.named_modules() if hasattr(module, "lora_A")]
    if other := [name for name in adapted if not isinstance(model.get_submodule(name).base_layer, torch.nn.Linear)]:
        raise LoraProblem(f"--lora-targets adapts {other[0]}, which is not a linear layer; name linear layers only, "
                          f"from {','.join(linear)}")
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False
    if adapter_dtype is not None:
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.data = parameter.data.to(adapter_dtype)
    return model


def merge_adapters(weights, peft_model):
    """The base model's weights with each adapter folded in, W + alpha/r * B @ A, under the base's own names."""
    scaling = {name: module.scaling["default"] for name, module in peft_model.named_modules()
               if hasattr(module, "lora_A")}
    base = {}
    for key, value in weights.items():
        if ".lora_" in key:
            continue
        module = key.removesuffix(".base_layer.weight")
        if module in scaling:
            a, b = weights[f"{module}.lora_A.default.weight"], weights[f"{module}.lora_B.default.weight"]
            value = value + scaling[module] * (b @ a)
        base[key.removeprefix("base_model.model.").replace(".base_layer.", ".")] = value
    return base
