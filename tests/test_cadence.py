"""When a run evaluates and when it saves (accelrun/cadence.py), in-process: the rules as pure functions, in
milliseconds. The launches that hold them end to end: test_contract.py's checkpoint cadence, the resume tests."""

from accelrun.cadence import Cadence, Progress


def walk(cadence, stop_after=None):
    """(steps saved, steps evaluated) by a run that asks the cadence where Run asks it: after each step, and at
    each epoch boundary (the epoch's last step, the run's, or a stop), then at the end."""
    saved, evaluated, step = [], [], 0
    for _ in range(-(-cadence.total_steps // cadence.steps_per_epoch)):
        for in_epoch in range(1, cadence.steps_per_epoch + 1):
            step += 1
            at = Progress(step, in_epoch, stopping=step == stop_after)
            if cadence.evaluation_due("step", at):
                evaluated.append(step)
            if cadence.checkpoint_due("step", at, saved[-1] if saved else None):
                saved.append(step)
            if at.stopping or step >= cadence.total_steps:
                break
        if cadence.evaluation_due("epoch", at):
            evaluated.append(step)
        if cadence.checkpoint_due("epoch", at, saved[-1] if saved else None):
            saved.append(step)
        if at.stopping or step >= cadence.total_steps:
            break
    if cadence.evaluation_due("end", at, evaluated[-1] if evaluated else None):
        evaluated.append(f"end {step}")
    return saved, evaluated


def test_saves_every_n_steps_and_at_the_last_never_twice():
    """10 steps an epoch, --checkpoint-every 3, 20 steps: 3, 6, 9, 12, 15, 18 and the last, none at the epoch's end
    (test_contract.py's launch sees the same directories)."""
    assert walk(Cadence(10, 20, saves=True, checkpoint_every=3))[0] == [3, 6, 9, 12, 15, 18, 20]
    assert walk(Cadence(10, 20, saves=True))[0] == [10, 20]  # without --checkpoint-every: each epoch's end
    assert walk(Cadence(10, 20, saves=False, checkpoint_every=3))[0] == []  # no --checkpoint-dir
    # A step that ends an epoch's body is saved at the boundary (after its evaluation), once.
    assert walk(Cadence(10, 20, saves=True, checkpoint_every=5))[0] == [5, 10, 15, 20]


def test_a_stop_is_saved_and_never_evaluated():
    saved, evaluated = walk(Cadence(10, 30, evaluates=True, saves=True, checkpoint_every=4), stop_after=13)
    assert saved == [4, 8, 12, 13] and evaluated == [10]  # --checkpoint-every given: not at the epoch boundary


def test_evaluations_every_n_steps_at_each_epoch_and_at_the_end():
    assert walk(Cadence(10, 25, evaluates=True, eval_every=10))[1] == [10, 20, 25]
    assert walk(Cadence(10, 25, evaluates=True))[1] == [10, 20, 25]  # eval_every 0: each epoch's end (and the last)
    assert walk(Cadence(10, 20, evaluates=True, eval_every=7))[1] == [7, 14, 20]
    assert walk(Cadence(10, 20, evaluates=False, eval_every=7))[1] == []
    # --epochs 0: nothing trains, the initial model is evaluated at the end.
    assert Cadence(10, 0, evaluates=True).evaluation_due("end", Progress(0, 0)) is True
    assert Cadence(10, 20, evaluates=True).evaluation_due("end", Progress(20, 10), last_eval_step=20) is False
