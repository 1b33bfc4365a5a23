"""QLoRA: LoRA adapters on a base frozen in 4 bits (NF4 through bitsandbytes).

Owns finetune_lm.py's --load-in-4bit, under every engine but its sharding rule (one process, DDP, ZeRO-1/2: the 4-bit
base whole on every process; FSDP2 and ZeRO-3, with or without sequence parallelism: sharded):
  * the flag and its refusal without --lora-r (add_qlora_args, without_lora: the standard library only, so that
    --help answers before torch is imported);
  * the quantisation (quantization_config): NF4 with double quantisation (the QLoRA paper's; bench/lm_memory.py's
    NF4_BYTES), the embedding, the output layer and the norms left in the compute dtype, and the packed 4-bit
    weights stored in the compute dtype too. FSDP2 shards only floating-point tensors (bitsandbytes' default
    storage, uint8, stays whole on every rank, where accelerate only warns), and FSDP2 casts every parameter to
    its param_dtype as it gathers it, DeepSpeed casts the model to its dtype: either cast must find the packed
    bits already in that dtype, or it would change them;
  * the 4-bit layers set for training (for_training): bitsandbytes' CPU inference repacking kept off (on a CPU with
    AVX512-BF16 its Linear4bit rewrites its weight in place at the first forward in eval mode, an evaluation, into a
    layout whose matmul has no gradient for its input, its scales rounded to bf16); and their state dicts limited to
    the weight and bias, as any frozen layer's (bitsandbytes adds the quantisation state, absmax and the rest, which
    the frozen-weights rule of the checkpoints would then keep: LoRA's checkpoints hold the adapters only). Nothing
    here reads a 4-bit state dict: the base comes from --model;
  * after prepare(), what each process holds of the 4-bit base, for the first line (checked_base), and under FSDP2
    the run refused in one line when a 4-bit weight is not a shard (accelerate leaves a layer whole on every rank
    when it is in fsdp_ignored_modules, or stored as integers);
  * for the merged export, the base dequantised into the compute dtype (dequantized_base, collective under FSDP2
    and ZeRO-3: each weight gathered whole, in turn), and the plain model that writes it (as_plain_model:
    save_pretrained of a quantised model writes its own 4-bit state, whatever state dict it is given).
"""

FLAG = "--load-in-4bit"
# Bytes per weight of an NF4 layer with double quantisation: 4 bits, an 8-bit scale per block of 64 weights, an fp32
# scale per 256 of those: the one definition, which bench/lm_memory.py's planner uses too.
NF4_BYTES = (4 + 8 / 64 + 32 / (64 * 256)) / 8


def add_qlora_args(parser):
    parser.add_argument(FLAG, action="store_true",
                        help="QLoRA: the frozen base model in 4 bits (NF4 with double quantisation, bitsandbytes), "
                             "LoRA adapters trained on it (needs --lora-r)")


def without_lora(args):
    """The refusal of --load-in-4bit without --lora-r, or None: a 4-bit base trains only through adapters."""
    if args.load_in_4bit and not args.lora_r:
        return (f"{FLAG} freezes the base model in 4 bits, which only LoRA adapters can train on (QLoRA): add "
                f"--lora-r (16, say), or drop {FLAG}")
    return None


def quantization_config(dtype):
    """transformers' BitsAndBytesConfig: NF4, double quantisation, computing in `dtype` and stored in it."""
    from transformers import BitsAndBytesConfig
    quiet_cpu_kernel_notice()
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)


def quiet_cpu_kernel_notice():
    """Import bitsandbytes with its CPU backend's notice silenced: on a CPU with AVX512-BF16 and without the optional
    `kernels` package every process said that it falls back to its own kernel, which it then does."""
    import logging
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401
    finally:
        logger.setLevel(level)


def four_bit_layers(model):
    """[(name, module)] of the model's 4-bit linear layers (bitsandbytes' Linear4bit), in the model's order."""
    from bitsandbytes.nn import Linear4bit
    return [(name, module) for name, module in model.named_modules() if isinstance(module, Linear4bit)]


def for_training(model):
    """Set the 4-bit layers for training (see the module's docstring); returns how many there are."""
    import types

    import torch
    layers = four_bit_layers(model)
    for _, module in layers:
        module.support_avx512bf16_for_cpu = False  # the GPU never repacks
        module._save_to_state_dict = types.MethodType(torch.nn.Module._save_to_state_dict, module)
    return len(layers)


def held(weight):
    """(elements this process holds, elements of the whole) of a weight: a DTensor's local shard (FSDP2), a ZeRO-3
    partition (unless DeepSpeed keeps it whole: below stage3_param_persistence_threshold), or all of it."""
    if hasattr(weight, "to_local"):
        return weight.to_local().numel(), weight.numel()
    if hasattr(weight, "ds_tensor"):
        return (weight.ds_numel if getattr(weight, "ds_persist", False) else weight.ds_tensor.numel()), weight.ds_numel
    return weight.numel(), weight.numel()


def base_note(model, fsdp, world):
    """(the refusal, or None; the first line's note): what this process holds of the 4-bit base. Under FSDP2 with
    several processes every 4-bit weight must be a shard, or the run is refused (the first layer held whole named)."""
    layers = [(name, held(module.weight)) for name, module in four_bit_layers(model)]
    mine, whole = (sum(column) for column in zip(*(sizes for _, sizes in layers))) if layers else (0, 0)
    note = f"4-bit base (NF4): {len(layers)} layers, {mine:,} of their {whole:,} packed elements on this process"
    whole_here = [name for name, (n, total) in layers if n == total]
    if fsdp and world > 1 and whole_here:
        return (f"FSDP2 left the 4-bit base whole on every rank ({whole_here[0]} and {len(whole_here) - 1} more "
                f"layers): {FLAG} under FSDP2 shards it, which needs every 4-bit layer out of fsdp_ignored_modules "
                f"and stored in a float type (accelerate >= 1.14). Remove them from fsdp_ignored_modules, or use "
                f"2gpu.yaml, which keeps the base whole on every GPU"), note
    return None, note


def dequantized_base(model, keep):
    """Collective under FSDP2 and ZeRO-3 (every process, the layers in the same order): {state-dict name: weight} of
    every 4-bit layer's weight dequantised into its compute dtype, on the CPU, where `keep` ({} elsewhere: the main
    process keeps them); each gathered whole in turn."""
    import contextlib

    from bitsandbytes.functional import dequantize_4bit
    weights = {}
    for name, module in four_bit_layers(model):
        weight, gathered = module.weight, contextlib.nullcontext()
        if hasattr(weight, "ds_id"):  # ZeRO-3: the partitions gathered while in the block
            import deepspeed
            gathered = deepspeed.zero.GatheredParameters([weight])
        with gathered:
            packed = weight.full_tensor() if hasattr(weight, "full_tensor") else weight.data
            if keep:
                state = getattr(weight, "quant_state", None) or module.quant_state  # FSDP2: the layer keeps it
                weights[f"{name}.weight"] = dequantize_4bit(packed.detach(), state).cpu()
    return weights


def checked_base(args, model, accelerator, fail):
    """After prepare(), every process: "" without --load-in-4bit; else the first line's note on what this process holds
    of the 4-bit base (base_note), the run refused in one line where FSDP2 left it whole (fail: run.fail)."""
    if not args.load_in_4bit:
        return ""
    from accelrun.engines import Engine
    problem, note = base_note(accelerator.unwrap_model(model), Engine.of(accelerator).shards_4bit_base,
                              accelerator.num_processes)
    if problem:
        fail(problem)
    return f" | {note}"


def as_plain_model(weights, quantized):
    """(the merged weights, the model that writes them): a model of the quantised one's architecture and config
    without the quantisation, on the meta device (no memory), and of the weights the names it has (the dequantised
    base's, the adapters merged in: lora.merge_adapters)."""
    import copy

    import torch
    config = copy.deepcopy(quantized.config)
    del config.quantization_config
    with torch.device("meta"):  # the class itself: from_config would enter ZeRO-3's zero.Init, a collective
        plain = type(quantized)(config)
    return {name: weights[name] for name in plain.state_dict()}, plain
