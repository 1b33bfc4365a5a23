"""The end of a run that trained to its last step: the final evaluation, the export, summary.json with its SUMMARY
line and the line naming every result, and what the run spent after its last step, by part (end_of_run).

Run.finish() calls finish_run() with what the end needs: the Evaluation and the Clock (run_parts.py), and a Report
of what the results are written from; the summary's fields are reporting.run_summary's, and docs/measuring.md
defines them.
"""

import dataclasses
import os
import time

from safetensors.torch import save_file

from . import results
from .engines import exported_weights
from .reporting import footprint, plot_curves, run_summary, write_summary


@dataclasses.dataclass(frozen=True)
class Report:
    """What Run.finish() hands the end to write the results from."""
    output_dir: str
    name: str  # the recipe's
    report_to: str  # --report-to: curves.png drawn unless "none"
    facts: dict  # what the summary says of the run itself (reporting.run_summary), all but its wall time
    state: dict  # the training state
    metrics: object  # metrics.jsonl (reporting.MetricsLog), closed here
    timer: object  # the step timer (timing.StepTimer): the steady-state timing, the data and compute totals
    throughput: object  # run_parts.Throughput
    checkpoint_times: dict  # the checkpointer's times
    say: object  # print on the main process
    recipe_fields: dict  # what the recipe adds to the summary (finish(**summary))


def finish_run(accelerator, model, exporting, evaluation, clock, report):
    """Collective: the final evaluation (unless the last step had one), the export (model.safetensors, ZeRO-3 and
    FSDP shards gathered; or the recipe's export(weights) on the main process, returning its path), the memory
    footprint and, on the main process, the results. exporting: (names excluded from the export, the recipe's
    export or None); clock: run_parts.Clock, after finish_begins()."""
    exclude, export = exporting
    end = clock.end_of_run
    end["recipe_s"] = max(clock.finish_began - clock.trained_at - end["evaluation_s"] - end["checkpoint_s"], 0.0)
    if evaluation.due("end"):
        evaluation.run("end")
    started = time.perf_counter()
    weights = exported_weights(accelerator, model, exclude)  # collective: shards gathered, fp32, the model's own names
    exported = None
    if accelerator.is_main_process:
        exported = export(weights) if export else os.path.join(report.output_dir, "model.safetensors")
        if not export:  # written beside, then renamed over the name: a link planted there is never followed
            results.written_by(exported, lambda name: save_file(weights, name))
    end["export_s"] = time.perf_counter() - started
    started = time.perf_counter()
    shards = footprint(accelerator, model)  # collective
    timing = report.timer.timing(report.throughput.per_micro, report.throughput.unit)
    if accelerator.is_main_process:
        _write_results(report, (evaluation, clock), (weights, exported), (shards, timing), started)


def _write_results(report, parts, outputs, measures, started):
    """Main process: close the logs, draw the curves, write summary.json with its SUMMARY line, name the files.
    parts: (the Evaluation, the Clock); outputs: (the exported weights, the export's path); measures: (the memory
    footprint, the steady-state timing)."""
    (evaluation, clock), (weights, exported), (shards, timing) = parts, outputs, measures
    s, out = report.state, report.output_dir
    this_run = s["step"] - (report.facts["resumed_from_step"] or 0)
    rates = report.throughput.rates(this_run, clock.final_train_time - clock.before)
    report.metrics.close()
    evaluation.close()
    if report.report_to != "none":
        report.say(f"curves: {plot_curves(out, report.name)}")
    end = {**clock.end_of_run, "report_s": time.perf_counter() - started}
    end["total_s"] = time.perf_counter() - clock.trained_at
    measured = {**shards, "timing": timing, "checkpoints": report.checkpoint_times, "end_of_run": end}
    facts = {**report.facts, "wall_time_s": clock.wall_time()}
    write_summary(out, *run_summary(facts, s, rates, report.timer, weights, measured, report.recipe_fields))
    written = [os.path.join(out, name) for name in ("summary.json", "metrics.jsonl", "eval.jsonl")
               if os.path.exists(os.path.join(out, name))]
    report.say("results: " + ", ".join(written + [exported]))
