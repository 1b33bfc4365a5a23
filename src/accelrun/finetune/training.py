"""What the fine-tune recipes (finetune_lm.py, dpo.py) set up the same way around their loops: --block-size checked
against the model's context (check_block_size), AdamW with weight decay on the matrices only (adamw), and the linear
warm-up then cosine decay of the learning rate (warmup_cosine). It makes no distributed call.
"""

import math

import torch


def check_block_size(args, config, fail):
    """--block-size, by default the model's context up to 1024; refused when longer than the context (fail: one line,
    every rank exits 2: run.fail)."""
    context = getattr(config, "max_position_embeddings", None)
    if args.block_size is None:  # the default fits the model
        args.block_size = min(1024, context or 1024)
    if context and args.block_size > context:
        fail(f"--block-size {args.block_size} is longer than {args.model}'s context of {context} tokens; give less")


def adamw(trainable, args):
    """AdamW with weight decay on the matrices only, not on biases and norms."""
    matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in trainable]  # ZeRO-3: the full shape
    decay, flat = ([p for p, m in zip(trainable, matrix) if m == want] for want in (True, False))
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": flat, "weight_decay": 0.0}]  # no decay on biases and norms
    # No empty group (LoRA's adapters are all matrices): DeepSpeed drops it, and the scheduler would then
    # hold one learning rate too many.
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr, betas=(0.9, 0.95), fused=True)


def warmup_cosine(optimizer, args):
    """Linear warm-up over --warmup-steps, then cosine decay from --lr to lr/10 at --max-steps."""
    def schedule(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(args.max_steps - args.warmup_steps, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
