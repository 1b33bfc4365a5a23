"""Preference fine-tuning (DPO) of a pretrained Hugging Face causal LM on records {prompt, chosen, rejected}.

    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/dpo.py --model ./my-llama-8b-sft \\
        --data-files prefs.jsonl --lora-r 16 --lr 5e-6 --block-size 2048 --batch-size 32 --gradient-checkpointing
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/dpo.py --model ./my-llama-70b-sft \\
        --data-files prefs.jsonl --lora-r 16 --load-in-4bit --gradient-checkpointing --precompute-ref   # QLoRA
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml recipes/dpo.py \\
        --model meta-llama/Llama-3.2-1B-Instruct --data-files prefs.jsonl --precompute-ref   # full fine-tune
    python -m accelrun.data.tiny_hf /tmp/tiny && python -c "from accelrun.finetune.preference import \\
        write_toy_pairs; write_toy_pairs('/tmp/tiny/prefs.jsonl')" && OMP_NUM_THREADS=1 python recipes/dpo.py \\
        --model /tmp/tiny/model --data-files /tmp/tiny/prefs.jsonl --lora-r 8 --block-size 32 --batch-size 16 \\
        --max-steps 60 --lr 1e-2 --beta 0.5 --output-dir runs/tiny-dpo   # CPU

The loss (TRL's sigmoid DPO): -log sigmoid(beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) -
log ref(rejected)))), each log-probability summed over the response's tokens only (a chat's assistant turns after
the prompt and their end-of-turn tokens; a text response and its end-of-sequence token). At the first step the policy
is the reference: every pair's loss is ln 2 = 0.6931. A pair's chosen and rejected sequences are in the same batch on
the same rank (finetune/preference.py). Records: JSON Lines of text, or of chat messages rendered with the model's
chat template; a record missing a field, or a prompt that leaves no room for a response in --block-size, is named by
its file and line.

The reference: with --lora-r (and --load-in-4bit, QLoRA) the same model with its adapters disabled (one base in
memory); for a full fine-tune a frozen copy of --model in the compute dtype, loaded and sharded as the policy is
(ZeRO-3 partitioned, FSDP2 sharded, whole elsewhere) and prepared for inference only; with --precompute-ref a table
of every pair's reference log-probabilities computed in one pass before the first step (by the policy before it
trains, or with its adapters disabled), so that no reference model is held while training. A resumed run computes
the table again, exactly: with the adapters disabled, or for a full fine-tune from a frozen copy loaded for that
pass alone (under every engine). The data's and --model's fingerprints are part of what a resume must share.

Reports: the progress line and metrics.jsonl carry each optimizer step's rewards (chosen, rejected, their margin,
and the accuracy: the share of pairs whose chosen reward is higher), summed over the step's micro-batches and all
ranks; eval.jsonl and summary.json val_loss and val_reward_* on held-out pairs (gather_for_metrics: exact over ranks).
Model loading, LoRA, QLoRA, the chunked loss, checkpoints (exact mid-epoch resume, on another world size too), the
export (OUTPUT_DIR/adapter in PEFT's format, --merge-lora also OUTPUT_DIR/model) and the results directory rules are
finetune_lm.py's (accelrun.finetune). The default OUTPUT_DIR is runs/dpo/<how it runs>, with -lora-r<R> for LoRA
(-qlora-r<R>).

Result: loss 0.6931 to 0.264, held-out reward accuracy 90% (CPU command), measured 2026-11-28, CPU (docs/recipes.md).
"""

import argparse
import contextlib
import functools
import gc
import os
import sys
from datetime import timedelta

from accelrun import add_run_args
from accelrun.finetune.lora import add_lora_args, flags_without_rank
from accelrun.finetune.loss_flags import add_loss_args, loss_chunking_problem
from accelrun.finetune.preference import add_preference_data_args
from accelrun.finetune.qlora import add_qlora_args, without_lora
from accelrun.flags import DefaultOnce

# Flags a resumed run may change: they act after training or only on what is reported.
AFTER_TRAINING = {"save_dtype": "the exported model", "merge_lora": "the exported model",
                  "timeout": "how long a collective may wait"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False, formatter_class=DefaultOnce)
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct",
                   help="hub id, or a local directory written by save_pretrained (usually a supervised fine-tune)")
    add_preference_data_args(p)  # --data-files or --dataset (finetune/preference.py)
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per sequence (prompt and response), at most the model's context (default: 1024, or "
                        "the context if shorter)")
    p.add_argument("--beta", type=float, default=0.1,
                   help="DPO's beta: how far the policy may move from the reference (the rewards' scale)")
    p.add_argument("--precompute-ref", action="store_true",
                   help="compute every pair's reference log-probabilities once before training, so that no reference "
                        "forward runs in the steps (and a full fine-tune holds no frozen copy of --model)")
    p.add_argument("--max-steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch in pairs, split across processes")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=5e-6, help="peak AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, default=10, help="linear warm-up, then cosine decay to lr/10")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (not on biases and norms)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm (0: no clipping)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute each layer in backward")
    add_loss_args(p)  # --loss-chunk-tokens, --loss-chunks (accelrun/finetune/loss_flags.py, chunked_loss.py)
    add_lora_args(p)  # --lora-r and the adapters' settings (finetune/lora.py); OUTPUT_DIR gets -lora-r<R>
    add_qlora_args(p)  # --load-in-4bit: QLoRA, the frozen base in 4 bits (finetune/qlora.py)
    p.add_argument("--eval-every", type=int, default=50,
                   help="held-out loss and rewards every N steps (and at the end)")
    p.add_argument("--eval-batches", type=int, default=4,
                   help="held-out pairs per evaluation: this many global batches")
    p.add_argument("--save-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="dtype of the exported model")
    p.add_argument("--seed", type=int, default=1234, help="shuffling and the held-out split")
    p.add_argument("--timeout", type=int, default=1800,
                   help="seconds a collective waits for a missing rank before the run fails")
    add_run_args(p, "dpo", log_every=10)
    args = p.parse_args(argv)
    if problem := (flags_without_rank(args, sys.argv[1:] if argv is None else argv) or without_lora(args)
                   or loss_chunking_problem(args)):
        p.error(problem)  # decided from the flags alone: before anything is imported or loaded
    return args


if __name__ == "__main__":
    parse_args()  # --help and a wrong flag answer here, before torch and the rest are imported (seconds)

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader

from accelrun import Run, float8
from accelrun.engines import run_label
from accelrun.finetune.chunked_loss import install
from accelrun.finetune.examples import DataProblem
from accelrun.finetune.export import export
from accelrun.finetune.loss_flags import loss_chunking
from accelrun.finetune.packing import attention_implementation
from accelrun.finetune.preference import (
    StepRewards,
    collate,
    disabled_adapter_logps,
    dpo_losses,
    evaluate_pairs,
    frozen_copy_logps,
    load_pairs,
    precompute_reference,
    sequence_logps,
)
from accelrun.finetune.pretrained import load_config_and_tokenizer, load_model
from accelrun.finetune.qlora import checked_base, dequantized_base
from accelrun.finetune.training import adamw, check_block_size, warmup_cosine
from accelrun.finetune.weights import base_fingerprint


def default_output_dir(args, accelerator):
    """runs/dpo/<how it runs>, with -lora-r<R> for LoRA (-qlora-r<R> on a 4-bit base)."""
    lora = f"-{'q' if args.load_in_4bit else ''}lora-r{args.lora_r}" if args.lora_r else ""
    return os.path.join("runs", "dpo", run_label(accelerator) + lora)


def load_data(args, run, accelerator, tokenizer):
    """The preference pairs (finetune/preference.py), a problem reported by every rank after the block."""
    problem = None
    with accelerator.main_process_first():
        try:
            pairs = load_pairs(args, tokenizer, args.block_size, args.eval_batches * args.batch_size)
        except DataProblem as exc:
            problem = str(exc)
    if problem:
        run.fail(problem)
    return pairs


def frozen_reference(args, run, accelerator, attention, chunking):
    """A full fine-tune's reference: a frozen copy of --model in the compute dtype (it needs no fp32 master), loaded
    the same sharded way as the policy (run.sharded_init: partitioned while loaded under ZeRO-3, the main process's
    copy under FSDP2) and placed for inference only as the engine holds a model (engine.prepare_frozen: FSDP2 shards
    it as the policy, ZeRO-3 gives it a DeepSpeed engine of its own without an optimizer, the others hold it
    whole), outside accelerator.prepare()."""
    from transformers import AutoModelForCausalLM

    from accelrun.finetune.pretrained import NO_CODE
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    with run.sharded_init(from_pretrained=True):
        model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(args.model), dtype=dtype,
                                                     attn_implementation=attention, **NO_CODE)
    model.requires_grad_(False).eval()
    model.config.use_cache = False
    head = install(model, *chunking)  # the policy's chunked loss: no whole logits in fp32
    model = run.engine.prepare_frozen(model)  # sharded as the policy is, outside prepare() (accelrun/engines)
    model.eval()
    autocast = accelerator.autocast if run.engine.autocasts else contextlib.nullcontext  # accelerate: as the policy's
    return functools.partial(frozen_copy_logps, model, head=head, autocast=autocast)


def reference_of(args, run, model, accelerator, loaders, size, head, attention, chunking):
    """What gives each batch its reference log-probabilities: LoRA's disabled adapters; a full fine-tune's frozen
    copy of --model (frozen_reference); or with --precompute-ref a table computed now from one of them (by the
    policy before its first step where it is still the reference: a full fine-tune's first start; a resumed full
    fine-tune computes it again from a frozen copy, loaded for that pass only, under every engine)."""
    plain = accelerator.unwrap_model(model, keep_torch_compile=False)  # accelerate
    if args.lora_r:
        on_the_fly = functools.partial(disabled_adapter_logps, model, plain, head=head)
    elif args.precompute_ref and not run.facts.get("resumed_from_step"):  # the policy is still the reference
        on_the_fly = functools.partial(sequence_logps, model, head=head)
    else:
        on_the_fly = frozen_reference(args, run, accelerator, attention, chunking)
    if not args.precompute_ref:
        return on_the_fly
    model.eval()
    table = precompute_reference(on_the_fly, loaders, accelerator, size)
    model.train()
    del on_the_fly  # a frozen copy loaded for this pass is freed: no reference model is held while training
    gc.collect()
    run.print(f"reference log-probabilities of {size} pairs computed")
    return lambda batch: table[batch["index"]].T.reshape(-1)


def reference_kind(args):
    """The summary's and the first line's name for where the reference comes from."""
    return "precomputed" if args.precompute_ref else "adapters disabled" if args.lora_r else "frozen copy"


def pair_losses(model, batch, head, reference, beta):
    """Each pair's DPO loss and its chosen and rejected rewards: the policy's log-probabilities against the
    reference's (finetune/preference.py)."""
    return dpo_losses(sequence_logps(model, batch, head), reference(batch), beta)


def step_rewards(rewards, chosen, rejected):
    """The optimizer step's reward figures for run.step ({} inside an accumulation): collective at its end."""
    return rewards.add(chosen, rejected)


def main(argv=None):
    args = parse_args(argv)
    run = Run("dpo", args, unit="tokens", may_change=AFTER_TRAINING)  # first: a stop may come during start-up
    config, n_params, tokenizer, error = load_config_and_tokenizer(args.model)
    accelerator = Accelerator(  # accelerate
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=args.grad_accum, sync_with_dataloader=False),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.timeout))],
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True, non_blocking=True))
    run.setup(accelerator, batch_size=args.batch_size, max_grad_norm=args.max_grad_norm,
              default_output_dir=default_output_dir(args, accelerator))
    set_seed(args.seed)
    if problem := error or float8.flags_problem(accelerator, args.lora_r, args.load_in_4bit):  # float8: full only
        run.fail(problem)
    check_block_size(args, config, run.fail)
    run.check_whole_model_fits(n_params)
    data = load_data(args, run, accelerator, tokenizer)
    attention = attention_implementation(config, args.block_size)
    model, dtype = load_model(args, accelerator.mixed_precision, attention, engine=run.engine,
                              sharded_init=run.sharded_init, fail=run.fail)
    chunks, chunk_tokens = loss_chunking(args)  # --loss-chunks N, or chunks of --loss-chunk-tokens loss positions
    chunking = (chunks, run.engine.compiles, chunk_tokens)
    head = install(model, *chunking)
    # LoRA's frozen base, and a full fine-tune's reference (loaded again on resume), are --model's weights: a resume
    # checks them (LoRA's under finetune_lm's name and refusal; a full fine-tune's as one more setting that differs)
    base = {"base_weights" if args.lora_r else "reference_weights": base_fingerprint(args.model)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    trained = sum(getattr(p, "ds_numel", p.numel()) for p in trainable)
    micro = args.batch_size // args.grad_accum
    train_loader = DataLoader(data.train, batch_size=micro, shuffle=True, drop_last=True, collate_fn=collate)
    val_loader = DataLoader(data.validation, batch_size=micro, collate_fn=collate)
    every_pair = DataLoader(data.train, batch_size=micro, collate_fn=collate)  # a precomputed reference: none dropped
    if len(train_loader) // args.grad_accum == 0:
        run.fail(f"{len(data.train)} training pairs do not fill one global batch of {args.batch_size}")
    optimizer = adamw(trainable, args)
    scheduler = warmup_cosine(optimizer, args)
    model, optimizer, train_loader, val_loader, scheduler, every_pair = accelerator.prepare(  # accelerate
        model, optimizer, train_loader, val_loader, scheduler, every_pair)
    four_bit = checked_base(args, model, accelerator, run.fail)
    reference = None  # set after run.start: a resumed run computes a precomputed table again

    def evaluate():
        return evaluate_pairs(model, val_loader, accelerator, reference, args.beta, head)
    run.start(model, optimizer, scheduler, steps_per_epoch=len(train_loader) // args.grad_accum,
              total_steps=args.max_steps, units_per_sample=2 * data.facts["real_tokens_per_row"],
              eval_every=args.eval_every, evaluate=evaluate,
              describe=f"{args.model}: {n_params / 1e6:.3g} M parameters{four_bit} | DPO beta {args.beta}, reference: "
                       f"{reference_kind(args)} | "
                       f"{data.format} pairs: {data.source}, {data.cuts['pairs']} pairs, {data.cuts['cut_pairs']} "
                       f"cut at --block-size {args.block_size}",
              data_facts={"source": data.source, "train_pairs": data.facts["train_pairs"],
                          "data_sha256": data.facts["data_sha256"], **base})
    reference = reference_of(args, run, model, accelerator, (every_pair, val_loader), data.cuts["pairs"], head,
                             attention, chunking)
    rewards = StepRewards(accelerator)  # each optimizer step's rewards, over its micro-batches and the ranks
    model.train()
    for batches in run.epochs(train_loader):  # resumes mid-epoch; checkpoints at each epoch's end
        for batch in batches:
            with accelerator.accumulate(model):  # accelerate
                losses, chosen, rejected = pair_losses(model, batch, head, reference, args.beta)
                loss = losses.mean()  # of the micro-batch; backward averages over micro-batches and ranks
                accelerator.backward(loss)  # accelerate
                if accelerator.sync_gradients and args.max_grad_norm > 0:  # accelerate
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # accelerate
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if run.step(loss, **step_rewards(rewards, chosen, rejected)):  # a stop signal, or the last step
                break
    return finish(run, model, accelerator, tokenizer, data, args, dtype, trained, base)


def finish(run, model, accelerator, tokenizer, data, args, dtype, trained, base):
    """run.finish: the export and the summary (with the data's facts and the LoRA settings)."""
    dequantized = {}
    if args.load_in_4bit and args.merge_lora and not run.stopping:  # QLoRA's merge: every rank gathers the 4-bit base
        dequantized = dequantized_base(accelerator.unwrap_model(model), accelerator.is_main_process)  # accelerate
    lora = {"lora_r": args.lora_r, "trainable_params": trained, "quantized_base": "nf4" if args.load_in_4bit else None,
            "frozen_dtype": str(dtype).removeprefix("torch.") if args.lora_r else None}
    return run.finish(model, export=functools.partial(export, model=model, accelerator=accelerator,
                                                      tokenizer=tokenizer, args=args, output_dir=run.output_dir,
                                                      base_weights=base.get("base_weights"), dequantized=dequantized),
                      exported_dtype=args.save_dtype, base_model=args.model, data_format=data.format,
                      data_source=data.source, block_size=args.block_size, beta=args.beta,
                      reference=reference_kind(args),
                      gradient_checkpointing=args.gradient_checkpointing, **data.cuts, **data.facts, **lora)


if __name__ == "__main__":
    sys.exit(main())
