"""What a run prints on a terminal, in-process and quick (issue 53, item 9): every line printed while the progress bar
is up goes above it (run_parts.Lines.above, as the progress lines' tqdm.write), and DeepSpeed's universal-checkpoint
converter prints nothing into the run's log unless it fails (resharding.converter_quiet). The launched resume that
converts for real, with its output, is test_checkpoint_resume.py's ZeRO world-size test."""

import contextlib
import io
import logging
import os
import sys
import types

import pytest
from tqdm import tqdm

from accelrun.cadence import Cadence
from accelrun.checkpoint.resharding import converter_quiet
from accelrun.run import Run
from accelrun.run_parts import Clock, Evaluation, Lines
from accelrun.starting import Settled


def as_a_terminal_shows(written):
    """The lines a terminal shows for `written`: a carriage return goes back to the line's start (tqdm's redraws,
    its clearing with spaces), so each line is what follows its last one, trailing spaces left out."""
    return [line.rsplit("\r", 1)[-1].rstrip() for line in written.split("\n")]


class Saves:
    """A checkpointer that prints as checkpoint.Checkpointer does, to sys.stdout (the bar draws on stderr)."""

    def save(self, step, train_state):
        print(f"checkpoint saved: ckpt/step-{step:08d} (written in 0.1 s, checksums by 1 rank(s) in 0.0 s)",
              flush=True)


def run_with_a_bar(terminal):
    """A Run in mid-epoch at step 5 of 10 with its progress bar drawn on `terminal`: only the parts _save and its
    Evaluation use are set."""
    run = Run.__new__(Run)
    run.lines = Lines(types.SimpleNamespace(is_main_process=True))
    run.lines.bar = tqdm(total=10, file=terminal, mininterval=0, ncols=80)
    run.lines.bar.update(5)
    run.state = {"step": 5, "step_in_epoch": 5, "epoch": 0, "train_time": 0.0, "last_eval": None}
    run.clock, run.stopping = Clock(), False
    run.clock.start_training(0.0)
    run.settled = Settled(None, None, "runs/x", "runs/x", "r" * 32, None)
    run.cadence = Cadence(10, 10, evaluates=True)
    run.timer = types.SimpleNamespace(window_state=lambda: None, restart=lambda: None)
    run.checkpointer = Saves()
    run.evaluation = Evaluation(None, run.cadence, types.SimpleNamespace(write=lambda record: None), run.state,
                                run.lines, run.clock, run.timer)
    return run


def test_lines_printed_mid_epoch_go_above_the_progress_bar():
    """The checkpoint's line and what a recipe's evaluate() prints start a line of their own on a terminal (they were
    glued to the bar's end: `...| 5/10 [00:07<00:07, 6.66it/s]checkpoint saved: ...`), the evaluation's line too,
    and the bar is drawn again below them."""
    terminal = io.StringIO()
    run = run_with_a_bar(terminal)

    def evaluate():
        print("sample: the quick fox", flush=True)
        return {"val_loss": 1.5}

    run.evaluation.evaluate = evaluate
    with contextlib.redirect_stdout(terminal), contextlib.redirect_stderr(terminal):
        run._save()
        run.evaluation.run("step 5")
    shown = as_a_terminal_shows(terminal.getvalue())
    for line in ("checkpoint saved: ckpt/step-00000005 (written in 0.1 s, checksums by 1 rank(s) in 0.0 s)",
                 "sample: the quick fox", "step 5 | val loss 1.5000"):
        assert line in shown, shown
    assert "5/10" in shown[-1], shown  # the bar again, below the lines
    run.lines.bar.close()


def test_lines_go_as_they_are_without_a_bar(capsys):
    """Off a terminal (a log file, Slurm) the bar is off, and the lines are printed as they are."""
    run = run_with_a_bar(io.StringIO())
    run.lines.bar.close()
    run.lines.bar = tqdm(total=10, disable=True)
    run._save()
    assert capsys.readouterr().out == ("checkpoint saved: ckpt/step-00000005 (written in 0.1 s, checksums by 1 "
                                       "rank(s) in 0.0 s)\n")


def noisy_converter(fail=False):
    """What DeepSpeed's ds_to_universal prints, through each way it has: print, its own tqdm bars, a logger's
    handler holding the stream it was given, the file descriptor itself."""
    print("Converting DeepSpeed checkpoint in /ckpt/pytorch_model to Universal checkpoint in /proc/1/fd/9/x")
    for _ in tqdm(range(3)):
        pass
    handler = logging.StreamHandler(sys.__stderr__)
    log = logging.getLogger("deepspeed-like")
    log.addHandler(handler)
    try:
        log.warning("No AutoEP layers found, skipping")
    finally:
        log.removeHandler(handler)
    os.write(2, b"*** 1. Extracting ZeRO fragments\n")
    if fail:
        raise RuntimeError("a shard is missing")


def test_the_converter_prints_nothing_into_the_log(capfd):
    with converter_quiet():
        noisy_converter()
    out, err = capfd.readouterr()
    assert (out, err) == ("", ""), (out, err)
    print("after", flush=True)
    os.write(2, b"fd 2 after\n")
    assert capfd.readouterr() == ("after\n", "fd 2 after\n")  # the streams and descriptors are given back


def test_a_failed_conversion_shows_what_the_converter_printed(capfd):
    with pytest.raises(RuntimeError, match="a shard is missing"):
        with converter_quiet():
            noisy_converter(fail=True)
    out, err = capfd.readouterr()
    assert out == "" and err.startswith("DeepSpeed's converter printed:\n"), (out, err)
    for line in ("Converting DeepSpeed checkpoint in /ckpt/pytorch_model", "No AutoEP layers found",
                 "*** 1. Extracting ZeRO fragments", "3/3"):
        assert line in err, err
