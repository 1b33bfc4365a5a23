"""pi by midpoint integration of 4/(1+x^2) over [0, 1]: an all-reduce whose answer you know.

    python recipes/pi.py
    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/pi.py --intervals 1e9
    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/pi.py

The integral of 4/(1+x^2) from 0 to 1 is pi. With N intervals of width h = 1/N, the
midpoint rule sums h * 4/(1 + x_i^2) at x_i = (i + 0.5) h. Rank r of R takes the
contiguous block of intervals [r N/R, (r+1) N/R), adds up its share in float64, and
accelerator.reduce(..., "sum") adds the R partial sums: every rank ends with the same pi.
The error of the midpoint rule falls as 1/N^2 until float64 rounding (about 1e-16 per
term, growing with N) takes over, near N = 1e7..1e8.

--intervals takes several values (e.g. 1e3,1e5,1e7) and prints the convergence table.
There is no model and nothing to train, so the configs differ only in how the process
group is set up: the sum is the same under DDP, DeepSpeed and FSDP configs, and there
is nothing to checkpoint (a run of N = 1e9 takes seconds).

Result: error 8.3e-12 at N = 1e5, under 1e-15 from N = 1e7, measured 2026-11-22 on a 2-core CPU (docs/recipes.md).
"""

import argparse
import json
import math
import os
import sys
import time

from accelrun.results import place_problem, write_file


def one_line_errors(parser):
    """A wrong flag as one line naming --help, from the main process only (every process parses the same flags)."""
    def error(message):
        if os.environ.get("RANK", "0") == "0":
            print(f"{parser.prog}: error: {message} (python3 {sys.argv[0]} --help lists the flags)", file=sys.stderr)
        sys.exit(2)
    parser.error = error


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    one_line_errors(p)
    p.add_argument("--intervals", default="1e3,1e5,1e7",
                   help="comma-separated interval counts N (scientific notation allowed)")
    p.add_argument("--output-dir", default="runs/pi", help="summary.json")
    args = p.parse_args(argv)
    try:
        args.intervals = [int(float(n)) for n in args.intervals.split(",")]
    except ValueError:
        p.error(f"--intervals {args.intervals!r}: give whole numbers such as 1e6 or 1000000, separated by commas")
    if min(args.intervals) < 1:
        p.error("--intervals must be at least 1")
    problem = place_problem(args.output_dir, "--output-dir")  # a link or another user's directory: never written into
    if problem:
        p.error(problem.removeprefix("--output-dir "))
    return args


if __name__ == "__main__":
    parse_args()  # --help and a wrong flag answer here, before torch and the rest are imported (seconds)

import torch
from accelerate import Accelerator


def checked_launch(**kwargs):
    """The Accelerator, once this launch cannot make each process run alone: more processes on a node than it has
    GPUs, or a launcher that started processes accelerate did not join into one group. One line, exit 2."""
    local, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
    if gpus and local > gpus and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true", "yes"):
        sys.exit(f"error: this node has {gpus} GPU(s) and the launch starts {local} processes on it: pass "
                 f"--num_processes {gpus} to accelerate launch")
    accelerator = Accelerator(**kwargs)
    if accelerator.num_processes != int(os.environ.get("WORLD_SIZE", "1")):
        sys.exit(f"error: the launcher started {os.environ['WORLD_SIZE']} processes and accelerate set up "
                 f"{accelerator.num_processes}: on a CPU, launch with ACCELERATE_USE_CPU=1 (docs/configs.md)")
    return accelerator


def write_summary(accelerator, output_dir, fields):
    """Main process: summary.json, and its SUMMARY line for scripts to grep."""
    if accelerator.is_main_process:
        stage = accelerator.state.deepspeed_plugin.zero_stage if accelerator.state.deepspeed_plugin else None
        summary = {"recipe": "pi", "distributed_type": accelerator.distributed_type.value,
                   "world_size": accelerator.num_processes, "mixed_precision": accelerator.mixed_precision,
                   "deepspeed_stage": stage, **fields}
        os.makedirs(output_dir, exist_ok=True)
        write_file(os.path.join(output_dir, "summary.json"), json.dumps(summary, indent=2))  # replaces, never follows
        print("SUMMARY " + json.dumps({k: v for k, v in summary.items() if k != "args"}), flush=True)


def end(accelerator):
    """Every process ends here. With several, without Python's interpreter finalization: a gloo thread that drops
    its last reference then can abort the process after its work is done (docs/troubleshooting.md, torch #190489)."""
    accelerator.end_training()
    if accelerator.num_processes > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0

CHUNK = 10_000_000  # intervals evaluated at once: 80 MB of float64, whatever N is


def partial_sum(first, last, n, device):
    """h * sum of 4/(1+x^2) over the midpoints of intervals first..last-1 of n."""
    h, total = 1.0 / n, torch.zeros((), dtype=torch.float64, device=device)
    for start in range(first, last, CHUNK):
        i = torch.arange(start, min(start + CHUNK, last), dtype=torch.float64, device=device)
        x = (i + 0.5) * h
        total += (4.0 / (1.0 + x * x)).sum()
    return total * h


def main(argv=None):
    args = parse_args(argv)
    accelerator = checked_launch()
    log = accelerator.print  # once, from the main process
    rank, world = accelerator.process_index, accelerator.num_processes
    log(f"{accelerator.distributed_type.value} | {world} process{'es' if world != 1 else ''} on "
        f"{accelerator.device.type}")
    results = []
    for n in args.intervals:
        first, last = rank * n // world, (rank + 1) * n // world  # contiguous, sizes differ by at most 1
        accelerator.wait_for_everyone()  # time the computation, not the wait for a slower start
        t0 = time.perf_counter()
        mine = partial_sum(first, last, n, accelerator.device)
        mine.item()  # the host waits for the sum: on a GPU the kernels are only queued until it is read
        compute = time.perf_counter() - t0
        pi = accelerator.reduce(mine, "sum").item()
        elapsed = time.perf_counter() - t0
        shares = accelerator.gather(torch.tensor([last - first, compute], dtype=torch.float64,
                                                 device=accelerator.device)).view(world, 2).tolist()
        row = {"intervals": n, "pi": pi, "error": pi - math.pi, "relative_error": abs(pi - math.pi) / math.pi,
               "seconds": elapsed, "intervals_per_rank": [int(s[0]) for s in shares],
               "compute_seconds_per_rank": [s[1] for s in shares]}
        results.append(row)
        log(f"N = {n:.0e} | pi = {pi:.16f} | error {row['error']:+.2e} | {elapsed:.3f} s | per rank: "
            + ", ".join(f"rank {r} {int(c)} intervals in {t:.3f} s" for r, (c, t) in enumerate(shares)))
    write_summary(accelerator, args.output_dir, {"results": results, "args": vars(args)})
    return end(accelerator)


if __name__ == "__main__":
    sys.exit(main())
