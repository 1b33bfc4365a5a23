#!/usr/bin/env python3
"""Print the seconds this Slurm job has left before its time limit (nothing if unlimited).

The sbatch templates use it to stop the training a fixed time before the limit. They do not
rely on Slurm's own warning (`--signal`): with Slurm 22.05 a requeued job can get that warning
the moment it starts again, when the controller's periodic time-limit check still sees the end
time of the previous run (observed here in about half of the requeues).
"""

import os
import re
import subprocess
import sys


def seconds(remaining):
    """squeue's %L: [days-][hours:]minutes:seconds, or UNLIMITED / NOT_SET."""
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", remaining.strip())
    if not match:
        return None
    days, hours, minutes, secs = (int(x or 0) for x in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + secs


def main():
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        print("time_left: error: not inside a Slurm job (no SLURM_JOB_ID)", file=sys.stderr)
        return 2
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%L"], capture_output=True, text=True, timeout=60)
    left = seconds(out.stdout) if out.returncode == 0 else None
    if left is not None:
        print(left)
    return 0


if __name__ == "__main__":
    sys.exit(main())
