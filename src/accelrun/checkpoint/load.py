"""Loading the checkpoint choose.py verified and holds into the prepared model, optimizer and scheduler.

Owns the load (docs/checkpoints.md, "What a checkpoint can and cannot do"): every rank calls it, as accelerate's
load_state is collective under DeepSpeed and FSDP. It reads only the files every rank verified, through the held
checkpoint's view (held.HeldCheckpoint: links to the descriptors held since their check, never the paths again),
under weights-only loading (safe_loading.py), a ZeRO checkpoint of another world size through its universal part
(resharding.py), each rank's own state by rules.PER_RANK; a load that fails is one error naming the checkpoint, and
a verified file replaced at its path meanwhile is one warning (the run read the verified one).
"""

import os
import sys
import time

from torch.distributed.checkpoint.api import CheckpointException  # FSDP's sharded loads raise it

from ..exits import report
from .resharding import (
    load_rank_buffers,
    loading_universal,
    needs_universal,
    reshaped_window,
    rng_for_new_rank,
    set_micro_batch_counter,
    universal_part,
)
from .rules import reshaped
from .safe_loading import UnsafeCheckpointFile, weights_only_loading


def load(scope, model, load_kwargs, held, path, manifest, verify_s):
    """Collective: load the checkpoint at `path` that choose() returned and `held` holds into the prepared objects
    (load_kwargs: load_state's, the frozen-weights rule's), reading only the files it verified; returns (its
    training state, as this run's ranks carry it; what the resume changed, the rules that applied; seconds it took).
    verify_s: how long the choice and its checks took, for the line. The held files are let go."""
    acc, universal = scope.accelerator, None
    started = time.perf_counter()
    try:
        universal = universal_part(acc, held, manifest) if needs_universal(manifest, scope.layout) else None
        source = held.view()
        with weights_only_loading(), loading_universal(model, universal and universal.view()):
            acc.load_state(source, **load_kwargs)  # under weights-only loading again: a file that
            rng_for_new_rank(acc, source, manifest)  # changed since its check runs no code either
        load_rank_buffers(acc, model, source)
    # ValueError: a universal checkpoint that does not fit this model (DeepSpeed's loader, and ours); a DCP entry
    # of another kind. RuntimeError: a state dict that does not fit (a strict load). The exit makes the launcher
    # stop the others.
    except (UnsafeCheckpointFile, CheckpointException, ValueError, RuntimeError) as exc:
        message = _first_failure(exc).replace(held.view(), path)
        report(f"checkpoint {path} cannot be loaded: {message}. Remove it, or resume from another one.",
               acc.is_main_process or not isinstance(exc, CheckpointException))  # DCP's: every rank raises it
        sys.exit(2)
    finally:
        if universal:
            universal.close()
    set_micro_batch_counter(acc, manifest["step"])
    load_s = time.perf_counter() - started
    notes = reshaped(manifest, scope.layout)
    _loaded(acc, held, path, manifest, notes, (verify_s, load_s))
    state = manifest["train_state"]
    if state.get("window"):  # written by another world size or --grad-accum: rules.PER_RANK
        state = {**state, "window": reshaped_window(state["window"], manifest, scope.layout)}
    return state, notes, load_s


def _loaded(acc, held, path, manifest, notes, seconds):
    """After the load: the lines that say what was loaded, and a warning naming a verified file that was replaced
    while the run read the checkpoint (the run read the verified one); the held files let go."""
    replaced = held.replaced() if acc.is_main_process else []
    held.close()
    if not acc.is_main_process:
        return
    verify_s, load_s = seconds
    writers = manifest["layout"]["world_size"]
    print(f"resumed from {path} (step {manifest['step']}, written by {writers} process{'es' if writers != 1 else ''}"
          f"; checksums and formats checked by {acc.num_processes} rank(s) in "
          f"{verify_s:.1f} s, loaded in {load_s:.1f} s)", flush=True)
    for note in notes:
        print(f"resumed on another shape: {note}", flush=True)
    if replaced:
        print(f"warning: checkpoint {path} changed while this run read it: {replaced[0]} was replaced after "
              f"it was verified (this run read the verified file; the next resume will refuse the checkpoint). "
              f"Someone else writes there: check {os.path.dirname(path)}", file=sys.stderr, flush=True)


def _first_failure(exc):
    """The first line of what went wrong in a load: for torch.distributed.checkpoint's CheckpointException, the first
    failing rank's own exception (its message is otherwise the list of ranks)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]
