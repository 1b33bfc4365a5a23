"""A GPT language model in plain PyTorch, trained on bytes: the ZeRO-3 showcase.

    OMP_NUM_THREADS=1 python recipes/gpt.py --preset tiny --max-steps 200   # a CPU is enough (one thread: below)
    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/gpt.py --preset 124M
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml recipes/gpt.py \\
        --preset 6.7B --batch-size 16 --peak-tflops 989 --data-files 'corpus/*.txt'
    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/2gpu.yaml \\
        --mixed_precision no recipes/gpt.py --preset tiny                  # 2 processes on a CPU

A decoder-only transformer (pre-LayerNorm blocks, causal attention through
F.scaled_dot_product_attention, GELU MLP, tied input/output embeddings). The tokens
are bytes (vocabulary 256), so there is no tokenizer to download.

Text: --data-files (local files or globs, comma-separated) or --dataset (a Hugging Face
hub name, when online) through the `datasets` library; with neither, the Python
standard library's own source files, which every machine has. Documents are tokenised
with .map(batched=True) under main_process_first (one process builds the cache, the
others read it), joined with a 0 byte between documents, and packed into blocks of
block_size + 1 tokens (input and shifted target). 2% of the blocks are held out.

Reporting: tokens/s over all processes, and model FLOPs utilisation (MFU) when you give
--peak-tflops per GPU (989 for an H100 SXM in dense bf16): MFU = (6 N + 12 L d T) FLOPs
per token x tokens/s / (peak x processes), N the parameters without the position table.

--report-to tensorboard (or png) draws the curves, --profile 5 traces 5 steps per rank,
and bench/benchmark.py --recipe gpt compares the configs' tokens/s and memory.

Memory per GPU on 2x80 GB (docs/recipes.md has the table per preset and engine): the
largest preset that fits is 2.7B under DDP, 6.7B under ZeRO-1/2/3, and 13B only with ZeRO-3
and CPU offload. Under ZeRO-3 and FSDP the model is built sharded (run.sharded_init()).

On a CPU shared with other jobs, torch's default of a thread per core makes the threads wait for each other (a
fine-tune ran 15x slower): the CPU command names OMP_NUM_THREADS=1, as its figures were measured.

Result: --preset tiny --max-steps 200: loss 5.41 to 2.71, measured 2026-11-23 on a 2-core CPU (docs/recipes.md).
"""

import argparse
import glob
import itertools
import math
import os
import sys
import sysconfig
from datetime import timedelta

from accelrun import add_run_args

# name: (layers, heads, d_model, context length)
PRESETS = {"tiny": (2, 2, 64, 64), "124M": (12, 12, 768, 1024), "350M": (24, 16, 1024, 1024),
           "1.3B": (24, 16, 2048, 1024), "2.7B": (32, 32, 2560, 1024), "6.7B": (32, 32, 4096, 1024),
           "13B": (40, 40, 5120, 1024)}
VOCAB, SEPARATOR = 256, 0  # bytes; a 0 byte between documents


# Flags a resumed run may change: they act after training or only on what is reported.
AFTER_TRAINING = {"prompt": "the sample at the end", "sample_tokens": "the sample at the end",
                  "temperature": "the sample at the end", "top_k": "the sample at the end",
                  "peak_tflops": "MFU's denominator", "timeout": "how long a collective may wait"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", choices=PRESETS, default="124M", help="model size (tiny is for tests and CPUs)")
    p.add_argument("--block-size", type=int, default=0, help="context length (0: the preset's)")
    p.add_argument("--data-files", default=None, help="local text files or globs, comma-separated")
    p.add_argument("--dataset", default=None, help="a Hugging Face hub dataset with a text column (needs internet)")
    p.add_argument("--dataset-config", default=None, help="its configuration name, e.g. wikitext-103-raw-v1")
    p.add_argument("--text-column", default="text", help="the column of --dataset that holds the text")
    p.add_argument("--max-steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch in sequences, split across processes")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, default=100, help="linear warm-up, then cosine decay to lr/10")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (not on biases and norms)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm (0: no clipping)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout in attention and MLP")
    p.add_argument("--eval-every", type=int, default=250, help="validation loss every N steps (and at the end)")
    p.add_argument("--eval-batches", type=int, default=20, help="global batches of held-out text per evaluation")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="peak TFLOP/s of ONE GPU, for MFU (H100 SXM bf16: 989)")
    p.add_argument("--prompt", default="def ", help="text to continue at the end")
    p.add_argument("--sample-tokens", type=int, default=200, help="bytes to generate (0: no sample)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest bytes")
    p.add_argument("--seed", type=int, default=1337, help="weights and shuffling")
    # NCCL's default is 10 minutes, while the main process tokenises alone and the others wait in a barrier.
    p.add_argument("--timeout", type=int, default=1800,
                   help="seconds a collective waits for a missing rank (the others wait while the main process "
                        "tokenises) before the run fails")
    add_run_args(p, "gpt", log_every=10)
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and a wrong flag answer here, before torch and the rest are imported (seconds)

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, broadcast, set_seed
from torch.utils.data import DataLoader

from accelrun import Run


class Linear(nn.Linear):
    """nn.Linear with GPT-2's initialisation, done in its constructor: ZeRO-3's zero.Init partitions each
    module's weights as its constructor returns, so a loop over the finished model would see empty shards."""

    def __init__(self, d_in, d_out, std=0.02, bias=True):
        self.std = std  # read by reset_parameters, which nn.Linear's constructor calls
        super().__init__(d_in, d_out, bias)

    def reset_parameters(self):
        nn.init.normal_(self.weight, 0.0, self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    def reset_parameters(self):
        nn.init.normal_(self.weight, 0.0, 0.02)


class Block(nn.Module):
    def __init__(self, heads, d, dropout, residual_std):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = Linear(d, 3 * d), Linear(d, d, std=residual_std)
        self.mlp = nn.Sequential(Linear(d, 4 * d), nn.GELU(), Linear(4 * d, d, std=residual_std), nn.Dropout(dropout))

    def forward(self, x):
        batch, length, d = x.shape
        q, k, v = (t.view(batch, length, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(d, dim=2))
        # Fused causal attention: flash or memory-efficient kernels on GPU, no T x T mask in memory.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, length, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    _no_split_modules = ["Block"]  # the unit FSDP (fsdp.yaml) shards and gathers one at a time, like HF models

    def __init__(self, layers, heads, d, block_size, dropout=0.0):
        super().__init__()
        self.block_size = block_size
        self.wte, self.wpe = Embedding(VOCAB, d), Embedding(block_size, d)
        # GPT-2 initialisation: normal(0, 0.02), residual projections scaled down with depth
        self.blocks = nn.ModuleList(Block(heads, d, dropout, 0.02 / math.sqrt(2 * layers)) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = Linear(d, VOCAB, bias=False)
        self.tie_weights()

    def tie_weights(self):
        """Tied embeddings, as in GPT-2. Hugging Face's name: accelerate calls it to tie them again after
        moving the model to the meta device (FSDP's cpu_ram_efficient_loading)."""
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def load_blocks(args, accelerator, run, block_size):
    """Packed blocks of block_size + 1 byte tokens: (train, validation) datasets of 'ids'."""
    from datasets import load_dataset
    if args.dataset:
        source, column = args.dataset, args.text_column
        load = lambda: load_dataset(args.dataset, args.dataset_config, split="train")  # noqa: E731
    else:
        stdlib = os.path.join(sysconfig.get_paths()["stdlib"], "*.py")
        patterns = args.data_files.split(",") if args.data_files else [stdlib]
        files = sorted(f for pattern in patterns for f in glob.glob(os.path.expanduser(pattern)))
        if not files:
            run.fail(f"--data-files {args.data_files!r} matches no file; give paths or globs of text files")
        source, column = (args.data_files or "python standard library"), "text"
        load = lambda: load_dataset("text", data_files=files, sample_by="document", split="train")  # noqa: E731

    def tokenize(batch):
        return {"ids": [list(text.encode("utf-8")) + [SEPARATOR] for text in batch[column]]}

    def pack(batch):
        stream = list(itertools.chain.from_iterable(batch["ids"]))
        usable = len(stream) // (block_size + 1) * (block_size + 1)
        return {"ids": [stream[i:i + block_size + 1] for i in range(0, usable, block_size + 1)]}

    with accelerator.main_process_first():  # the main process tokenises and caches; the others reuse its cache
        try:
            texts = load()
        except Exception as exc:
            run.fail(f"could not load {source!r} ({type(exc).__name__}: {exc}). Offline, use --data-files "
                     f"with local text files, or no data flag for the standard library's sources.")
        tokens = texts.map(tokenize, batched=True, remove_columns=texts.column_names, desc="tokenising")
        blocks = tokens.map(pack, batched=True, batch_size=256, desc="packing")
        if len(blocks) >= 50:
            split = blocks.train_test_split(test_size=0.02, seed=0)  # cached too: same split on every rank
    if len(blocks) < 50:
        run.fail(f"{source!r} gives only {len(blocks)} blocks of {block_size + 1} bytes; give more text "
                 f"or a smaller --block-size")
    return split["train"].with_format("torch"), split["test"].with_format("torch"), source


def evaluate(model, loader, accelerator):
    """Mean loss per sequence over the held-out blocks in the loader."""
    model.eval()
    total = count = 0.0
    with torch.no_grad():
        for blocks in loader:
            ids = blocks["ids"]
            losses = F.cross_entropy(model(ids[:, :-1]).float().transpose(1, 2), ids[:, 1:], reduction="none").mean(1)
            losses = accelerator.gather_for_metrics(losses)  # accelerate: drops the blocks repeated as padding
            total, count = total + losses.sum().item(), count + losses.numel()
    model.train()
    return {"val_loss": total / max(count, 1)}


def generate(model, accelerator, prompt, tokens, temperature, top_k, block_size):
    """Every rank runs the same forwards (ZeRO-3 and FSDP gather weights collectively); rank 0 draws."""
    ids = torch.tensor([list(prompt.encode("utf-8")) or [SEPARATOR]], device=accelerator.device)
    model.eval()
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(ids[:, -block_size:])[:, -1, :].float() / max(temperature, 1e-5)
            cutoff = torch.topk(logits, min(top_k, VOCAB)).values[:, -1:]
            probs = F.softmax(logits.masked_fill(logits < cutoff, float("-inf")), dim=-1)
            nxt = broadcast(torch.multinomial(probs, 1))  # rank 0's draw, so every rank feeds the same input
            ids = torch.cat([ids, nxt], dim=1)
    model.train()
    return bytes(ids[0].tolist()).decode("utf-8", errors="replace")


def main(argv=None):
    args = parse_args(argv)
    run = Run("gpt", args, unit="tokens", may_change=AFTER_TRAINING)  # first: a stop may come during start-up
    accelerator = Accelerator(  # accelerate
        gradient_accumulation_steps=args.grad_accum,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.timeout))],
        # non_blocking with pinned batches: the copy to the GPU is queued, the host does not wait for the GPU
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True, non_blocking=True))
    run.setup(accelerator, batch_size=args.batch_size, max_grad_norm=args.max_grad_norm)
    set_seed(args.seed)
    world = accelerator.num_processes
    layers, heads, d, block_size = PRESETS[args.preset]
    block_size = args.block_size or block_size
    train_set, val_set, source = load_blocks(args, accelerator, run, block_size)
    micro = args.batch_size // args.grad_accum
    pin = accelerator.device.type == "cuda"
    train_loader = DataLoader(train_set, batch_size=micro, shuffle=True, drop_last=True, pin_memory=pin)
    # Exactly the blocks evaluated, read to the end: a loader left part-read stays accelerate's active one,
    # and its end-of-data flag would then decide when gradients sync (every micro-batch, with --grad-accum).
    # Whole batches only: on one process a short last batch is a new shape, which a compiled model would compile
    # a third graph for (on several, accelerate fills it).
    evaluated = min(len(val_set), args.eval_batches * args.batch_size)
    evaluated = torch.utils.data.Subset(val_set, range(evaluated // micro * micro or evaluated))
    val_loader = DataLoader(evaluated, batch_size=micro, pin_memory=pin)
    with run.sharded_init():  # ZeRO-3 (zero3_init_flag) and FSDP: never built whole on every process
        model = GPT(layers, heads, d, block_size, args.dropout)
    # Counted from the shapes: under zero.Init the parameters are already partitioned here.
    n_params = VOCAB * d + block_size * d + layers * (12 * d * d + 13 * d) + 2 * d
    flops_per_token = 6 * (n_params - block_size * d) + 12 * layers * d * block_size
    flat = {n for n, _ in model.named_parameters() if n.endswith("bias") or ".ln" in n or n.startswith("ln_")}
    decay = [p for n, p in model.named_parameters() if n not in flat]  # no weight decay on biases and norms
    no_decay = [p for n, p in model.named_parameters() if n in flat]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                                  fused=True)  # one kernel for all parameters, CUDA and CPU alike
    total_steps, steps_per_epoch = args.max_steps, len(train_loader) // args.grad_accum
    if steps_per_epoch == 0:
        run.fail(f"{len(train_set)} training blocks do not fill one global batch of {args.batch_size}")

    def schedule(step):  # linear warm-up, then cosine from lr to lr/10
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(total_steps - args.warmup_steps, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(  # accelerate
        model, optimizer, train_loader, val_loader, scheduler)
    stage = run.engine_facts["deepspeed_stage"]
    state_gb = n_params * {None: 20, 1: 4 + 12 / world, 2: 2 + 14 / world, 3: 16 / world}[stage] / 1e9
    run.start(model, optimizer, scheduler, steps_per_epoch=steps_per_epoch, total_steps=total_steps,
              units_per_sample=block_size,
              flops_per_unit=flops_per_token, peak_tflops=args.peak_tflops, eval_every=args.eval_every,
              evaluate=lambda: evaluate(model, val_loader, accelerator),
              describe=f"preset {args.preset}: {n_params / 1e6:.2f} M parameters, model states about {state_gb:.2f} GB "
                       f"per process | text: {source}, {len(train_set)} blocks of {block_size}",
              data_facts={"source": source, "train_blocks": len(train_set)})

    for batches in run.epochs(train_loader):  # resumes mid-epoch; checkpoints at each epoch's end
        for blocks in batches:
            ids = blocks["ids"]
            with accelerator.accumulate(model):  # accelerate
                loss = F.cross_entropy(model(ids[:, :-1]).float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
                accelerator.backward(loss)  # accelerate
                if accelerator.sync_gradients and args.max_grad_norm > 0:  # accelerate
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # accelerate
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if run.step(loss):  # a stop signal, or the last step
                break
    sample = ""
    if args.sample_tokens and not run.stopping:
        # Uncompiled: every generated length is a new shape, which a compiled model would recompile for.
        plain = accelerator.unwrap_model(model, keep_torch_compile=False)  # accelerate
        sample = generate(plain, accelerator, args.prompt, args.sample_tokens, args.temperature, args.top_k, block_size)
        run.print(f"sample from {args.prompt!r}:\n{sample}")
    return run.finish(model, exclude=("lm_head.weight",),  # lm_head is wte (tied)
                      preset=args.preset, param_elements=n_params, block_size=block_size, data_source=source,
                      train_blocks=len(train_set), model_state_gb_per_process_estimate=state_gb, sample=sample)


if __name__ == "__main__":
    sys.exit(main())
