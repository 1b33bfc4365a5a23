"""What a resumed run must share with the run that wrote the checkpoint, and what it may change.

Owns the rules, written as data:
  * the layout (the engine's: engines.Engine.layout): which engine wrote the files (full state, DeepSpeed ZeRO stage
    N, FSDP), over how many processes and in how many accumulation steps, and with which sequence-parallel size
    (recorded when above 1).
    The engine, stage and sequence-parallel size must match; the world size may
    change (WORLD_SIZE_CHANGE says how, per kind of checkpoint), and --grad-accum with it (RESHAPE), with
    PER_RANK saying what becomes of each rank's own state;
  * the settings: every parsed flag must match, except those in MAY_CHANGE (the run services' own: where
    results and checkpoints go, logging, profiling, checkpoint cadence, stopping) and those a recipe
    declares with Run(..., may_change=...), plus the recipe's data facts (where the data came from and
    how much of it there is), so a flag added to a recipe is guarded without anyone listing it.

A checkpoint whose settings differ is refused with the differences named; docs/checkpoints.md has the table.
What these rules say is done on another world size is done in resharding.py, each rule in the one place its
PER_RANK row names.
"""

import json

from ..engines import Engine
from .formats import of
from .layout import LAYOUT_MAX
from .untrusted import shown, whole

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


# Another number of processes, per kind of checkpoint (checkpoint_kind()): how the checkpoint's state reaches the new
# ranks, as each engine says (its world_size_change). Every kind can (ZeRO-3 with accelrun's repair of DeepSpeed's
# stage-3 universal load: resharding.py).
WORLD_SIZE_CHANGE = {kind: how for engine in Engine.kinds for kind, how in engine.world_size_change.items()}

# Flags that may change on a resume because they only split the global batch (--batch-size, which must
# match): each optimizer step still sees the same samples, and the data position counts optimizer steps.
RESHAPE = {
    "grad_accum": "so that fewer processes hold the same global batch in more accumulation steps (and more "
                  "processes in fewer); the global batch must divide by processes x --grad-accum",
}

# What torch.distributed.checkpoint does not reshard: each rank's own state, the rule for it when the world
# size changes, and the one function that applies the rule (docs/checkpoints.md has them as a table).
PER_RANK = {
    "RNG state (random_states_R.pkl)": (
        "a rank the checkpoint has takes its own; a new rank takes rank 0's (the ranks start from one seed); the "
        "state of a rank that no longer exists is dropped", "checkpoint.resharding.rng_for_new_rank"),
    "buffers (rank-R.buffers.safetensors, FSDP: BatchNorm statistics)": (
        "a new rank takes rank 0's; those of a rank that no longer exists are dropped",
        "checkpoint.resharding.load_rank_buffers"),
    "data position": (
        "kept: it counts optimizer steps of the global batch, and the sampler's order depends only on seed and "
        "epoch, so the new ranks split the same samples of each step among themselves", "run.resumable_epochs"),
    "log window": (
        "its loss is the mean over the old ranks, carried by every new rank, with its micro-batch count converted "
        "to the new --grad-accum (the same samples, in the new micro-batches)",
        "checkpoint.resharding.reshaped_window"),
    "accelerate's micro-batch counter (accelerator.step)": (
        "set to the checkpoint's step x the new --grad-accum: its remainder decides which micro-batch ends an "
        "optimizer step", "checkpoint.resharding.set_micro_batch_counter"),
}


def checkpoint_kind(saved):
    """The WORLD_SIZE_CHANGE key of a layout: its family, with the ZeRO stage for DeepSpeed (the engine's kind)."""
    return of(saved).kind(saved)


def must_match_settings(args, may_change, data_facts):
    """The settings a resumed run must share: every flag but the ones that may change, plus the data facts,
    as they read back from the manifest's JSON (a tuple becomes a list)."""
    flags = {k: v for k, v in vars(args).items() if k not in MAY_CHANGE and k not in may_change}
    clash = set(flags) & set(data_facts)
    if clash:
        raise ValueError(f"data facts {sorted(clash)} have the names of flags; name them differently")
    return json.loads(json.dumps({**flags, **data_facts}))


SETTINGS_NAMED = 4  # differing settings named in incompatibility's one line; the rest are counted
SETTING_SHOWN = 60  # characters of each setting's value shown there (a path, a list of flags)


def incompatibility(manifest, now, must_match):
    """None, or why a run with layout `now` and settings `must_match` cannot continue from the checkpoint."""
    saved = manifest["layout"]
    if saved["family"] != now["family"] or saved["zero_stage"] != now["zero_stage"]:
        return (f"it was written by {saved['family']} (ZeRO stage {saved['zero_stage']}) and this run is "
                f"{now['family']} (ZeRO stage {now['zero_stage']}); their files differ")
    if (saved_sp := saved.get("sequence_parallel", 1)) != (now_sp := now.get("sequence_parallel", 1)):
        return (f"it was written with sequence parallelism of size {saved_sp} and this run has {now_sp} "
                f"(parallelism_config_sp_size): a resume onto another split of each sequence is not tested, so it is "
                f"refused. Resume it with the config that wrote it, or give another --checkpoint-dir")
    if not whole(saved_grad_accum(manifest, now), 1, LAYOUT_MAX):  # what resharding computes with
        return (f"its grad_accum {shown(_saved_accum(manifest))} is not a number of micro-batches, so this run "
                f"cannot tell how it split the global batch")
    before = manifest["must_match"]
    differ = {k: (before.get(k, "<not set>"), must_match.get(k, "<not set>"))
              for k in sorted(set(before) | set(must_match)) if before.get(k) != must_match.get(k) and k not in RESHAPE}
    if not differ:
        return None
    if "base_weights" in differ:  # finetune_lm's LoRA: the checkpoint holds adapters for another base's weights
        saved, now_held = (str(v)[:19] for v in differ["base_weights"])
        return (f"its LoRA adapters were trained on other base weights than --model {must_match.get('model')} holds "
                f"now (fingerprint {saved}, now {now_held}): adapters continued on another base are trained on two. "
                f"Give --model the weights it was trained on")
    listed = ", ".join(f"{k} {shown(a, SETTING_SHOWN)} vs {shown(b, SETTING_SHOWN)}"
                       for k, (a, b) in list(differ.items())[:SETTINGS_NAMED])
    more = f" and {len(differ) - SETTINGS_NAMED} more" if len(differ) > SETTINGS_NAMED else ""
    # A checkpoint written before manifests named their recipe: flags only one side has mean another recipe.
    other = " (flags only one of them has: a checkpoint of another recipe?)" if set(before) ^ set(must_match) else ""
    return f"these settings differ from the run that wrote it (saved, now): {listed}{more}{other}" + _keep_batch(
        differ.get("batch_size", (None,))[0], now)


def _keep_batch(batch, now):
    """The way to a resume that works when --batch-size differs: the checkpoint's, on processes that divide it."""
    if not isinstance(batch, int) or batch < 1:
        return ""
    fits = batch % (now["world_size"] * now["grad_accum"]) == 0
    where = "" if fits else f"; {processes_hint(batch, now['grad_accum'], now['world_size'])}"
    return f" (--batch-size is the global batch, which a resume keeps: give --batch-size {batch}{where})"


def processes_hint(batch_size, grad_accum, world):
    """What to launch so that a global batch of batch_size splits over processes x --grad-accum: the process counts
    near `world` that divide it with this --grad-accum, or with --grad-accum 1 (a resume may change it: RESHAPE)."""
    fits = [n for n in range(1, max(8, 2 * world) + 1) if batch_size % (n * grad_accum) == 0][:6]
    accum = ""
    if not fits:
        fits, accum = [n for n in range(1, max(8, 2 * world) + 1) if batch_size % n == 0][:6], " with --grad-accum 1"
    counts = ", ".join(map(str, fits[:-1])) + (" or " if len(fits) > 1 else "") + str(fits[-1])
    return f"launch {counts} process{'es' if fits != [1] else ''}{accum} (accelerate launch --num_processes N)"


def reshaped(manifest, now):
    """What changed between the run that wrote the checkpoint and this one, and the rules that applied, as
    lines for the log and the summary ([] when nothing did). Call after incompatibility() found none."""
    saved, notes = manifest["layout"], []
    old_world, old_accum = saved["world_size"], saved_grad_accum(manifest, now)
    if old_world != now["world_size"]:
        notes.append(f"world size {old_world} -> {now['world_size']}: {WORLD_SIZE_CHANGE[checkpoint_kind(saved)]}")
        buffers = of(saved).keeps_rank_buffers  # FSDP's per-rank buffers follow the RNG state's rule
        if now["world_size"] > old_world:
            notes.append(f"ranks {list(range(old_world, now['world_size']))} are new: they take rank 0's RNG "
                         f"state" + (" and buffers" if buffers else ""))
        else:
            notes.append(f"ranks {list(range(now['world_size'], old_world))} no longer exist: their RNG state"
                         + (" and buffers are" if buffers else " is") + " dropped")
    if old_accum != now["grad_accum"]:
        notes.append(f"--grad-accum {old_accum} -> {now['grad_accum']}: the same global batch in "
                     f"{now['grad_accum']} micro-batch(es) per process")
    return notes


def _saved_accum(manifest):
    """The checkpoint's --grad-accum as it reads: in its layout, or (written before the layout held it) its
    settings; None when neither holds one."""
    held = manifest["layout"].get("grad_accum")
    return held if held is not None else manifest["must_match"].get("grad_accum")


def saved_grad_accum(manifest, now):
    """The checkpoint's --grad-accum: in its layout, or (written before the layout held it) its settings, or this
    run's when neither holds one. incompatibility() refuses a checkpoint where it is not a whole number."""
    held = _saved_accum(manifest)
    return now["grad_accum"] if held is None else held
