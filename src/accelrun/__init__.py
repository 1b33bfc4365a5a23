"""The run services the recipes share; not a recipe (the recipes are the .py files one folder up).

docs/writing-a-recipe.md is the contract a recipe relies on. One module per concern:

    run.py                      Run: the object a recipe's loop calls; the façade over the modules below
    run_parts.py                the parts Run holds: the batch, throughput, terminal, clock and evaluation
    cadence.py                  when to evaluate and when to save: a small object of pure functions
    starting.py                 what a run settles before it loads anything: lock, resume, results, a finished run
    epochs.py                   the epoch loop a resumed run re-enters mid-epoch, exactly
    finishing.py                the end of a run: the final evaluation, the export, the summary, the results line
    flags.py                    the run services' flags (RUN_FLAGS, add_run_args), with their help
    checkpoint/checkpointer.py  --checkpoint-dir behind one object: the lock at start-up, then save, choose, load
    checkpoint/layout.py        the names and size limits of what a --checkpoint-dir holds (standard library)
    checkpoint/untrusted.py     one bounded read of a small untrusted file: no link followed, no FIFO blocking
    checkpoint/owners.py        whose entries in a shared --checkpoint-dir a run may use, and how many it looks at
    checkpoint/lock.py          one writer per --checkpoint-dir: the lock, its holder alive or stale
    checkpoint/files.py         a checkpoint's files reached without following links: opened, hashed, listed
    checkpoint/held.py          a checkpoint held open and read only through what every rank verified
    checkpoint/manifest.py      checkpoint.json: its schema, layout and files checked, written once
    checkpoint/train_state.py   checkpoint.json as the stop command reads it: JSON, versions read, training state
    checkpoint/formats.py       one object per engine's format: the files it writes, LoRA's frozen weights
    checkpoint/save.py          a save written by every rank, verified, published by one rename
    checkpoint/choose.py        which checkpoint a run resumes from: candidates, verification, falling back
    checkpoint/rotate.py        --keep-last: deleting only older checkpoints of this run that verify
    checkpoint/load.py          loading the chosen checkpoint through the files it verified
    checkpoint/rules.py         what a resumed run must share with the checkpoint, and what it may change
    checkpoint/resharding.py    another world size or --grad-accum: each per-rank rule, the universal checkpoint
    checkpoint/safe_loading.py  what a checkpoint file may contain: no code runs, memory bounded by size
    trust.py                    which directories a run may write into: trusted by their owner, as ssh trusts a path
    results.py                  where results go (run.json), written without following links
    collectives.py              verdicts every rank reaches together
    sharded_model.py            the words for how a model was built, and FSDP's allocation without writing
    stopping.py                 stop signals, the agreement between ranks, exit code 75, the line naming how to stop
    stop.py                     the stop command: python3 -m accelrun.stop DIR stops the run that holds DIR
    launcher.py                 the launcher a worker runs under: its exit code's fate, dying with it (no orphan)
    timing.py                   the data / forward+backward / optimizer / other split, without stalling the GPU
    reporting.py                metrics.jsonl, the progress and evaluation lines, --profile, memory, summary.json
    refusals.py                 launches that would train wrongly, refused at start-up with one message
    engines/base.py             Engine.of: the one engine of a run; what every way of running shares, the defaults
    engines/ddp.py              OneProcessOrDDP: one process or DDP, the whole state everywhere, its checkpoint format
    engines/zero.py             DeepSpeed: ZeRO 0-3 and offload, its clipping, zero.Init, fp32 masters, its format
    engines/fsdp2.py            FSDP2: fp32 reduction, the model built sharded, per-rank buffers, its format
    optimizers.py               which optimizer really steps, and the scheduler pointed at it
    float8.py                   mixed precision fp8: which linear layers compute in float8, the hardware, refusals
    exits.py                    one message and one exit code from every rank; the process group torn down
"""

# Moves with every change under src/accelrun (CHANGELOG.md, newest entry first; tests/test_source.py holds the two
# equal); the checkpoint format has a version of its own (checkpoint/manifest.py). Pinning: docs/install.md.
__version__ = "2.1.0"

# Run and add_run_args are imported when a recipe asks for them (PEP 562), not with the package: importing one module
# of accelrun (the stop command's standard-library modules, launch/slurm_launch.py's exit code) imports no torch.
_LAZY = {"Run": "run", "add_run_args": "flags"}
__all__ = list(_LAZY)


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value  # once: later lookups find it here
    return value
