"""LoRA through PEFT: the adapters put on a frozen model, and folded back into its weights for export.

Owns finetune_lm.py's LoRA: its flags (add_lora_args), the model wrapped by PEFT on the --lora-targets linear
layers (with_lora, raising LoraProblem with one message for targets the model does not have or that are not
linear layers), and the base model's weights with the adapters merged in (merge_adapters), computed from the
exported state dict, which holds every rank's shards gathered. It makes no distributed call.
"""

import torch


class LoraProblem(ValueError):
    """--lora-targets the model cannot take: one message that names its linear layers."""


def add_lora_args(parser):
    """The flags with_lora() and the export read: the rank, the scaling, the dropout, the targets, the merge."""
    parser.add_argument("--lora-r", type=int, default=0,
                        help="LoRA rank: train low-rank adapters on a frozen base model (0: a full fine-tune)")
    parser.add_argument("--lora-alpha", type=float, default=16.0,
                        help="LoRA: the adapters' output is scaled by alpha/r")
    parser.add_argument("--lora-dropout", type=float, default=0.05, help="LoRA: dropout on the adapters' input")
    parser.add_argument("--lora-targets", default="all-linear",
                        help="LoRA: comma-separated names of the linear layers to adapt (all-linear: every linear "
                             "layer of the decoder blocks)")
    parser.add_argument("--merge-lora", action="store_true",
                        help="LoRA: also export the base model with the adapters merged in, to OUTPUT_DIR/model")


def with_lora(model, args):
    """The model wrapped by PEFT: every base parameter frozen in the dtype it was loaded in, LoRA adapters on
    the --lora-targets linear layers, trainable and kept in fp32 by PEFT (autocast_adapter_dtype). Raises
    LoraProblem."""
    from peft import LoraConfig, get_peft_model
    targets = args.lora_targets if args.lora_targets == "all-linear" else args.lora_targets.split(",")
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=targets, task_type="CAUSAL_LM")
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, torch.nn.Linear)} - {"lm_head"})
    try:
        model = get_peft_model(model, config)
    except ValueError as exc:
        raise LoraProblem(f"--lora-targets {args.lora_targets!r}: {str(exc).splitlines()[0]}. This model's linear "
                          f"layers are {','.join(linear)}") from None
    adapted = [name for name, module in model.named_modules() if hasattr(module, "lora_A")]
    if other := [name for name in adapted if not isinstance(model.get_submodule(name).base_layer, torch.nn.Linear)]:
        raise LoraProblem(f"--lora-targets adapts {other[0]}, which is not a linear layer; name linear layers only, "
                          f"from {','.join(linear)}")
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
