"""The MNIST recipe written by hand with PyTorch DDP, the way the HPC courses teach it.

    torchrun --nproc_per_node 2 bench/ddp_baseline.py --data-root data/synthetic-20000-5000
    torchrun --nproc_per_node 2 bench/ddp_baseline.py --data-root ... --pipeline tensor

init_process_group, DistributedSampler, DistributedDataParallel, and (--pipeline
per-sample, the default) a DataLoader that runs ToTensor + Normalize on every image
in Python. --pipeline tensor keeps the uint8 tensors whole and normalises each batch
on the device, as recipes/mnist.py does: comparing the two isolates the cost of the
input pipeline; comparing the tensor baseline with the recipe isolates the cost of
accelerate. bench/benchmark.py runs all three and reports the ratios.

Same model (ConvNet of recipes/mnist.py; a test checks the parameter shapes), same
optimisation (AdamW, cosine decay, clipping at 1.0), same GLOBAL batch (--batch-size,
split over the ranks), same step timer (data wait / forward+backward / optimizer, the
device synchronised at each mark on GPUs), same summary.json "timing" block.
It is a benchmark baseline, not a recipe: it has no checkpoints and no error handling
beyond what the courses show.
"""

import argparse
import json
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchvision import datasets, transforms

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-root", required=True, help="folder holding MNIST/raw (real or synthetic)")
    p.add_argument("--pipeline", choices=["per-sample", "tensor"], default="per-sample",
                   help="per-sample: ToTensor+Normalize per image in the DataLoader; tensor: the recipe's")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes (per-sample pipeline)")
    p.add_argument("--batch-size", type=int, default=128, help="GLOBAL batch, split over the ranks")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--output-dir", default="runs/ddp_baseline")
    return p.parse_args()


class ConvNet(nn.Module):  # recipes/mnist.py's model with BatchNorm
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5, padding=2, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, padding=2, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(7 * 7 * 32, 10)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def init_distributed():
    """(rank, world size, device): torchrun's variables, one GPU per local rank where there are GPUs."""
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def mnist_sets(args):
    """(train set, test set, to_input): the per-sample pipeline normalises every image in the loader, the tensor
    pipeline keeps the uint8 tensors and normalises each batch on the device (to_input), as the recipe does."""
    if args.pipeline == "per-sample":
        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])
        return (datasets.MNIST(args.data_root, train=True, transform=transform),
                datasets.MNIST(args.data_root, train=False, transform=transform), lambda images: images)
    train_raw, test_raw = (datasets.MNIST(args.data_root, train=t) for t in (True, False))

    def to_input(images):
        return ((images.to(dtype=torch.float32) / 255.0 - MNIST_MEAN) / MNIST_STD).unsqueeze(1)
    return TensorDataset(train_raw.data, train_raw.targets), TensorDataset(test_raw.data, test_raw.targets), to_input


class PhaseClock:
    """The step split of the recipes' timer by hand: data wait, forward+backward, optimizer, the device
    synchronised at each mark (the courses' way); the first step (start-up) stays out of the steady sums."""
    PHASES = ("data", "forward_backward", "optimizer")

    def __init__(self, device):
        self.sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        self.phases = dict.fromkeys(self.PHASES, 0.0)
        self.steady = dict(self.phases, micro_batches=0)
        self.first_step_at = None
        self.restart()

    def restart(self):
        """From now: after logging, which is no phase of the next step."""
        self.last = time.perf_counter()

    def mark(self, phase):
        self.sync()
        now = time.perf_counter()
        self.phases[phase], self.last = now - self.last, now

    def step_done(self):
        if self.first_step_at is None:
            self.first_step_at = time.time()
            return
        self.steady["micro_batches"] += 1
        for phase, seconds in self.phases.items():
            self.steady[phase] += seconds

    def timing(self, global_batch):
        """The summary's "timing" block, with the recipes' keys."""
        n, total = max(self.steady["micro_batches"], 1), sum(self.steady[p] for p in self.PHASES)
        return {"micro_batches": self.steady["micro_batches"], "first_step_at": self.first_step_at,
                **{f"{p}_ms": 1000 * self.steady[p] / n for p in self.PHASES}, "other_ms": 0.0,
                "samples_per_s": self.steady["micro_batches"] * global_batch / max(total, 1e-9),
                "data_fraction": self.steady["data"] / max(total, 1e-9), "optimizer_in_backward": False}


def train_epoch(args, training, loader, to_input, clock, log, step):
    """One epoch of the loop the courses write, timed phase by phase; returns the step reached."""
    model, optimizer, scheduler, device = training
    clock.restart()
    for images, labels in loader:
        # As in the recipe, where accelerate's loader places the batch: the copy counts as data.
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        clock.mark("data")
        loss = F.cross_entropy(model(to_input(images)), labels)
        loss.backward()
        clock.mark("forward_backward")
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        clock.mark("optimizer")
        clock.step_done()
        step += 1
        if log.add(step, loss):
            clock.restart()
        if step >= log.total_steps:
            break
    return step


def test_accuracy(model, loader, to_input, device):
    """Every rank counts its share of the test set; the counts are summed over the ranks."""
    model.eval()
    correct = torch.zeros(2, device=device)
    with torch.no_grad():
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            hits = (model(to_input(images)).argmax(1) == labels).sum()
            correct += torch.stack([hits, torch.tensor(labels.numel(), device=device)])
    model.train()
    dist.all_reduce(correct)
    return (correct[0] / correct[1]).item()


class Log:
    """The loss window (summed on the device, all-reduced at each record) and rank 0's metrics.jsonl and
    eval.jsonl, in the recipes' format."""

    def __init__(self, args, rank, world, device, total_steps):
        self.rank, self.world, self.every, self.total_steps = rank, world, args.log_every, total_steps
        self.window_loss, self.window_steps = torch.zeros((), device=device), 0
        self.train_start = time.perf_counter()
        if rank == 0:
            os.makedirs(args.output_dir, exist_ok=True)
            self.metrics, self.evals = (open(os.path.join(args.output_dir, name), "w")
                                        for name in ("metrics.jsonl", "eval.jsonl"))
            print(f"DDP by hand | {world} processes | {dist.get_backend()} | {args.pipeline} pipeline | global batch "
                  f"{args.batch_size} | {total_steps} steps", flush=True)

    def add(self, step, loss):
        """Adds the step's loss; at a record step writes the window's mean and returns True."""
        self.window_loss += loss.detach()
        self.window_steps += 1
        if not (step % self.every == 0 or step in (1, self.total_steps)):
            return False
        dist.all_reduce(self.window_loss)
        if self.rank == 0:
            mean = self.window_loss.item() / self.world / self.window_steps
            self.metrics.write(json.dumps({"step": step, "loss": mean,
                                           "train_time_s": time.perf_counter() - self.train_start}) + "\n")
        self.window_loss.zero_()
        self.window_steps = 0
        return True

    def evaluation(self, step, epoch, accuracy):
        if self.rank == 0:
            self.evals.write(json.dumps({"step": step, "epoch": epoch, "test_accuracy": accuracy,
                                         "train_time_s": time.perf_counter() - self.train_start}) + "\n")
            print(f"epoch {epoch} | step {step} | test accuracy {100 * accuracy:.2f}%", flush=True)

    def close(self):
        if self.rank == 0:
            self.metrics.close()
            self.evals.close()


def main():
    args = parse_args()
    t_start = time.perf_counter()
    rank, world, device = init_distributed()
    torch.manual_seed(args.seed)
    train_set, test_set, to_input = mnist_sets(args)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader_kwargs = dict(num_workers=args.num_workers, pin_memory=device.type == "cuda",
                         persistent_workers=args.num_workers > 0)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler, drop_last=True,
                              **loader_kwargs)
    test_loader = DataLoader(test_set, batch_size=1000 // world,
                             sampler=DistributedSampler(test_set, num_replicas=world, rank=rank, shuffle=False))

    model = DistributedDataParallel(ConvNet().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total_steps = len(train_loader) * args.epochs
    total_steps = min(total_steps, args.max_steps) if args.max_steps else total_steps
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total_steps, 1))

    log, clock = Log(args, rank, world, device, total_steps), PhaseClock(device)
    step, accuracy = 0, None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        step = train_epoch(args, (model, optimizer, scheduler, device), train_loader, to_input, clock, log, step)
        accuracy = test_accuracy(model, test_loader, to_input, device)
        log.evaluation(step, epoch, accuracy)
        if step >= total_steps:
            break

    peak = (torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        summary = {"recipe": "ddp_baseline", "pipeline": args.pipeline, "distributed_type": "DDP by hand",
                   "world_size": world, "steps": step, "test_accuracy": accuracy,
                   "timing": clock.timing(args.batch_size),
                   "peak_memory_mb": max(peaks), "peak_memory_mb_per_rank": peaks,
                   "peak_memory_kind": "cuda_allocated" if device.type == "cuda" else "cpu_max_rss",
                   "wall_time_s": time.perf_counter() - t_start, "args": vars(args)}
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print("SUMMARY " + json.dumps({k: v for k, v in summary.items() if k != "args"}), flush=True)
    log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
