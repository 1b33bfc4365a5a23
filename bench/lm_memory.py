"""Which Hugging Face causal LMs a fine-tune (recipes/finetune_lm.py, AdamW) fits on 2 x 80 GB, per engine:
a full fine-tune, and LoRA (--lora-r).

    python bench/lm_memory.py [--gpus 2] [--gpu-gb 80] [--tokens-per-gpu 4096] [--lora-r 16]
    python bench/lm_memory.py --jobs   # the long-context table; --dpo: DPO's (recipes/dpo.py, below DPO_JOBS)

Computed, not measured: the parameter counts come from the real architectures built on the meta
device (no download), the bytes per parameter from what each engine keeps, and the activations
from what a Llama decoder layer saves for backward. docs/recipes.md prints this table.

Model states per GPU, bytes per parameter (N parameters, G GPUs):
  DDP (2gpu.yaml, bf16 autocast)   20     fp32 weights 4, gradients 4, DDP's buckets 4, Adam moments 8
  ZeRO-2 (bf16)                    2+14/G bf16 weights; bf16 gradients, fp32 master and moments sharded
  ZeRO-3 (bf16)                    16/G   everything sharded
  ZeRO-3 + CPU offload             ~0     on the GPU; about 18 N bytes of host memory in all
  FSDP2 (fsdp.yaml, bf16)          16/G   fp32 weights, gradients and moments, all sharded
LoRA (--lora-r r on every linear layer of the decoder blocks, A rows, n adapter parameters): the
base is frozen in bf16, 2 bytes per parameter (DDP: on every GPU; ZeRO-3, FSDP2: sharded, 2/G); the
adapters take what a full fine-tune takes per parameter, on n instead of N (about 0.5% of N at r 16).
Activations per token, bf16, flash attention (no T x T matrix): per layer about 24 d + 8 i bytes (the
norms' fp32 copies, q/k/v, the attention output, the MLP's four i-wide tensors), plus the logits
(bf16, their fp32 copy and its gradient: 10 V bytes; with the loss in chunks of at most C loss positions,
--loss-chunk-tokens C (finetune_lm.py's default form, C = 8,192), one chunk's: 10 V min(tokens, C); with
--loss-chunks N, 10 V / N; every position counted as in the loss, the worst case). With gradient checkpointing
only each layer's input (2 d bytes) stays, plus one layer recomputed at a time. LoRA adds, per layer, the dropped-out
copy of each adapted layer's input and its mask (3 bytes per element: 6 d + i elements per token,
none with --lora-dropout 0), and the adapters' r-wide outputs (negligible).
FP8 (accelerate_configs/fsdp_fp8.yaml, torchao's float8 linears): the same as bf16 but for the layers FSDP2
gathers: the linear layers accelrun/float8.py converts are gathered in float8 (1 byte per parameter instead of 2).
Nothing else changes: the float8 linears save their bf16 input and weight for backward (the activations are bf16's),
and the master weights, gradients and moments stay as --optim-states keeps them. FP8 is a lever for speed, not memory.
"""

import argparse
import functools

import torch

from accelrun import float8
from accelrun.finetune.loss_flags import DEFAULT_CHUNK_TOKENS
from accelrun.finetune.optim_states import STATE_BYTES
from accelrun.finetune.qlora import NF4_BYTES

# name: (config class, its arguments): the published shapes
MODELS = {
    "Llama-3.2-1B": ("LlamaConfig", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                         tie_word_embeddings=True)),
    "Llama-3.2-3B": ("LlamaConfig", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                         num_attention_heads=24, num_key_value_heads=8, vocab_size=128256,
                                         tie_word_embeddings=True)),
    "Llama-3.1-8B": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)),
    "Qwen2.5-14B": ("Qwen2Config", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064)),
    "Qwen2.5-32B": ("Qwen2Config", dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064)),
    "Llama-3.1-70B": ("LlamaConfig", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)),
}
ENGINES = ("DDP", "ZeRO-2", "ZeRO-3", "ZeRO-3+off", "FSDP2")
LORA_ENGINES = ("DDP", "ZeRO-3", "FSDP2")


@functools.cache
def parameters(name):
    import transformers
    kind, shape = MODELS[name]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, kind)(**shape))
    return sum(p.numel() for p in model.parameters()), shape


def adapter_parameters(shape, r):
    """LoRA's A (r x in) and B (out x r) on q, k, v, o, gate, up and down of every decoder layer."""
    d, i = shape["hidden_size"], shape["intermediate_size"]
    kv = d // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return shape["num_hidden_layers"] * r * (2 * (d + d) + 2 * (d + kv) + 2 * (d + i) + (i + d))


def rows(gpus=2, gpu_gb=80.0, tokens=4096, lora_r=0):
    """(name, parameters, {engine: model-state GB per GPU}, activation GB without/with checkpointing, fits).
    With lora_r: LoRA's, for LORA_ENGINES."""
    for name in list(MODELS)[:5]:  # the table of before: up to 32B
        n, s = parameters(name)
        d, i, layers, vocab = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
        states = {"DDP": 20 * n, "ZeRO-2": (2 + 14 / gpus) * n, "ZeRO-3": 16 / gpus * n, "ZeRO-3+off": 0.0,
                  "FSDP2": 16 / gpus * n}
        layer, logits = (24 * d + 8 * i) * tokens, 10 * vocab * tokens
        if lora_r:
            a = adapter_parameters(s, lora_r)
            states = {"DDP": 2 * n + 20 * a, "ZeRO-3": (2 * n + 16 * a) / gpus, "FSDP2": (2 * n + 16 * a) / gpus}
            layer += 3 * (6 * d + i) * tokens
        plain, checkpointed = layers * layer + logits, layers * 2 * d * tokens + layer + logits
        fits = {}
        for engine, bytes_ in states.items():
            fits[engine] = ("yes" if bytes_ + plain < gpu_gb * 1e9 else
                            "GC" if bytes_ + checkpointed < gpu_gb * 1e9 else "no")
        yield name, n, {k: v / 1e9 for k, v in states.items()}, plain / 1e9, checkpointed / 1e9, fits


def table(gpus=2, gpu_gb=80.0, tokens=4096, lora_r=0):
    engines = LORA_ENGINES if lora_r else ENGINES
    what = f"LoRA r={lora_r}, bf16 base" if lora_r else "full fine-tune"
    lines = [f"{what}: model states per GPU (GB) on {gpus} GPUs; activations (GB) at {tokens} tokens per GPU; fits "
             f"in {gpu_gb:.0f} GB: yes, GC (only with --gradient-checkpointing), no"
             + ("" if lora_r else "; off host: host memory ZeRO-3+off needs"),
             f"{'model':<14}{'params':>8} " + "".join(f"{e:>11}" for e in engines)
             + ("" if lora_r else f"{'off host':>9}") + f"{'act':>7}{'act GC':>8}   fits: " + " / ".join(engines)]
    for name, n, states, plain, checkpointed, fits in rows(gpus, gpu_gb, tokens, lora_r):
        lines.append(f"{name:<14}{n / 1e9:>7.2f}B " + "".join(f"{states[e]:>11.1f}" for e in engines)
                     + ("" if lora_r else f"{18 * n / 1e9:>9.0f}") + f"{plain:>7.1f}{checkpointed:>8.1f}   "
                     + " / ".join(fits[e] for e in engines))
    return "\n".join(lines)


# The jobs of docs/recipes.md's long-context table (--jobs): every job with --gradient-checkpointing and the loss in
# chunks of DEFAULT_CHUNK_TOKENS (finetune_lm.py's default --loss-chunk-tokens; SMALL_CHUNK_TOKENS where that does
# not fit), one sequence per data-parallel rank. QLoRA's base: NF4 with double quantisation, 4 bits plus an 8-bit
# scale per 64 weights plus an fp32 scale per 256 of those (0.516
# bytes per weight: NF4_BYTES, defined where finetune_lm.py's --load-in-4bit quantises) on the decoder's linear
# layers; the embedding, the output layer and the norms stay bf16.
JOB_MODELS = {"8B": "meta-llama/Llama-3.1-8B", "14B": "Qwen/Qwen2.5-14B", "32B": "Qwen/Qwen2.5-32B",
              "70B": "meta-llama/Llama-3.1-70B"}
# A full fine-tune with AdamW's moments in fp32 (the default), bf16 or 8 bits (--optim-states: STATE_BYTES, 8, 4 and
# 2 + 1/32 bytes per parameter); the fp32 master weights and gradients stay (4 + 4 bytes: finetune_lm.py loads a full
# fine-tune in fp32), so the states go from 16 to 12 or about 10 bytes per parameter, sharded.
OPTIM_STATES = {"full": "fp32", "full bf16 states": "bf16", "full 8-bit states": "8bit"}
# Full fine-tunes under fsdp_fp8.yaml (float8 linears, FSDP2's float8 all-gather), each the same as its bf16 job (the
# value) but for the layers gathered: the converted linears in float8. FSDP2 only (no Ulysses: sp2 is DeepSpeed's).
FP8_JOBS = {"full FP8": "full", "full FP8 8-bit states": "full 8-bit states"}
JOBS = (*OPTIM_STATES, *FP8_JOBS, "LoRA", "QLoRA")
LORA_R = 16
# The flags each job's plan assumes, in every cell: what a cell copied as printed runs is what was planned (LoRA's
# --lr is docs/recipes.md's, not a memory matter).
JOB_FLAGS = {"full": "--gradient-checkpointing", "full bf16 states": "--gradient-checkpointing --optim-states bf16",
             "full 8-bit states": "--gradient-checkpointing --optim-states 8bit",
             "LoRA": f"--gradient-checkpointing --lora-r {LORA_R} --lr 2e-4",
             "QLoRA": f"--gradient-checkpointing --lora-r {LORA_R} --lr 2e-4 --load-in-4bit"}
JOB_FLAGS.update({job: JOB_FLAGS[base] for job, base in FP8_JOBS.items()})  # float8 is the config's, no flag
COMMAND = ("accelerate launch --config_file accelerate_configs/CONFIG recipes/finetune_lm.py --model MODEL "
           "--data-files DATA")
LENGTHS = (2048, 8192, 32768)
SMALL_CHUNK_TOKENS = 2048  # --loss-chunk-tokens of a cell whose plan needs chunks smaller than the default
SHARDED = {"fsdp": "accelerate_configs/fsdp.yaml", "sp2": "accelerate_configs/deepspeed_zero3_sp2.yaml",
           "fsdp_fp8": "accelerate_configs/fsdp_fp8.yaml"}


def base_job(job):
    """The bf16 job an FP8 job is (FP8_JOBS), else the job itself: its flags, states and activations."""
    return FP8_JOBS.get(job, job)


def decoder_linears(s):
    """(input width, output width) of each linear layer of one decoder layer of the shape s: q, k, v, o, gate, up,
    down."""
    d, i = s["hidden_size"], s["intermediate_size"]
    kv = d // s["num_attention_heads"] * s["num_key_value_heads"]
    return [(d, d), (d, kv), (d, kv), (d, d), (d, i), (d, i), (i, d)]


def in_float8(width_in, width_out):
    """Whether fsdp_fp8.yaml runs a decoder linear layer of these widths in float8: float8.py's own decision
    (Float8Layers: not too small to gain, widths multiples of 16), asked of a layer on the meta device. The model's
    first linear (layer 0's q) stays bf16 too: d x d bytes more in one gathered pair, left out (under 0.07 GB)."""
    with torch.device("meta"):
        layer = torch.nn.Linear(width_in, width_out, bias=False)
    return float8.Float8Layers()(layer, "")


def job_parts(name, job, length, sp=1, gpus=2, chunks=None, lora_r=LORA_R, chunk_tokens=DEFAULT_CHUNK_TOKENS):
    """GB per GPU of one job with the states sharded over `gpus` (FSDP2 or ZeRO-3, bf16 compute) and one sequence of
    `length` tokens per data-parallel rank, `sp` GPUs sharing it: {model states, the bf16 layers gathered (the one
    computing and the one prefetched), layer activations with gradient checkpointing, logits}."""
    n, s = parameters(name.split("/")[-1])
    return shape_parts(n, s, job, length, sp, gpus, chunks, lora_r, chunk_tokens)


def shape_parts(n, s, job, length, sp=1, gpus=2, chunks=None, lora_r=LORA_R, chunk_tokens=DEFAULT_CHUNK_TOKENS):
    """job_parts for a model of n parameters and the shape s (a config's hidden_size, intermediate_size,
    num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size): the GPU pack's tiny model too. The
    loss's chunks: at most chunk_tokens positions (--loss-chunk-tokens), or with chunks N the count form."""
    d, i, layers, vocab = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    a = adapter_parameters(s, lora_r)
    widths = decoder_linears(s)
    per_layer = sum(w_in * w_out for w_in, w_out in widths)
    linear = layers * per_layer  # the decoder's linear layers: what 4-bit quantises
    full = {job: (8 + STATE_BYTES[kind]) * n for job, kind in OPTIM_STATES.items()}
    states = {**full, "LoRA": 2 * n + 16 * a, "QLoRA": NF4_BYTES * linear + 2 * (n - linear) + 16 * a}[base_job(job)]
    # bytes of one gathered layer's linears: bf16, NF4, or float8 for those float8.py converts
    layer_bytes = (sum(w_in * w_out * (1 if in_float8(w_in, w_out) else 2) for w_in, w_out in widths)
                   if job in FP8_JOBS else per_layer * (NF4_BYTES if job == "QLoRA" else 2))
    gathered = 2 * layer_bytes
    tokens = length / sp
    activations = layers * 2 * d * tokens + (24 * d + 8 * i) * tokens
    logits = 10 * vocab * (tokens / chunks if chunks else min(tokens, chunk_tokens))
    return {"model states": states / gpus / 1e9, "gathered layers": gathered / 1e9,
            "activations": activations / 1e9, "logits": logits / 1e9}


def job_plan(size, job, length, gpus=2, gpu_gb=80.0):
    """(config key or None, parts of the first way that fits, or of the last tried when none does, the loss's chunk
    size): the 2 GPUs as data-parallel FSDP2 ranks, one sequence each; else both on one sequence (Ulysses, sp 2);
    each with the default chunks of the loss, else SMALL_CHUNK_TOKENS (one sequence per GPU holds fewer loss
    positions than the default chunk: smaller chunks hold fewer logits). Low-precision optimizer states: FSDP2 only
    (DeepSpeed refuses --optim-states); FP8: fsdp_fp8.yaml only."""
    # DeepSpeed keeps its own fp32 optimizer states: --optim-states bf16 or 8bit only under FSDP2 (or DDP)
    ways = ((("fsdp_fp8", 1),) if job in FP8_JOBS else
            (("fsdp", 1),) if OPTIM_STATES.get(job, "fp32") != "fp32" else (("fsdp", 1), ("sp2", 2)))
    for key, sp in ways:
        for chunk_tokens in (DEFAULT_CHUNK_TOKENS, SMALL_CHUNK_TOKENS):
            parts = job_parts(JOB_MODELS[size], job, length, sp, gpus, chunk_tokens=chunk_tokens)
            if sum(parts.values()) < gpu_gb:
                return key, parts, chunk_tokens
    return None, parts, chunk_tokens


def largest_full(gpus=1, gpu_gb=80.0, tokens=8192):
    """(model of MODELS, the jobs of OPTIM_STATES that fit it) for the model of the most parameters whose full
    fine-tune fits `gpus` GPUs of gpu_gb with `tokens` tokens per GPU, by shape_parts (gradient checkpointing, the
    default chunks of the loss); (None, []) when none does. The GPU table's largest full fine-tune on one GPU."""
    for name in sorted(MODELS, key=lambda m: parameters(m)[0], reverse=True):
        n, s = parameters(name)
        fits = [job for job in OPTIM_STATES if sum(shape_parts(n, s, job, tokens, gpus=gpus).values()) < gpu_gb]
        if fits:
            return name, fits
    return None, []


def jobs_table(gpus=2, gpu_gb=80.0):
    """docs/recipes.md's table: for each model, job and length, the config and every flag of the run that fits (GB
    per GPU), or the part that breaks the budget (the largest), with the GB per GPU; above it, the command each cell
    completes. QLoRA's rows are the planner's alone."""
    models = ", ".join(f"{size} `{model}`" for size, model in JOB_MODELS.items())
    lines = [f"Each cell that fits completes `{COMMAND}` (CONFIG and the flags: the cell's; MODEL: the row's, "
             f"{models}), with every flag its plan assumes; each that does not names the largest part "
             f"(GB per GPU, {gpus} GPUs of {gpu_gb:.0f} GB):", "",
             f"| job | {' | '.join(f'{n // 1024}k tokens' for n in LENGTHS)} |", "|---|---|---|---|"]
    for size in JOB_MODELS:
        for job in JOBS:
            cells = []
            for length in LENGTHS:
                key, parts, chunk_tokens = job_plan(size, job, length, gpus, gpu_gb)
                total = sum(parts.values())
                if key:
                    batch = "--batch-size 1 --no-packing" if key == "sp2" else "--batch-size 2"
                    chunks = "" if chunk_tokens == DEFAULT_CHUNK_TOKENS else f" --loss-chunk-tokens {chunk_tokens}"
                    cells.append(f"{total:.0f} GB: `{SHARDED[key].split('/')[-1]} --block-size {length} {batch} "
                                 f"{JOB_FLAGS[job]}{chunks}`")
                else:
                    worst = max(parts, key=parts.get)
                    cells.append(f"**no** ({total:.0f} GB): {worst} {parts[worst]:.1f} GB")
            lines.append(f"| {size} {job} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# DPO (recipes/dpo.py, --dpo): one pair per data-parallel rank, its chosen and rejected sequences of `length` tokens
# each on the same rank (2 x length tokens in the step's activations), every job with --gradient-checkpointing and
# the default chunks of the loss, on fsdp.yaml (Ulysses is finetune_lm.py's alone). The reference adds no
# activations (its forward runs without gradient, one layer at a time); what it holds: LoRA and QLoRA nothing (the
# adapters disabled), a full fine-tune with --precompute-ref nothing (a table of two numbers per pair), and a full
# fine-tune with its frozen reference a bf16 copy of the weights sharded like the policy (2 bytes per parameter / G).
DPO_JOBS = {"LoRA": ("LoRA", f"--gradient-checkpointing --lora-r {LORA_R} --lr 5e-6", 0),
            "QLoRA": ("QLoRA", f"--gradient-checkpointing --lora-r {LORA_R} --lr 5e-6 --load-in-4bit", 0),
            "full, precomputed reference": ("full", "--gradient-checkpointing --precompute-ref", 0),
            "full, frozen reference": ("full", "--gradient-checkpointing", 2)}
DPO_MODELS = {"1B": "meta-llama/Llama-3.2-1B", "3B": "meta-llama/Llama-3.2-3B", **JOB_MODELS}
DPO_COMMAND = ("accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/dpo.py --model MODEL "
               "--data-files PAIRS --batch-size 2")


def dpo_parts(name, job, length, gpus=2):
    """GB per GPU of one DPO job (DPO_JOBS) on `gpus` FSDP2 ranks, one pair of two `length`-token sequences each:
    the policy's parts (shape_parts on 2 x length tokens) and the reference's weights."""
    base, _, reference_bytes = DPO_JOBS[job]
    n, s = parameters(name.split("/")[-1])
    parts = shape_parts(n, s, base, 2 * length, gpus=gpus)
    parts["reference"] = reference_bytes * n / gpus / 1e9
    return parts


def dpo_table(gpus=2, gpu_gb=80.0):
    """docs/recipes.md's DPO table: for each model, DPO job and length (tokens of each of a pair's sequences), the
    GB per GPU and `--block-size L` where it fits, else the largest part; a job that fits at no length is left out."""
    models = ", ".join(f"{size} `{model}`" for size, model in DPO_MODELS.items())
    lines = [f"Each cell that fits completes `{DPO_COMMAND}` (MODEL: the row's, {models}) with the row's flags and "
             f"the cell's --block-size; each that does not names the largest part (GB per GPU, {gpus} GPUs of "
             f"{gpu_gb:.0f} GB; a job that fits at none of these lengths is left out):", "",
             f"| DPO job | flags | {' | '.join(f'{n // 1024}k tokens' for n in LENGTHS)} |", "|---|---|---|---|---|"]
    for size, model in DPO_MODELS.items():
        for job, (_, flags, _) in DPO_JOBS.items():
            cells = []
            for length in LENGTHS:
                parts = dpo_parts(model, job, length, gpus)
                total = sum(parts.values())
                worst = max(parts, key=parts.get)
                cells.append(f"{total:.0f} GB: `--block-size {length}`" if total < gpu_gb else
                             f"**no** ({total:.0f} GB): {worst} {parts[worst]:.1f} GB")
            if not all(cell.startswith("**no**") for cell in cells):
                lines.append(f"| {size} {job} | `{flags}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=2, help="GPUs sharing the model states")
    p.add_argument("--gpu-gb", type=float, default=80.0, help="memory of one GPU")
    p.add_argument("--tokens-per-gpu", type=int, default=4096, help="tokens per micro-batch per GPU (batch x length)")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank of the second table (0: no LoRA table)")
    p.add_argument("--jobs", action="store_true",
                   help="instead: the long-context table (8B to 70B; full with fp32, bf16 or 8-bit states, in bf16 "
                        "or FP8, LoRA, QLoRA; 2k / 8k / 32k tokens)")
    p.add_argument("--dpo", action="store_true",
                   help="instead: DPO's table (recipes/dpo.py: LoRA, QLoRA, full with a precomputed or a frozen "
                        "reference; 2k / 8k / 32k tokens per sequence)")
    a = p.parse_args()
    if a.dpo:
        print(dpo_table(a.gpus, a.gpu_gb))
        raise SystemExit(0)
    if a.jobs:
        print(jobs_table(a.gpus, a.gpu_gb))
        raise SystemExit(0)
    print(table(a.gpus, a.gpu_gb, a.tokens_per_gpu))
    if a.lora_r:
        print()
        print(table(a.gpus, a.gpu_gb, a.tokens_per_gpu, a.lora_r))
