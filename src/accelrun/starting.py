"""What a run settles at start-up, before it loads any data or model: --checkpoint-dir's lock, the checkpoint its
resume would take as far as manifests tell, where its results go and which run it is (results.py's rule), and
whether the same command already finished (then it says so, changes nothing and exits 0).

Run.setup() calls settle(); Run.start() confirms with the checkpoint every rank verified: place_results() again when
that is another one, already_complete() when it holds the last step.
"""

import sys

from . import results
from .checkpoint.rules import must_match_settings
from .collectives import main_process_result
from .exits import teardown
from .reporting import point_trackers


def keeps_checkpoints(args):
    """Whether the run saves checkpoints (--checkpoint-dir) or resumes one (--resume PATH); else the checkpoint
    package is not even imported."""
    return bool(args.checkpoint_dir) or args.resume not in ("auto", "none")


def settle(run):
    """Collective: the lock first (a second run on the directory stops in seconds), then the output directory and
    the run's id, then a finished run answered."""
    run.lock, run.peeked = None, None
    if keeps_checkpoints(run.args):
        from .checkpoint import lock_directory
        run.lock, run.peeked = lock_directory(run.accelerator, run.args.checkpoint_dir, run.args.resume, run.name)
    place_results(run, run.peeked)
    _complete_before_loading(run)


def place_results(run, checkpoint):
    """Collective: the output directory and the run's id, decided and claimed by the main process (results.choose,
    exclusive creation) for a run that resumes `checkpoint` ((path, manifest), or None for a fresh start), before
    any data or model loads; refused on every rank in one line when results.py's rule refuses the directory."""
    acc, args, result = run.accelerator, run.args, (None, None)
    if acc.is_main_process and getattr(run, "output_dir", None):  # start() places again: setup's claim given back
        results.release(run.output_dir, run.run_id)  # (nothing written there yet), or it would pass for another's
    if acc.is_main_process:
        run_id, recorded = results.continued(checkpoint, args.checkpoint_dir)
        place, note, error = results.choose(args.output_dir, run.default_output_dir, run.name, run_id, recorded)
        result = ((place, run_id, note), error)
    run.output_dir, run.run_id, run.results_note = main_process_result(acc, result)
    point_trackers(acc, run.output_dir, args.report_to)


def _complete_before_loading(run):
    """Collective: the same command again after the run finished is answered here, before any data or model loads,
    when the checkpoint the resume would take says so (checkpoint/choose.py's finished)."""
    acc, args, done = run.accelerator, run.args, None
    if acc.is_main_process and args.resume == "auto" and run.peeked:
        from .checkpoint.choose import finished
        done = finished(run.peeked, args.checkpoint_dir, must_match_settings(args, run.may_change, {}))
    if main_process_result(acc, (done, None)):
        already_complete(run, done, run.peeked[1])


def already_complete(run, path, manifest):
    """The same command again after the run finished: say where its results are, change nothing, exit 0."""
    state = manifest["train_state"]
    run.print(f"this run is already complete: {path} holds its last step ({state['step']} of {state['total_steps']}); "
              f"its results are in {run.output_dir} (summary.json, metrics.jsonl). Nothing was changed. To train "
              f"again, give another --checkpoint-dir.")
    if getattr(run, "checkpointer", None):
        run.checkpointer.release()
    elif run.lock:
        run.lock.release()
    sys.exit(teardown(run.accelerator, 0))
