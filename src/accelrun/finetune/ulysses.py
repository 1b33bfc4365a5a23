"""Ulysses sequence parallelism (DeepSpeed's, driven by accelerate's parallelism_config): what finetune_lm.py needs
so that one sequence runs on several processes and trains exactly as on one.

What accelerate and DeepSpeed do, from the config (accelerate_configs/deepspeed_zero3_sp2.yaml): prepare() registers
DeepSpeed's Ulysses attention in place of the model's SDPA (two all-to-alls per layer swap the split from tokens to
heads and back) and builds the sequence-parallel groups, S consecutive ranks each (DeepSpeed's parallel_state_sp);
ZeRO still shards over every process.

What this module owns, on top:
  * SequenceParallel.of(accelerator): the size S (1: off) and the data-parallel size D = processes / S, as the run's
    engine says (engines.Engine.sequence_parallel and readers: one source of truth), and this rank's place in its
    group;
  * the refusals: before data or model loads (problem) a --block-size the S processes cannot split evenly, a model
    whose attention heads they cannot split, a batch that does not divide over D data-parallel ranks x --grad-accum;
    once the data is read, packed examples (packing_problem: SDPA under Ulysses attends over the whole block, so
    packed examples would see each other);
  * the training data: every rank of a group reads the same sequences (the loader is split over the D
    data-parallel groups, not over all processes: prepare_loaders), and keeps its own slice of their tokens
    (shard: the positions, which give the rotary embedding its place in the whole sequence, and each position's
    next-token target, cut before the slicing so that the slice's last token still has its target);
  * nothing for the loss: each rank's loss is the sum over its slice's loss positions, scaled as in any run
    (finetune_lm.py: x processes x --grad-accum / the step's loss tokens, counted on every rank's slice). DeepSpeed
    divides the gradients' sum by processes / S, and the all-to-alls' backward brings each rank the gradient of
    the other slices' losses through its attention: the step's gradient is the token-weighted mean's, measured
    equal to one process's whole-sequence gradient (lm_head and embedding norms to 7 digits, 2026-11-26).

Evaluation and the greedy answer are not sequence-parallel: accelerate registers Ulysses with disable_in_eval, so an
evaluated model attends over each rank's own whole sequences, split over all processes as in any data-parallel run.
It makes no collective call itself.
"""

from dataclasses import dataclass

import torch

from accelrun.engines import Engine
from accelrun.finetune.chunked_loss import IGNORE, LOSS_COUNT, next_token_targets


@dataclass(frozen=True)
class SequenceParallel:
    size: int = 1  # processes that share one sequence (S); 1: sequence parallelism is off
    rank: int = 0  # this process's place in its group: it keeps the rank-th slice of each sequence
    data_parallel: int = 1  # groups reading different data (D = processes / S)
    data_rank: int = 0  # this process's group
    attention: str = "sdpa"  # the attention implementation the config names (Ulysses wraps it)

    @classmethod
    def of(cls, accelerator):
        """What the launch set up, as the run's engine says (engines.Engine: its sequence-parallel size and its
        data-parallel readers, processes / the size)."""
        engine, rank = Engine.of(accelerator), accelerator.process_index
        size = engine.sequence_parallel
        if size <= 1:
            return cls(data_parallel=engine.readers, data_rank=rank)
        return cls(size, rank % size, engine.readers, rank // size, engine.sequence_parallel_attention)

    @property
    def on(self):
        return self.size > 1

    def problem(self, args, config, batch_size, grad_accum, world):
        """None, or the one line that refuses this run under sequence parallelism, and what to do."""
        if not self.on:
            return None
        where = f"under sequence parallelism of size {self.size} (parallelism_config_sp_size)"
        if world % self.size:
            return f"{world} processes do not split into groups of {self.size} {where}: launch a multiple of " \
                   f"{self.size}"
        if args.block_size % self.size:
            return f"--block-size {args.block_size} does not split into {self.size} equal slices {where}: give a " \
                   f"multiple of {self.size}"
        heads = getattr(config, "num_attention_heads", 0)
        if heads % self.size:
            return f"{args.model} has {heads} attention heads, which {self.size} processes cannot share {where}: " \
                   f"use sequence parallelism of a size that divides {heads}"
        if batch_size % (self.data_parallel * grad_accum):
            good = self.data_parallel * grad_accum
            return f"--batch-size {batch_size} must divide by data-parallel ranks x --grad-accum = {good} {where} " \
                   f"({world} processes / {self.size}): give --batch-size {max(good, batch_size // good * good)}"
        return None

    def packing_problem(self):
        """The refusal of packed examples, once the data says they are packed (pairs and chat, not text)."""
        return (f"packed examples cannot be kept apart under sequence parallelism of size {self.size}: Ulysses "
                f"discards the block-diagonal mask and SDPA attends over the whole block. Give --no-packing (one "
                f"example per block, padded), or plain text")

    def prepare_loaders(self, train_loader, val_loader, accelerator, micro):
        """(train, validation) prepared as accelerator.prepare() prepares them (accelerate's prepare_data_loader: the
        seedable sampler, global batches split, batches put on the device), but the training loader split over the
        D data-parallel groups, not over every process: every rank of a group reads the same sequences. Call before
        prepare(model, ...), and keep both loaders out of that call: accelerate would wrap them in DeepSpeed's
        UlyssesSPDataLoaderAdapter, which runs each rank's batch on the whole group in turn. DeepSpeed and Ulysses
        are told the micro-batch a rank really runs (micro // D sequences, its slice of each), which accelerate
        would otherwise read from the loaders."""
        from accelerate.data_loader import prepare_data_loader
        Engine.of(accelerator).tell_micro_batch(micro // self.data_parallel)
        train = prepare_data_loader(train_loader, accelerator.device, num_processes=self.data_parallel,
                                    process_index=self.data_rank, split_batches=True, put_on_device=True,
                                    rng_types=accelerator.rng_types.copy(), use_seedable_sampler=True,
                                    non_blocking=accelerator.non_blocking,
                                    data_seed=accelerator.dataloader_config.data_seed)
        return train, accelerator.prepare_data_loader(val_loader)

    def shard(self, batch):
        """This rank's slice of a batch of whole sequences: its tokens, their positions in the whole sequence and
        their next-token targets (labels dropped: the slice's targets replace them)."""
        if not self.on:
            return batch
        ids = batch["input_ids"]
        length = ids.shape[1] // self.size
        cut = slice(self.rank * length, (self.rank + 1) * length)
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return {"input_ids": ids[:, cut], "position_ids": positions[:, cut],
                "targets": next_token_targets(batch["labels"])[:, cut]}


def loss_targets(batch):
    """Each position's next-token target: the batch's own after shard(), else from its labels."""
    return batch["targets"] if "targets" in batch else next_token_targets(batch["labels"])


def host_count(batch):
    """The batch's loss positions counted on the host (chunked_loss.with_loss_count), or None after shard()."""
    return None if "targets" in batch else batch.get(LOSS_COUNT)


def in_loss(batch):
    """A batch's positions in the loss (its targets that are not IGNORE), on the device."""
    return (loss_targets(batch) != IGNORE).sum()
