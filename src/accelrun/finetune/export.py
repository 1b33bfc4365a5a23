"""What a fine-tune exports (finetune_lm.py, dpo.py): on the main process, the directories from_pretrained and PEFT
load, each with the tokenizer: OUTPUT_DIR/model (save_pretrained, in --save-dtype), and with LoRA OUTPUT_DIR/adapter
in PEFT's format with the base it adapts recorded (finetune/weights.py), and with --merge-lora the base with the
adapters merged in (finetune/lora.py; a 4-bit base dequantised first, finetune/qlora.py). Each directory is written
privately and renamed into place (results.exported_directory). It makes no distributed call.
"""

import torch

from accelrun import results
from accelrun.finetune.lora import merge_adapters
from accelrun.finetune.qlora import as_plain_model
from accelrun.finetune.weights import record_base


def export(weights, model, accelerator, tokenizer, args, output_dir, base_weights=None, dequantized=None):
    """Main process: directories from_pretrained (and PEFT) load, with the tokenizer; returns where they are. The
    adapter's directory also records the base it adapts and that base's fingerprint (finetune/weights.py). QLoRA's
    merge takes the 4-bit base dequantised (`dequantized`, finish()), and writes a plain model (finetune/qlora.py).
    Each is written into a private temporary directory and renamed into place (results.exported_directory): nothing
    is written through a name someone else could have swapped for a link."""
    plain = accelerator.unwrap_model(model, keep_torch_compile=False)  # accelerate
    adapter_dir = None
    if args.lora_r:  # PEFT's own format, in fp32; PEFT picks the adapters' tensors out of the whole model's
        def write_adapter(directory):
            plain.save_pretrained(directory, state_dict=weights)
            tokenizer.save_pretrained(directory)
            record_base(directory, args.model, base_weights)
        adapter_dir = results.exported_directory(output_dir, "adapter", write_adapter)
        if not args.merge_lora:
            return adapter_dir
        weights, plain = merge_adapters({**weights, **(dequantized or {})}, plain), plain.get_base_model()
        if args.load_in_4bit:  # written as a plain model: save_pretrained of a 4-bit one writes its own 4-bit weights
            weights, plain = as_plain_model(weights, plain)
    dtype = getattr(torch, args.save_dtype)
    plain.config.use_cache = True  # a config for generating

    def write_model(directory):
        plain.save_pretrained(directory, state_dict={k: v.to(dtype) for k, v in weights.items()})
        plain.config.dtype = dtype  # save_pretrained wrote the dtype of the model in memory, not of the file
        plain.config.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    model_dir = results.exported_directory(output_dir, "model", write_model)
    return f"{adapter_dir}, {model_dir}" if adapter_dir else model_dir
