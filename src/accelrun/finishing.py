"""The end of a run that trained to its last step: the final evaluation, the export, summary.json with its SUMMARY
line and the line naming every result, and what the run spent after its last step, by part (end_of_run).

Run.finish() calls finish_run(); the summary's fields are reporting.run_summary's, and docs/measuring.md defines
them.
"""

import os
import time

from safetensors.torch import save_file

from . import results
from .engines import exported_weights
from .optimizers import implementation, optimizer_name
from .reporting import footprint, plot_curves, run_summary, write_summary


def finish_run(run, model, exclude, export, summary, times):
    """Collective: the final evaluation (unless the last step had one), the export (model.safetensors, ZeRO-3 and
    FSDP shards gathered; or the recipe's export(weights) on the main process, returning its path), the memory
    footprint and, on the main process, the results. times: (the training time, when finish() began)."""
    acc, end = run.accelerator, run.end_of_run
    train_time, finishing = times
    end["recipe_s"] = max(finishing - run.trained_at - end["evaluation_s"] - end["checkpoint_s"], 0.0)
    if run._evaluation_due("end"):
        run._evaluate("end")
    started = time.perf_counter()
    weights = exported_weights(acc, model, exclude)  # collective: shards gathered, fp32, the model's own names
    exported = None
    if acc.is_main_process:
        exported = export(weights) if export else os.path.join(run.output_dir, "model.safetensors")
        if not export:  # written beside, then renamed over the name: a link planted there is never followed
            results.written_by(exported, lambda name: save_file(weights, name))
    end["export_s"] = time.perf_counter() - started
    started = time.perf_counter()
    shards = footprint(acc, model)  # collective
    timing = run.timer.timing(run.samples_per_micro, run.unit)
    if acc.is_main_process:
        _write_results(run, weights, exported, train_time, (shards, timing, summary), started)


def _write_results(run, weights, exported, train_time, fields, started):
    """Main process: close the logs, draw the curves, write summary.json with its SUMMARY line, name the files.
    fields: (the memory footprint, the steady-state timing, the recipe's extra fields)."""
    s, out = run.state, run.output_dir
    shards, timing, summary = fields
    this_run = s["step"] - (run.resumed_from or 0)
    rate = this_run * run.samples_per_micro * run.grad_accum / max(train_time - run.resumed_time, 1e-9)
    run.metrics.close()
    if run.evals:
        run.evals.close()
    if run.args.report_to != "none":
        run.print(f"curves: {plot_curves(out, run.name)}")
    end = {**run.end_of_run, "report_s": time.perf_counter() - started}
    end["total_s"] = time.perf_counter() - run.trained_at
    rates = {f"{run.unit}_per_s": rate}
    if run.flops_per_unit:
        rates["mfu"] = run.mfu(rate) if run.peak_tflops else None
    measured = {**shards, "timing": timing, "checkpoints": run.checkpointer.times, "end_of_run": end}
    write_summary(out, *run_summary(_run_facts(run), s, rates, run.timer, weights, measured, summary))
    written = [os.path.join(out, name) for name in ("summary.json", "metrics.jsonl", "eval.jsonl")
               if os.path.exists(os.path.join(out, name))]
    run.print("results: " + ", ".join(written + [exported]))


def _run_facts(run):
    """What the summary says of the run itself (reporting.run_summary): who ran, on what, from which checkpoint."""
    return {"recipe": run.name, "output_dir": run.output_dir, "engine": run.engine_facts,
            "optimizer": optimizer_name(run.optimizer), "optimizer_implementation": implementation(run.optimizer),
            "resumed_from_step": run.resumed_from,
            "resumed_from_world_size": run.resumed_layout and run.resumed_layout["world_size"],
            "resume_changes": run.checkpointer.reshaped, "model_init": run.model_init,
            "peaks_at_start": run.peaks_at_start, "wall_time_s": time.perf_counter() - run.t_start,
            "args": vars(run.args)}
