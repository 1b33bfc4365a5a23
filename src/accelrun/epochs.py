"""The epoch loop a resumed run re-enters mid-epoch, exactly: the same shuffle, the steps it already holds skipped,
whole optimizer steps only, and no draw from torch's global RNG that the uninterrupted run did not make.

Run.epochs() iterates it; docs/writing-a-recipe.md ("A loop without accelrun") shows the same in a few lines.
"""

import itertools

import torch


def resumable_epochs(accelerator, loader, progress, epochs, steps_per_epoch, grad_accum=1, seed=0):
    """Yield (epoch, optimizer steps already done in it, micro-batch iterator), resuming mid-epoch exactly.

    set_epoch makes the shuffle depend on (seed, epoch) only, so a resumed run sees the same order,
    and skip_first_batches fast-forwards through what the checkpoint already holds. islice stops at
    a whole number of optimizer steps: --grad-accum never makes a short step.

    Each epoch's loader draws its workers' base seed from a generator of its own, seeded by seed + epoch.
    Without one it draws from torch's global RNG when its iterator starts: at the epoch's start in the
    uninterrupted run, at the resume point in a resumed one, which would shift every random number after
    it (dropout masks) against the checkpoint's restored RNG state.
    """
    for epoch in range(progress["epoch"], epochs):
        loader.set_epoch(epoch)
        done = progress["step_in_epoch"] if epoch == progress["epoch"] else 0
        batches = accelerator.skip_first_batches(loader, done * grad_accum) if done else loader
        getattr(batches, "base_dataloader", batches).generator = torch.Generator().manual_seed(seed + epoch)
        yield epoch, done, itertools.islice(batches, (steps_per_epoch - done) * grad_accum)
