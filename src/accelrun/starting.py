"""What a run settles at start-up, before it loads any data or model: --checkpoint-dir's lock, the checkpoint its
resume would take as far as manifests tell, where its results go and which run it is (results.py's rule), and
whether the same command already finished (then it says so, changes nothing and exits 0).

Run.setup() calls settle(), which returns what it settled (Settled); Run.start() confirms with the checkpoint every
rank verified: place_again() when that is another one, already_complete() when it holds the last step.
"""

import dataclasses
import sys

from . import results
from .checkpoint.rules import must_match_settings
from .collectives import main_process_result
from .exits import teardown
from .reporting import point_trackers


@dataclasses.dataclass(frozen=True)
class Settled:
    """What start-up settled before any data or model loads; Run holds it, and start() may place the results again."""
    lock: object  # --checkpoint-dir's lock (checkpoint/lock.py), None for a run that keeps no checkpoints
    peeked: tuple | None  # (path, manifest) of the checkpoint the resume would take, as far as manifests tell
    default_output_dir: str  # where results go without --output-dir
    output_dir: str  # where this run's results go (results.py's rule)
    run_id: str  # which run this is: a continued run keeps its checkpoint's
    results_note: str | None  # the line start() prints on where the results go, when results.choose has one


def keeps_checkpoints(args):
    """Whether the run saves checkpoints (--checkpoint-dir) or resumes one (--resume PATH); else the checkpoint
    package is not even imported."""
    return bool(args.checkpoint_dir) or args.resume not in ("auto", "none")


def settle(accelerator, args, name, default_output_dir, may_change, say):
    """Collective: the lock first (a second run on the directory stops in seconds), then the output directory and
    the run's id, then a finished run answered (say: print on the main process). Returns Settled."""
    lock, peeked = None, None
    if keeps_checkpoints(args):
        from .checkpoint import lock_directory
        lock, peeked = lock_directory(accelerator, args.checkpoint_dir, args.resume, name)
    placed = place_results(accelerator, args, name, default_output_dir, peeked)
    settled = Settled(lock, peeked, default_output_dir, *placed)
    _complete_before_loading(accelerator, args, may_change, settled, say)
    return settled


def place_again(accelerator, args, name, settled, chosen):
    """Collective, from start(): the checkpoint every rank verified (`chosen`) is another than the manifests alone
    pointed to: setup's claim given back (nothing written there yet, or it would pass for another's), the results
    placed for `chosen`. Returns the Settled that follows."""
    placed = place_results(accelerator, args, name, settled.default_output_dir, chosen,
                           given_back=(settled.output_dir, settled.run_id))
    return dataclasses.replace(settled, **dict(zip(("output_dir", "run_id", "results_note"), placed, strict=True)))


def place_results(accelerator, args, name, default_output_dir, checkpoint, given_back=None):
    """Collective: (output directory, run id, note) decided and claimed by the main process (results.choose,
    exclusive creation) for a run that resumes `checkpoint` ((path, manifest), or None for a fresh start), before
    any data or model loads; refused on every rank in one line when results.py's rule refuses the directory.
    given_back: (output directory, run id) of an earlier claim, released first."""
    result = (None, None)
    if accelerator.is_main_process and given_back and given_back[0]:
        results.release(*given_back)
    if accelerator.is_main_process:
        run_id, recorded = results.continued(checkpoint, args.checkpoint_dir)
        place, note, error = results.choose(args.output_dir, default_output_dir, name, run_id, recorded)
        result = ((place, run_id, note), error)
    placed = main_process_result(accelerator, result)
    point_trackers(accelerator, placed[0], args.report_to)
    return placed


def _complete_before_loading(accelerator, args, may_change, settled, say):
    """Collective: the same command again after the run finished is answered here, before any data or model loads,
    when the checkpoint the resume would take says so (checkpoint/choose.py's finished)."""
    done, peeked = None, settled.peeked
    if accelerator.is_main_process and args.resume == "auto" and peeked:
        from .checkpoint.choose import finished
        done = finished(peeked, args.checkpoint_dir, must_match_settings(args, may_change, {}))
    if main_process_result(accelerator, (done, None)):
        already_complete(accelerator, say, (done, peeked[1]), settled.output_dir, settled.lock)


def already_complete(accelerator, say, checkpoint, output_dir, holder):
    """The same command again after the run finished: say where its results are, change nothing, exit 0.
    checkpoint: (path, manifest) of the one holding the last step; holder: what holds --checkpoint-dir (the
    Checkpointer, or before it the lock; None: nothing), released."""
    path, manifest = checkpoint
    state = manifest["train_state"]
    say(f"this run is already complete: {path} holds its last step ({state['step']} of {state['total_steps']}); "
        f"its results are in {output_dir} (summary.json, metrics.jsonl). Nothing was changed. To train again, give "
        f"another --checkpoint-dir.")
    if holder:
        holder.release()
    sys.exit(teardown(accelerator, 0))
