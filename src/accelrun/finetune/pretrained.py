"""A pretrained Hugging Face causal model for a fine-tune: read the way each engine needs it.

Owns: --model's config and tokenizer, read before the Accelerator exists (with the parameter count, from a model
on the meta device) and with the weight files' check (finetune/weights.py), and the one-line messages for a path,
hub id or directory that cannot be read; transformers told never to run a directory's own code (NO_CODE); the
weights, loaded in the dtype a full or LoRA fine-tune trains them in, partitioned while loaded under ZeRO-3 and
sharded from the main process's copy under FSDP2, with the attention implementation the recipe gives its masks
(finetune/packing.py), or with --load-in-4bit quantised to NF4 while loaded (finetune/qlora.py); LoRA's adapters on
top (finetune/lora.py); and the one-line note for LoRA under ZeRO-3 on GPUs that can each hold the frozen base.
"""

import os
import re

import torch

from accelrun.exits import one_line
from accelrun.finetune.lora import LoraProblem, with_lora
from accelrun.finetune.qlora import NF4_BYTES, for_training, quantization_config
from accelrun.finetune.records import offline_unless_the_hub_answers
from accelrun.finetune.weights import weights_problem

# A hub id: a name, or an organisation and a name. Anything else given to --model is a path.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
# Given to every transformers call that reads --model: a directory's own Python files (auto_map) never run, and
# transformers never stops to ask on stdin whether they may (it did, for 15 s, before taking the answer "y").
NO_CODE = {"trust_remote_code": False}


def load_config_and_tokenizer(name):
    """(config, parameter count, tokenizer, error), before any weight is read, and for a local directory its weight
    files checked (finetune/weights.py). Called before the Accelerator exists: under ZeRO-3 transformers would
    partition even a model on the meta device. Nothing in the directory runs (NO_CODE)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # here: --help stays quick
    path = os.path.expanduser(name)
    if not os.path.isdir(path) and not HUB_ID.fullmatch(name):
        return None, 0, None, (f"--model {name!r}: no such directory. Give a directory written by save_pretrained "
                               f"(config.json, the weights and the tokenizer), or a hub id such as Qwen/Qwen2.5-0.5B")
    if not os.path.isdir(path):
        offline_unless_the_hub_answers()  # unanswered: the cache or one line at once, not a retry loop (records.py)
    try:
        config = AutoConfig.from_pretrained(path, **NO_CODE)
        tokenizer = AutoTokenizer.from_pretrained(path, **NO_CODE)
        if tokenizer.eos_token_id is None:
            raise ValueError("its tokenizer has no end-of-sequence token, which marks where a response ends")
        with torch.device("meta"):
            n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config, **NO_CODE).parameters())
    except Exception as exc:  # noqa: BLE001 - whatever a model directory holds: one line, never a traceback
        return None, 0, None, cannot_load(name, path, exc)
    problem = weights_problem(path, n_params, config) if os.path.isdir(path) else None
    return config, n_params, tokenizer, problem and f"--model {name}: {problem}"


def cannot_load(name, path, exc):
    """The one line for a --model that transformers cannot read: what it said, and what to do."""
    said = one_line(f"{type(exc).__name__}: {exc}", limit=300)
    if "trust_remote_code" in str(exc):  # auto_map: the directory asks to run its own Python files
        return (f"--model {name}: it asks to run its own code (auto_map in config.json or tokenizer_config.json), "
                f"which this recipe never does with files from a directory: give a model that transformers loads "
                f"without custom code")
    if os.path.isdir(path):
        return f"cannot load model {name!r} ({said}). Give a directory written by save_pretrained, as it wrote it"
    return (f"cannot load model {name!r} ({said}, and there is no local directory of that name). Offline, give a "
            f"local directory written by save_pretrained, or download it first on a machine with internet "
            f"(hf download)")


def load_model(args, mixed_precision, attention, *, engine, sharded_init, fail):
    """(model, dtype of its frozen weights): the pretrained weights, loaded partitioned under ZeRO-3 and sharded
    from the main process's copy under FSDP2, with the attention implementation `attention` (packing.py); LoRA
    adapters on top with --lora-r. engine: the run's (engines/); sharded_init: the run's context manager that builds
    the model the engine's way and records how (run.sharded_init); fail: one line, every rank exits 2 (run.fail)."""
    from transformers import AutoModelForCausalLM
    # A full fine-tune keeps fp32 master weights; LoRA's frozen base needs none, so it loads in the compute dtype.
    dtype = torch.float32
    if args.lora_r:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)
    # QLoRA: the decoder's linear layers quantised to NF4 while loaded, stored in the compute dtype (qlora.py)
    quantized = {"quantization_config": quantization_config(dtype)} if args.load_in_4bit else {}
    try:
        # ZeRO-3: partitioned while loaded; FSDP2: main's copy sharded; 4-bit: every process's own copy, then sharded
        with sharded_init(from_pretrained=True, quantized=args.load_in_4bit):
            model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(args.model), dtype=dtype,
                                                         attn_implementation=attention, **quantized, **NO_CODE)
    except Exception as exc:  # noqa: BLE001 - a weight file transformers refuses: one line, never a traceback
        fail(f"cannot load the weights of {args.model!r}: {one_line(f'{type(exc).__name__}: {exc}', limit=300)}")
    if args.load_in_4bit:
        for_training(model)  # bitsandbytes' 4-bit layers set for training and for LoRA's checkpoints (qlora.py)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False  # no generation cache while training
    if args.lora_r:
        no_autocast = not engine.autocasts
        try:  # DeepSpeed runs no autocast: its adapters compute in the dtype they are in
            model = with_lora(model, args, adapter_dtype=dtype if no_autocast and dtype != torch.float32 else None)
        except LoraProblem as exc:
            fail(str(exc))
    return model, dtype


def zero3_lora_note(args, engine, accelerator, n_params, dtype, say):
    """Under ZeRO-3 with LoRA on GPUs that can each hold the frozen base: one line, said by `say` (print on the main
    process: run.print), on the configs that do not gather it layer by layer in every forward and backward
    (docs/configs.md). engine: the run's (engines/)."""
    if not (args.lora_r and engine.partitions_parameters and accelerator.device.type == "cuda"):
        return
    base_gb = n_params * (NF4_BYTES if args.load_in_4bit else dtype.itemsize) / 1e9  # 4-bit: the linear layers' rate
    index = accelerator.device.index if accelerator.device.index is not None else torch.cuda.current_device()
    gpu_gb = torch.cuda.get_device_properties(index).total_memory / 1e9  # one process: "cuda", no index
    if base_gb < gpu_gb / 2:
        say(f"note: LoRA's frozen base ({base_gb:.1f} GB) fits one GPU ({gpu_gb:.0f} GB): 1gpu.yaml, 2gpu.yaml "
            f"or deepspeed_zero2.yaml keep it whole and gather nothing (docs/configs.md)")
