"""Verdicts every rank reaches together, so that no rank goes on, or stops, alone.

Owns the collective verdicts the checkpoint code needs: the main process's result adopted by every rank
(main_process_result: its value, or every rank exits with its error), each kind of problem any rank found
(first_rank_problems: the first rank's, named by its rank), and the ranks' verdict on a checkpoint they hold
(checked_by_every_rank: each rank's share checked, and every rank holding the same, unchanged files).
"""

from accelerate.utils import broadcast_object_list, gather_object

from .exits import fail


def main_process_result(accelerator, result):
    """Collective: the main process's (value, error) on every rank: its value, or every rank fails with its error.
    The other ranks pass anything; the main process's result replaces it."""
    box = [result]
    broadcast_object_list(box)
    value, error = box[0]
    if error:
        fail(accelerator, error)
    return value


def _first(per_rank, i, world):
    return next((f"rank {r}: {p[i]}" if world > 1 else p[i] for r, p in enumerate(per_rank) if p[i]), None)


def first_rank_problems(accelerator, *problems):
    """Collective: for each kind of problem (a message or None on each rank), the first rank's, or None; with
    several processes the message names its rank."""
    world = accelerator.num_processes
    per_rank = gather_object([problems]) if world > 1 else [problems]
    return [_first(per_rank, i, world) for i in range(len(problems))]


def checked_by_every_rank(accelerator, held, also=None):
    """Collective: (damage, unsafe) of a checkpoint every rank holds (checkpoint/held.py's HeldCheckpoint). Each rank
    checks its share (and also(), when given and its share passes: a check of what the files hold for this run),
    then every rank takes the first rank's problem of each kind; with none, damage when the ranks do not hold the
    same, unchanged files (one was replaced while they checked it), so that what one rank verified is what every
    rank loads."""
    world = accelerator.num_processes
    damage, unsafe = held.share_problems(accelerator.process_index, world)
    if not (damage or unsafe) and also:
        damage = also(held)
    mine = (damage, unsafe, {} if damage or unsafe else held.identities())
    per_rank = gather_object([mine]) if world > 1 else [mine]
    damage, unsafe = _first(per_rank, 0, world), _first(per_rank, 1, world)
    if damage or unsafe:
        return damage, unsafe
    for rel in sorted(held.files):
        if len({identities[rel] for _, _, identities in per_rank}) > 1:
            return f"{rel} changed while the ranks verified it (someone else writes into {held.path})", None
    return None, None
