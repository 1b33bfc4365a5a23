"""The flags of the run services, with their help: the ones Run reads from a recipe's parsed namespace.

Owns RUN_FLAGS and add_run_args(): the output directory and the progress lines, the checkpoint and stop flags
(one group in --help: docs/checkpoints.md), and the reporting flags; and how a recipe's parser reports a wrong
flag: one line, once (one_line_errors), and a --help that gives each default once (DefaultOnce). Which of them
a resumed run may change is checkpoint/rules.py's (MAY_CHANGE); what each does is the module's that acts on it.
"""

import argparse
import os
import sys

from .exits import report
from .stopping import EXIT_STOPPED

# Every flag Run reads from the recipe's namespace; add_run_args() adds each of them.
RUN_FLAGS = ("output_dir", "log_every", "checkpoint_dir", "checkpoint_every", "keep_last", "resume",
             "stop_signals", "stop_check_every", "report_to", "profile")


def whole_number_type(low, of="", note=""):
    """An argparse type: an int of at least `low`, else one line naming the value (`give a whole number{of}, {low} or
    more{note}`). The one rule for every whole-number flag the run services and the recipes' helpers define."""
    def whole(text):
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: give a whole number{of}, {low} or more{note}")
        return value
    return whole


# A negative --keep-last would slice the checkpoint list backwards.
whole_number = whole_number_type(0)


def one_line_errors(parser):
    """A wrong flag as one line, `RECIPE.py: error: ... (python3 RECIPE.py --help lists the flags)`, and exit 2:
    argparse's usage block (a screen of flags) left to --help, and printed by the main process only, where every
    process of a launch parses the same flags. Under accelerate launch the line is also the root cause in torchrun's
    failure report (exits.report)."""
    def error(message):
        report(f"{message} (python3 {sys.argv[0]} --help lists the flags)", os.environ.get("RANK", "0") == "0",
               prefix=f"{parser.prog}: error: ")
        sys.exit(2)
    parser.error = error


def add_run_args(parser, name, log_every):
    """The flags of the run services (RUN_FLAGS): output, progress lines, checkpoints, stopping, reporting; and
    the parser's errors as one line (one_line_errors). name: the recipe's, for the default output directory;
    log_every: its default progress cadence."""
    one_line_errors(parser)
    parser.add_argument("--output-dir", default=None,
                        help=f"summary.json, metrics.jsonl and the model; default runs/{name}/<how it runs>, e.g. "
                             f"runs/{name}/ddp-2proc-bf16, so each config keeps its own results")
    parser.add_argument("--log-every", type=int, default=log_every, help="a progress line every N optimizer steps")
    group = parser.add_argument_group("checkpoints and stopping (docs/checkpoints.md)")
    group.add_argument("--checkpoint-dir", default=None,
                       help="save checkpoints here (must be storage every node sees); off when not given")
    group.add_argument("--checkpoint-every", type=whole_number, default=0,
                       help="save every N optimizer steps instead of at each epoch's end (0: at each epoch's end); "
                            "the last step and a stop by a signal are always saved")
    group.add_argument("--keep-last", type=whole_number, default=2, help="complete checkpoints to keep (0: keep all)")
    group.add_argument("--resume", default="auto",
                       help="auto: newest complete checkpoint in --checkpoint-dir, if any; none: start fresh "
                            "(refused when --checkpoint-dir already holds checkpoints); or the path of one checkpoint")
    group.add_argument("--stop-signals", default="USR1,TERM",
                       help="signals that make every rank finish its step, save a checkpoint and exit "
                            f"with code {EXIT_STOPPED} (comma-separated; '' to disable)")
    group.add_argument("--stop-check-every", type=int, default=0, metavar="N",
                       help="ranks agree on stopping at each progress line (--log-every), where they synchronise "
                            "anyway, and at each epoch's end; N > 0 adds a check every N optimizer steps (one scalar "
                            "all-reduce and a host sync each): for steps so slow that a progress window outlasts "
                            "the grace time before the job is killed")
    parser.add_argument("--report-to", choices=["none", "png", "tensorboard"], default="none",
                        help="tensorboard: log the metrics with accelerate's TensorBoard tracker into "
                             "OUTPUT_DIR/tensorboard and draw OUTPUT_DIR/curves.png; png: only curves.png")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="record a torch.profiler trace of STEPS optimizer steps (after 2 warm-up steps) into "
                             "OUTPUT_DIR/profile, one file per rank, for Perfetto or TensorBoard")


class DefaultOnce(argparse.ArgumentDefaultsHelpFormatter):
    """--help gives each flag's default once: argparse's "(default: ...)", unless the help says it already or the
    default is None (the help says what happens then)."""

    def _get_help_string(self, action):
        if action.default is None or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
