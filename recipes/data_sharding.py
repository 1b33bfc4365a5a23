"""What each rank sees: how accelerate's prepared DataLoader shards and reshuffles the data.

    python recipes/data_sharding.py
    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/data_sharding.py
    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/2gpu.yaml \\
        recipes/data_sharding.py --dataset-size 23 --batch-size 4

The dataset is just the numbers 0..N-1, so a batch shows which samples it holds. The
loader is the one every recipe here builds: a plain DataLoader(shuffle=True) with a
GLOBAL batch size, prepared with split_batches=True and a seedable sampler. Then:

  * Every rank draws the same shuffled order of the whole dataset (the sampler's seed
    comes from set_seed), cuts each global batch into world-size slices and keeps its
    own: rank r gets positions r*B/R..(r+1)*B/R-1 of every batch. The shards are disjoint
    and together they cover the dataset.
  * set_epoch(e) reseeds the shuffle with (seed, e): each epoch has a new order, and
    the same seed gives the same order on every run and for every number of processes.
  * Without set_seed before building the loader each process seeds its sampler from its
    own random state: the ranks shuffle differently and their shards OVERLAP, so some
    samples are trained on twice per epoch and others never. --unseeded shows it.
  * A dataset whose size does not divide by the batch: the last global batch is short.
    With drop_last it is dropped. Without, accelerate (even_batches, the default) tops
    it up with samples from the start of the epoch until it splits evenly, so every rank
    runs the same number of steps and no collective waits for a rank that has finished.
    Those repeated samples count twice in training; for evaluation gather_for_metrics
    removes them, which this script checks.

Nothing here trains, so there is nothing to checkpoint; every config runs it unchanged.
It writes shards.json (every index every rank saw, per epoch) for tests/.

Result: 23 samples, batch 4, 2 ranks: 12 per rank per epoch, measured 2026-11-22 on a 2-core CPU (docs/recipes.md).
"""

import argparse
import json
import os
import sys

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
    p.add_argument("--dataset-size", type=int, default=23, help="samples 0..N-1 (odd by default, on purpose)")
    p.add_argument("--batch-size", type=int, default=4, help="GLOBAL batch, split across all processes")
    p.add_argument("--epochs", type=int, default=2, help="epochs whose shards are shown")
    p.add_argument("--show-batches", type=int, default=3, help="batches per rank and epoch to print")
    p.add_argument("--seed", type=int, default=0, help="the shuffle's seed (every rank must share it)")
    p.add_argument("--drop-last", action="store_true", help="drop the short last batch instead of topping it up")
    p.add_argument("--unseeded", action="store_true",
                   help="skip set_seed (the mistake): the ranks then shuffle differently and overlap")
    p.add_argument("--output-dir", default="runs/data_sharding", help="summary.json and shards.json")
    args = p.parse_args(argv)
    problem = place_problem(args.output_dir, "--output-dir")  # a link or another user's directory: never written into
    if problem:
        p.error(problem.removeprefix("--output-dir "))
    return args


if __name__ == "__main__":
    parse_args()  # --help and a wrong flag answer here, before torch and the rest are imported (seconds)

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, gather_object, set_seed
from torch.utils.data import DataLoader


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
        summary = {"recipe": "data_sharding", "distributed_type": accelerator.distributed_type.value,
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


def main(argv=None):
    args = parse_args(argv)
    accelerator = checked_launch(
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True))
    if args.batch_size % accelerator.num_processes:  # split_batches: each process takes its slice of a global batch
        sys.exit(f"error: --batch-size {args.batch_size} is the global batch and must divide by the "
                 f"{accelerator.num_processes} processes: give --batch-size "
                 f"{max(1, args.batch_size // accelerator.num_processes) * accelerator.num_processes}")
    log = accelerator.print  # once, from the main process
    if not args.unseeded:
        set_seed(args.seed)  # before building the loader: the sampler takes its seed from here
    dataset = torch.arange(args.dataset_size)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=args.drop_last)
    loader = accelerator.prepare(loader)  # no model: only the loader needs preparing
    world = accelerator.num_processes
    log(f"{accelerator.distributed_type.value} | {world} processes | {args.dataset_size} samples | global batch "
        f"{args.batch_size} = {args.batch_size // world} per process | drop_last {args.drop_last} | "
        f"{'UNSEEDED' if args.unseeded else f'seed {args.seed}'}")
    epochs = []
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        mine, evaluated = [], []
        for batch in loader:
            mine.append(batch.tolist())
            # Inside the loop, as in an evaluation: on the last batch it drops the samples that were repeated.
            evaluated += accelerator.gather_for_metrics(batch).tolist()
        evaluated.sort()
        per_rank = gather_object([mine])  # one entry per rank, in rank order
        seen = [i for batches in per_rank for b in batches for i in b]
        repeated = len(seen) - len(set(seen))
        epochs.append({"epoch": epoch, "batches_per_rank": per_rank, "evaluated": evaluated,
                       "samples_per_rank": [sum(map(len, b)) for b in per_rank], "repeated": repeated,
                       "missing": sorted(set(range(args.dataset_size)) - set(seen))})
        for rank, batches in enumerate(per_rank):
            shown = " ".join(str(b) for b in batches[:args.show_batches])
            log(f"epoch {epoch} rank {rank}: {len(batches)} batches, {sum(map(len, batches))} samples | first: {shown}")
        log(f"epoch {epoch}: {len(set(seen))} of {args.dataset_size} samples seen, {repeated} seen twice, "
            f"{len(epochs[-1]['missing'])} never | gather_for_metrics returned {len(evaluated)} samples")
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        write_file(os.path.join(args.output_dir, "shards.json"), json.dumps(epochs))
    write_summary(accelerator, args.output_dir, {
        "steps_per_epoch": [len(e["batches_per_rank"][0]) for e in epochs],
        "samples_per_rank": epochs[0]["samples_per_rank"], "repeated_per_epoch": [e["repeated"] for e in epochs],
        "missing_per_epoch": [len(e["missing"]) for e in epochs],
        "evaluated_per_epoch": [len(e["evaluated"]) for e in epochs], "args": vars(args)})
    del loader
    return end(accelerator)


if __name__ == "__main__":
    sys.exit(main())
