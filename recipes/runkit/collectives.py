"""Verdicts every rank reaches together, so that no rank goes on, or stops, alone.

Owns the two collective verdicts the checkpoint code needs: the main process's result adopted by every rank
(main_process_result: its value, or every rank exits with its error), and each kind of problem any rank found
(first_rank_problems: the first rank's, named by its rank).
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


def first_rank_problems(accelerator, *problems):
    """Collective: for each kind of problem (a message or None on each rank), the first rank's, or None; with
    several processes the message names its rank."""
    world = accelerator.num_processes
    per_rank = gather_object([problems]) if world > 1 else [problems]
    return [next((f"rank {r}: {p[i]}" if world > 1 else p[i] for r, p in enumerate(per_rank) if p[i]), None)
            for i in range(len(problems))]
