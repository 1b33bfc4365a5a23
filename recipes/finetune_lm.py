"""Fine-tune a pretrained Hugging Face causal language model: the job ZeRO-3 and FSDP exist for.

    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml recipes/finetune_lm.py \\
        --model meta-llama/Llama-3.2-1B --data-files chat.jsonl --block-size 1024 --peak-tflops 989
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/finetune_lm.py \\
        --model ./my-llama-8b --data-files 'books/*.txt' --gradient-checkpointing
    accelerate launch --config_file accelerate_configs/fsdp_fp8.yaml recipes/finetune_lm.py \\
        --model ./my-llama-8b --data-files chat.jsonl --gradient-checkpointing   # float8 matmuls on H100s
    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/finetune_lm.py \\
        --model Qwen/Qwen2.5-7B-Instruct --data-files chat.jsonl --lora-r 16 --lr 2e-4 --merge-lora   # LoRA
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/finetune_lm.py --model ./my-llama-70b \\
        --data-files chat.jsonl --lora-r 16 --lr 2e-4 --load-in-4bit --gradient-checkpointing --block-size 8192 \\
        --batch-size 2   # QLoRA
    python -m accelrun.data.tiny_hf /tmp/tiny && OMP_NUM_THREADS=1 python recipes/finetune_lm.py \\
        --model /tmp/tiny/model --data-files /tmp/tiny/pairs.jsonl --block-size 32 --max-steps 300 --batch-size 16 \\
        --lr 3e-3 --output-dir runs/tiny-pairs   # CPU
    OMP_NUM_THREADS=1 python recipes/finetune_lm.py --model /tmp/tiny/model --data-files /tmp/tiny/chat.jsonl \\
        --max-steps 300 --batch-size 16 --lr 3e-3 --output-dir runs/tiny-chat   # CPU, chat
    OMP_NUM_THREADS=1 python recipes/finetune_lm.py --model runs/tiny-pairs/model --data-files /tmp/tiny/chat.jsonl \\
        --lora-r 16 --merge-lora --max-steps 200 --batch-size 16 --lr 1e-2 --output-dir runs/tiny-chat-lora   # CPU

--model: a hub id or a local save_pretrained directory. The Accelerator exists before from_pretrained:
under ZeRO-3 with zero3_init_flag (deepspeed_zero3*.yaml) transformers loads the model partitioned;
under FSDP2 prepare() shards the main process's copy. The summary has the loading's peak memory.

Data through `datasets` (finetune/examples.py): --data-files (text or JSON Lines, globs) or --dataset
(hub); --format auto reads the columns: conversations are chat (the loss on the assistant turns and their
end-of-turn tokens), prompt/response records are pairs (the loss on the response and its end), plain text is
cut into blocks. Pairs and chats are packed several to a block of --block-size tokens (default: the model's
context, at most 1024), each attending only to itself with its positions restarting at 0 (--no-packing: one
per block, padded; finetune/packing.py); labels are set by position, so padding never counts; the
first line and the summary give the padding share, the examples per block and the examples --block-size cut
or dropped. The model gets its attention mask from the recipe (none, and SDPA's is_causal, unless examples
are packed): no host sync in a step, compiled or not. The result, OUTPUT_DIR/model, is save_pretrained
(safetensors) with the tokenizer, gathered from every rank. tokens/s and MFU (--peak-tflops) count real
tokens, not padding. The loss is the mean over every loss token of the whole optimizer step (all
micro-batches, all ranks): 1 process, --grad-accum, N processes, packed and padded agree. LoRA (--lora-r,
through PEFT: finetune/lora.py): the base frozen in the dtype it is loaded in (the config's compute dtype),
adapters with fp32 weights computing in the compute dtype, alone in the optimizer, dropout 0 by default
(under ZeRO-3 on GPUs that hold the frozen base, a note names the faster configs); OUTPUT_DIR/adapter in
PEFT's format, --merge-lora also OUTPUT_DIR/model; checkpoints hold the adapters only, never the frozen base.
QLoRA (--load-in-4bit, with --lora-r; finetune/qlora.py): the base's linear layers loaded in NF4 (bitsandbytes),
stored in the compute dtype so that FSDP2 and ZeRO-3 shard them (checked after prepare(); the first line says what
each process holds); --merge-lora writes the base dequantised with the adapters merged in, a plain model.
The default OUTPUT_DIR is runs/finetune_lm/<how it runs>, with -lora-r<R> for LoRA (-qlora-r<R>) and -padded for
--no-packing. The loss goes through the output layer in chunks of at most --loss-chunk-tokens loss positions (default
8,192; --loss-chunks N instead: N chunks; chunked_loss.py), the positions outside it dropped first: the [tokens x
vocabulary] logits never exist whole. --attention (finetune/attention.py): packed blocks on CUDA run FlexAttention
with a block mask (auto), everything else SDPA with the dense block-diagonal mask or none. Under
deepspeed_zero3_sp2.yaml two processes share each sequence (Ulysses; accelrun/finetune/ulysses.py, --no-packing).

Memory on 2x80 GB (docs/recipes.md: the table, from parameter counts; 4k tokens per GPU): a full AdamW
fine-tune of 1B fits under every engine, 3B under DDP with --gradient-checkpointing, 8B under ZeRO-2/3
or FSDP2 with it, 14B only under ZeRO-3 with CPU offload. LoRA r 16: 8B under DDP, ZeRO-3 or FSDP2,
14B and 32B with --gradient-checkpointing.

The CPU commands name OMP_NUM_THREADS=1, as the figures were measured: with torch's default (a thread per core) on
a machine shared with other jobs, the threads wait for each other (123 tokens/s against 1,880 with one thread).
accelerate launch sets it to 1 for each of several processes; give a lone process more on a machine of its own.

Result: loss 5.74 to 0.37 (first CPU command), LoRA 3.83 to 1.36 (last), measured 2026-11-25, CPU (docs/recipes.md).
"""

import argparse
import functools
import itertools
import os
import sys
from datetime import timedelta

from accelrun import add_run_args
from accelrun.finetune.attention import add_attention_args, flag_problem
from accelrun.finetune.examples import add_data_args
from accelrun.finetune.lora import add_lora_args, flags_without_rank
from accelrun.finetune.loss_flags import add_loss_args, loss_chunking_problem
from accelrun.finetune.optim_states import add_optim_states_args
from accelrun.finetune.optim_states import flag_problem as states_flag_problem
from accelrun.finetune.qlora import add_qlora_args, without_lora
from accelrun.flags import DefaultOnce

# Flags a resumed run may change: they act after training or only on what is reported.
AFTER_TRAINING = {"sample_tokens": "the answer at the end", "save_dtype": "the exported model",
                  "merge_lora": "the exported model", "peak_tflops": "MFU's denominator",
                  "timeout": "how long a collective may wait"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False, formatter_class=DefaultOnce)
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B",
                   help="hub id, or a local directory written by save_pretrained")
    add_data_args(p)  # --data-files or --dataset, --format and the columns (finetune/examples.py)
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per sequence, at most the model's context (default: 1024, or the context if shorter)")
    p.add_argument("--max-steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch in sequences, split across processes")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=2e-5, help="peak AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, default=30, help="linear warm-up, then cosine decay to lr/10")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (not on biases and norms)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm (0: no clipping)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute each layer in backward")
    add_optim_states_args(p)  # --optim-states: AdamW's moments in fp32, bf16 or 8 bits (finetune/optim_states.py)
    add_loss_args(p)  # --loss-chunk-tokens or --loss-chunks (accelrun/finetune/loss_flags.py, chunked_loss.py)
    add_attention_args(p)  # --attention: what keeps packed examples apart (accelrun/finetune/attention.py)
    add_lora_args(p)  # --lora-r and the adapters' settings (finetune/lora.py); OUTPUT_DIR gets -lora-r<R>
    add_qlora_args(p)  # --load-in-4bit: QLoRA, the frozen base in 4 bits (finetune/qlora.py)
    p.add_argument("--eval-every", type=int, default=100, help="validation loss every N steps (and at the end)")
    p.add_argument("--eval-batches", type=int, default=10,
                   help="held-out examples per evaluation: this many global batches of them (packed, in fewer blocks)")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="peak TFLOP/s of ONE GPU, for MFU (H100 SXM bf16: 989)")
    p.add_argument("--sample-tokens", type=int, default=32,
                   help="greedy answer to a held-out prompt at the end (0: none)")
    p.add_argument("--save-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="dtype of the exported model")
    p.add_argument("--seed", type=int, default=1234, help="shuffling and the held-out split")
    # NCCL's default is 10 minutes, while the main process tokenises alone and the others wait in a barrier.
    p.add_argument("--timeout", type=int, default=1800,
                   help="seconds a collective waits for a missing rank (the others wait while the main process "
                        "tokenises) before the run fails")
    add_run_args(p, "finetune_lm", log_every=10)
    args = p.parse_args(argv)
    if problem := (flags_without_rank(args, sys.argv[1:] if argv is None else argv) or without_lora(args)
                   or loss_chunking_problem(args) or flag_problem(args) or states_flag_problem(args)):
        p.error(problem)  # decided from the flags alone: before anything is imported or loaded
    return args


if __name__ == "__main__":
    parse_args()  # --help and a wrong flag answer here, before torch and the rest are imported (seconds)

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    broadcast,
    set_seed,
)
from torch.utils.data import DataLoader

from accelrun import Run, float8
from accelrun.engines import Engine, run_label
from accelrun.finetune.attention import block_mask, choose, device_problem, register
from accelrun.finetune.chunked_loss import install, token_losses, with_loss_count
from accelrun.finetune.examples import IGNORE, DataProblem, cut_note, load_examples
from accelrun.finetune.export import export
from accelrun.finetune.loss_flags import loss_chunking
from accelrun.finetune.optim_states import StatesCheck, optimizer_for
from accelrun.finetune.packing import attention_implementation, block_causal_mask, blocks_note
from accelrun.finetune.pretrained import load_config_and_tokenizer, load_model, zero3_lora_note
from accelrun.finetune.qlora import checked_base, dequantized_base
from accelrun.finetune.training import check_block_size, warmup_cosine
from accelrun.finetune.ulysses import SequenceParallel, host_count, in_loss, loss_targets
from accelrun.finetune.weights import base_fingerprint


def default_output_dir(args, accelerator):
    """runs/finetune_lm/<how it runs>, with -lora-r<R> for LoRA (-qlora-r<R> on a 4-bit base) and -padded for
    --no-packing: runs that train differently keep their own results."""
    lora = f"-{'q' if args.load_in_4bit else ''}lora-r{args.lora_r}" if args.lora_r else ""
    label = run_label(accelerator) + lora
    return os.path.join("runs", "finetune_lm", label + ("" if args.packing else "-padded"))


def build_optimizer(trainable, args, accelerator, run):
    """(AdamW over the trainable parameters with its moments in --optim-states' precision, the check of them after the
    first step: accelrun/finetune/optim_states.py); an engine that cannot keep them is refused in one line."""
    optimizer, problem = optimizer_for(trainable, args, Engine.of(accelerator))
    if problem:
        run.fail(problem)
    return optimizer, StatesCheck(args.optim_states, optimizer, accelerator, run.fail)


def check_sequence_parallel(sp, args, config, accelerator, run):
    """Under sequence parallelism (accelrun/finetune/ulysses.py): refuse, before data or model loads, what it cannot
    train (one line that says what to do)."""
    if problem := sp.problem(args, config, args.batch_size, args.grad_accum, accelerator.num_processes):
        run.fail(problem)


def load_data(args, run, accelerator, tokenizer):
    """The data's blocks of block_size tokens (accelrun.finetune.examples: train, validation, sample, format, source,
    cuts, facts)."""
    problem = None
    with accelerator.main_process_first():  # the main process tokenises and caches; the others reuse its cache
        try:  # a problem is reported after the block, by every rank: a rank leaving inside it strands the others
            examples = load_examples(args, tokenizer, args.block_size, args.eval_batches * args.batch_size)
        except DataProblem as exc:
            problem = str(exc)
    if problem:
        run.fail(problem)
    return examples


def prepare(accelerator, sp, micro, model, optimizer, train_loader, val_loader, scheduler):
    """accelerator.prepare() of them all; under sequence parallelism the loaders split by sequence-parallel group
    (accelrun/finetune/ulysses.py) and kept out of prepare(), which would wrap them in DeepSpeed's own adapter."""
    if sp.on:
        train_loader, val_loader = sp.prepare_loaders(train_loader, val_loader, accelerator, micro)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)  # accelerate
        return model, optimizer, train_loader, val_loader, scheduler
    return accelerator.prepare(model, optimizer, train_loader, val_loader, scheduler)  # accelerate


def flops_per_token(config, n_params, trained, args, span):
    """6 per weight in a matmul (the input embedding is a lookup) plus attention's 12 L d T, with T the
    token-weighted length of what a token attends over (an example's, when examples are kept apart; the block,
    for text). LoRA's frozen weights get no weight gradient: 4 each (forward, and the gradient of their input),
    6 per adapter weight."""
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    matmul = 6 * (n_params - embedding) if not args.lora_r else 4 * (n_params - embedding) + 6 * trained
    return matmul + 12 * config.num_hidden_layers * config.hidden_size * span


def forward_losses(model, batch, mask, head):
    """The forward and the loss: each sequence's summed next-token loss over its positions whose target is not
    IGNORE, and how many it has (fp32, as Hugging Face computes it). head: the output layer computing the loss in
    chunks (accelrun.finetune.chunked_loss), or None for the plain loss. Under sequence parallelism a batch is this
    rank's slice of each sequence, with its targets (accelrun.finetune.ulysses)."""
    return token_losses(model, model_inputs(batch, mask), loss_targets(batch), head, host_count(batch))


def model_inputs(batch, mask):
    """What the model is given for a batch of blocks: the tokens; for packed blocks also their positions, which
    restart at 0 in each example, and (mask) what keeps each example to itself, made from those positions on the
    device: the dense block-diagonal causal mask (packing.block_causal_mask, for SDPA) or the BlockMask
    (attention.block_mask, for flex); None: the model's own masks. Padded blocks and text: the tokens alone, and
    causal attention."""
    inputs = {"input_ids": batch["input_ids"]}
    if "position_ids" in batch:
        inputs["position_ids"] = batch["position_ids"]
        if mask is not None:
            inputs["attention_mask"] = mask(batch["position_ids"])
    return inputs


def with_step_tokens(batches, accelerator, grad_accum):
    """Each micro-batch with the number of loss tokens in its whole optimizer step: every micro-batch of the
    step on every rank. One small all-reduce per step, left on the device (no wait for the GPU)."""
    batches = iter(batches)
    while step := list(itertools.islice(batches, grad_accum)):
        tokens = sum(in_loss(batch) for batch in step)
        tokens = accelerator.reduce(tokens, "sum").clamp(min=1)  # accelerate
        for batch in step:
            yield batch, tokens


def evaluate(model, loader, accelerator, mask, head):
    """Mean next-token loss per loss token over the held-out examples in the loader: the training loss's
    definition."""
    model.eval()
    total = count = 0
    with torch.no_grad():
        for batch in loader:
            losses, tokens = forward_losses(model, batch, mask, head)
            # accelerate: drops the examples repeated to fill the last batch
            losses, tokens = accelerator.gather_for_metrics((losses, tokens))
            total, count = total + losses.sum(), count + tokens.sum()
    model.train()
    return {"val_loss": float(total / max(count, 1))}


def greedy_answer(model, accelerator, tokenizer, example, fmt, args):
    """The greedy answer to a held-out example's prompt (for text, its first quarter), for the summary. Every rank
    decodes (ZeRO-3 and FSDP gather weights collectively), rank 0's choices broadcast."""
    prompt_length = int((example["labels"] != IGNORE).nonzero()[0]) if fmt != "text" else args.block_size // 4
    prompt = example["input_ids"][:prompt_length]
    plain = accelerator.unwrap_model(model, keep_torch_compile=False)  # accelerate
    ids, new, logprobs = prompt[None].to(accelerator.device), [], []
    plain.eval()
    with torch.no_grad():
        for _ in range(args.sample_tokens):
            logp = F.log_softmax(plain(input_ids=ids).logits[0, -1].float(), dim=-1)
            nxt = broadcast(logp.argmax()[None])
            new.append(int(nxt))
            logprobs.append(float(logp[nxt]))
            ids = torch.cat([ids, nxt[None]], dim=1)
            if new[-1] == tokenizer.eos_token_id:
                break
    plain.train()
    return {"sample_prompt": tokenizer.decode(prompt), "sample_prompt_ids": prompt.tolist(),
            "sample": tokenizer.decode(new), "sample_token_ids": new, "sample_logprobs": logprobs}


def main(argv=None):
    args = parse_args(argv)
    # first: a stop may come during start-up; sequence parallelism is this recipe's (other recipes refuse it there)
    run = Run("finetune_lm", args, unit="tokens", may_change=AFTER_TRAINING, sequence_parallel=True)
    config, n_params, tokenizer, error = load_config_and_tokenizer(args.model)
    # Before from_pretrained: transformers reads ZeRO-3's settings from the Accelerator to load partitioned.
    accelerator = Accelerator(  # accelerate
        # Gradients sync every --grad-accum micro-batches, never at the loader's end: with_step_tokens reads a whole
        # step ahead, so the loader's end-of-data flag is up before the epoch's last step has begun (that step was
        # then cut in two). accelrun feeds whole steps only, and sets the counter on resume.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=args.grad_accum, sync_with_dataloader=False),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.timeout))],
        # non_blocking with pinned batches: the copy to the GPU is queued, the host does not wait for the GPU
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True, non_blocking=True))
    run.setup(accelerator, batch_size=args.batch_size, max_grad_norm=args.max_grad_norm,
              default_output_dir=default_output_dir(args, accelerator))
    set_seed(args.seed)
    # the model's config unreadable, --attention flex without CUDA, float8 with LoRA or 4 bits: before any loading
    if problem := (error or device_problem(args, accelerator.device.type)
                   or float8.flags_problem(accelerator, args.lora_r, args.load_in_4bit)):
        run.fail(problem)
    check_block_size(args, config, run.fail)
    sp = SequenceParallel.of(accelerator)  # Ulysses: each sequence split over a group of processes (or off)
    check_sequence_parallel(sp, args, config, accelerator, run)
    run.check_whole_model_fits(n_params)  # ZeRO-3 without zero3_init_flag loads it whole on every process
    data = load_data(args, run, accelerator, tokenizer)
    kind, attention, mask = attention_for(args, config, accelerator, data, sp, run)  # flex or sdpa, refused or not
    model, dtype = load_model(args, accelerator.mixed_precision, attention, engine=run.engine,
                              sharded_init=run.sharded_init, fail=run.fail)
    compiled = run.engine.compiles  # *_compile.yaml, fsdp_fp8.yaml: one graph, the plain loss
    chunks, chunk_tokens = loss_chunking(args)  # --loss-chunks N, or chunks of --loss-chunk-tokens loss positions
    head = install(model, chunks, compiled, chunk_tokens)  # the loss in chunks through the output layer, or None
    zero3_lora_note(args, run.engine, accelerator, n_params, dtype, run.print)
    # LoRA's checkpoints and adapter hold no base weights: they go with the base they adapt (checkpoint/rules.py)
    base = {"base_weights": base_fingerprint(args.model)} if args.lora_r else {}
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    trained = sum(getattr(p, "ds_numel", p.numel()) for p in trainable)  # ZeRO-3: the whole parameter's size
    micro = args.batch_size // args.grad_accum
    pin = accelerator.device.type == "cuda"
    # with_loss_count: each batch's loss positions counted on the CPU (the chunked loss keeps that many, no host wait)
    train_loader = DataLoader(data.train, batch_size=micro, shuffle=True, drop_last=True, pin_memory=pin,
                              collate_fn=with_loss_count)
    # The evaluated examples, read to the end; accelerate fills a short last batch: shapes stay static. Under
    # sequence parallelism whole sequences, split over all processes (a group's worth per micro-batch).
    val_loader = DataLoader(data.validation, batch_size=micro * sp.size, pin_memory=pin, collate_fn=with_loss_count)
    optimizer, states = build_optimizer(trainable, args, accelerator, run)  # AdamW, its moments as --optim-states
    steps_per_epoch = len(train_loader) // args.grad_accum
    if steps_per_epoch == 0:
        run.fail(f"{len(data.train)} training blocks ({data.facts['train_examples']} examples) do not fill one "
                 f"global batch of {args.batch_size}")
    scheduler = warmup_cosine(optimizer, args)
    model, optimizer, train_loader, val_loader, scheduler = prepare(
        accelerator, sp, micro, model, optimizer, train_loader, val_loader, scheduler)
    facts = data.facts
    four_bit = checked_base(args, model, accelerator, run.fail)  # QLoRA: what each process holds of the 4-bit base
    # tokens/s and MFU count real tokens: a block's mean of them, not its positions
    run.start(model, optimizer, scheduler, steps_per_epoch=steps_per_epoch, total_steps=args.max_steps,
              units_per_sample=facts["real_tokens_per_block"], peak_tflops=args.peak_tflops,
              flops_per_unit=flops_per_token(config, n_params, trained, args, facts["attention_span"]),
              eval_every=args.eval_every, evaluate=lambda: evaluate(model, val_loader, accelerator, mask, head),
              describe=f"{args.model}: {n_params / 1e6:.3g} M parameters{four_bit} | {data.format}: {data.source}, "
                       f"{blocks_note(facts, data.format, args.block_size)}, {100 * facts['loss_positions_share']:.0f}%"
                       f" of positions in the loss{cut_note(data.cuts, data.format, args.block_size)}"
                       f"{', flex attention' if kind == 'flex' else ''}",
              data_facts={"source": data.source, "data_format": data.format, "train_examples": facts["train_examples"],
                          **base})

    # The loss is the mean over every loss token of the optimizer step, whatever the micro-batch and the rank:
    # each micro-batch's summed loss over the step's token count, times what backward() then divides by
    # (the micro-batches per step, and the processes whose gradients are averaged; under sequence parallelism
    # each rank's slice of the sequences: accelrun/finetune/ulysses.py).
    undo_means = accelerator.num_processes * args.grad_accum
    model.train()  # from_pretrained returns the model in eval mode: dropout off, and Ulysses bypassed (disable_in_eval)
    for batches in run.epochs(train_loader):  # resumes mid-epoch; checkpoints at each epoch's end
        for batch, step_tokens in with_step_tokens(map(sp.shard, batches), accelerator, args.grad_accum):
            with accelerator.accumulate(model):  # accelerate
                losses, _ = forward_losses(model, batch, mask, head)
                loss = losses.sum() * undo_means / step_tokens
                accelerator.backward(loss)  # accelerate
                if accelerator.sync_gradients and args.max_grad_norm > 0:  # accelerate
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # accelerate
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if run.step(loss):  # a stop signal, or the last step
                break
    return finish(run, model, accelerator, tokenizer, data, args, dtype, trained, base, kind, states.summary(optimizer))


def attention_for(args, config, accelerator, data, sp, run):
    """(--attention's choice, flex or sdpa; the attn_implementation to load the model with; the mask model_inputs
    makes for a packed batch), once the data says whether blocks are packed; a run flex or Ulysses cannot train is
    refused here in one line, before the model loads. flex: attention.FLEX and its BlockMask; sdpa:
    packing.GIVEN_MASK and the dense block-diagonal mask, or None and the model's own masks where it builds them (a
    sliding window); under sequence parallelism the attention Ulysses wraps, and no mask."""
    kind, problem = choose(args, config, accelerator.device.type, data.facts["packing"], sp.on)
    if problem or (sp.on and data.facts["packing"]):
        run.fail(problem or sp.packing_problem())
    if sp.on:
        return kind, sp.attention, None
    if kind == "flex":
        return kind, register(), block_mask
    attention = attention_implementation(config, args.block_size)
    return kind, attention, block_causal_mask if attention is not None else None


def finish(run, model, accelerator, tokenizer, data, args, dtype, trained, base, kind, states):
    """The greedy answer to a held-out prompt, then run.finish: the export and the summary (with the data's facts and
    states, the optimizer states' fields)."""
    sample, dequantized = {}, {}
    if args.sample_tokens and not run.stopping:
        sample = greedy_answer(model, accelerator, tokenizer, data.sample, data.format, args)
        run.print(f"greedy answer to {sample['sample_prompt']!r}: {sample['sample']!r}")
    if args.load_in_4bit and args.merge_lora and not run.stopping:  # QLoRA's merge: every rank gathers the 4-bit base
        dequantized = dequantized_base(accelerator.unwrap_model(model), accelerator.is_main_process)  # accelerate
    lora = {"lora_r": args.lora_r, "trainable_params": trained, "quantized_base": "nf4" if args.load_in_4bit else None,
            "frozen_dtype": str(dtype).removeprefix("torch.") if args.lora_r else None}
    return run.finish(model, export=functools.partial(export, model=model, accelerator=accelerator,
                                                      tokenizer=tokenizer, args=args, output_dir=run.output_dir,
                                                      base_weights=base.get("base_weights"), dequantized=dequantized),
                      attention=kind, **states,
                      exported_dtype=args.save_dtype, base_model=args.model, data_format=data.format,
                      data_source=data.source, block_size=args.block_size,
                      gradient_checkpointing=args.gradient_checkpointing, **data.facts, **lora, **sample, **data.cuts)


if __name__ == "__main__":
    sys.exit(main())
