"""What a resumed run must share with the run that wrote the checkpoint, and what it may change.

Owns the rules, written as data:
  * the layout: which engine wrote the files (full state, DeepSpeed ZeRO stage N, FSDP) and over how
    many processes, since sharded files can only be read back by the same engine and world size;
  * the settings: every parsed flag must match, except those in MAY_CHANGE (the run services' own: where
    results and checkpoints go, logging, profiling, checkpoint cadence, stopping) and those a recipe
    declares with Run(..., may_change=...), plus the recipe's data facts (where the data came from and
    how much of it there is), so a flag added to a recipe is guarded without anyone listing it.

A checkpoint whose settings differ is refused with the differences named; docs/checkpoints.md has the table.
"""

import json

from accelerate.utils import DistributedType

from .engines import engine

# Flags of the run services (add_run_args) that may differ between a run and its resume, and why.
MAY_CHANGE = {
    "output_dir": "where the results are written; the training does not depend on it",
    "log_every": "how often a progress line is printed",
    "checkpoint_dir": "where checkpoints are kept: a copied or moved directory resumes too",
    "checkpoint_every": "how often checkpoints are saved",
    "keep_last": "how many checkpoints are kept",
    "resume": "which checkpoint to continue from",
    "stop_signals": "which signals stop the run",
    "stop_check_every": "how often the ranks agree on stopping",
    "report_to": "where metrics are reported",
    "profile": "whether a trace is recorded",
}


def layout(accelerator):
    """What decides whether a checkpoint's files can be read back by this run."""
    # 1 process and DDP store the same full state; DeepSpeed and FSDP store their own formats.
    family = {DistributedType.DEEPSPEED: "deepspeed", DistributedType.FSDP: "fsdp"}.get(
        accelerator.distributed_type, "full")
    return {"family": family, "zero_stage": engine(accelerator)["deepspeed_stage"],
            "world_size": accelerator.num_processes}


def settings(args, may_change, data_facts):
    """The settings a resumed run must share: every flag but the ones that may change, plus the data facts,
    as they read back from the manifest's JSON (a tuple becomes a list)."""
    flags = {k: v for k, v in vars(args).items() if k not in MAY_CHANGE and k not in may_change}
    clash = set(flags) & set(data_facts)
    if clash:
        raise ValueError(f"data facts {sorted(clash)} have the names of flags; name them differently")
    return json.loads(json.dumps({**flags, **data_facts}))


def incompatibility(manifest, now, must_match):
    """None, or why a run with layout `now` and settings `must_match` cannot continue from the checkpoint."""
    saved = manifest["layout"]
    if saved["family"] != now["family"] or saved["zero_stage"] != now["zero_stage"]:
        return (f"it was written by {saved['family']} (ZeRO stage {saved['zero_stage']}) and this run is "
                f"{now['family']} (ZeRO stage {now['zero_stage']}); their files differ")
    if saved["family"] != "full" and saved["world_size"] != now["world_size"]:
        return (f"{saved['family']} shards its state over the {saved['world_size']} processes that wrote "
                f"it, and this run has {now['world_size']}; relaunch with {saved['world_size']} processes")
    before = manifest["must_match"]
    differ = {k: (before.get(k, "<not set>"), must_match.get(k, "<not set>"))
              for k in sorted(set(before) | set(must_match)) if before.get(k) != must_match.get(k)}
    if differ:
        return "these settings differ from the run that wrote it (saved, now): " + ", ".join(
            f"{k} {a!r} vs {b!r}"
            for k, (a, b) in differ.items())
    return None
