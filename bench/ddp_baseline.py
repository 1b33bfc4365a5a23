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


def main():
    args = parse_args()
    t_start = time.perf_counter()
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(args.seed)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    if args.pipeline == "per-sample":
        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])
        train_set = datasets.MNIST(args.data_root, train=True, transform=transform)
        test_set = datasets.MNIST(args.data_root, train=False, transform=transform)
    else:
        train_raw, test_raw = (datasets.MNIST(args.data_root, train=t) for t in (True, False))
        train_set = TensorDataset(train_raw.data, train_raw.targets)
        test_set = TensorDataset(test_raw.data, test_raw.targets)

    def to_input(images):  # the per-sample pipeline has already normalised every image in the loader
        if args.pipeline == "per-sample":
            return images
        return ((images.to(dtype=torch.float32) / 255.0 - MNIST_MEAN) / MNIST_STD).unsqueeze(1)

    per_rank = args.batch_size // world
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader_kwargs = dict(num_workers=args.num_workers, pin_memory=device.type == "cuda",
                         persistent_workers=args.num_workers > 0)
    train_loader = DataLoader(train_set, batch_size=per_rank, sampler=sampler, drop_last=True, **loader_kwargs)
    test_loader = DataLoader(test_set, batch_size=1000 // world,
                             sampler=DistributedSampler(test_set, num_replicas=world, rank=rank, shuffle=False))

    model = DistributedDataParallel(ConvNet().to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total_steps = len(train_loader) * args.epochs
    total_steps = min(total_steps, args.max_steps) if args.max_steps else total_steps
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total_steps, 1))

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        metrics, evals = (open(os.path.join(args.output_dir, name), "w") for name in ("metrics.jsonl", "eval.jsonl"))
        print(f"DDP by hand | {world} processes | {dist.get_backend()} | {args.pipeline} pipeline | global batch "
              f"{args.batch_size} | {total_steps} steps", flush=True)
    phases = {"data": 0.0, "forward_backward": 0.0, "optimizer": 0.0}
    steady = dict(phases, micro_batches=0)
    window_loss, window_steps, step, first_step_at, accuracy = torch.zeros((), device=device), 0, 0, None, None
    train_start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        mark = time.perf_counter()
        for images, labels in train_loader:
            # As in the recipe, where accelerate's loader places the batch: the copy counts as data.
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            sync()
            now = time.perf_counter()
            phases["data"], mark = now - mark, now
            loss = F.cross_entropy(model(to_input(images)), labels)
            loss.backward()
            sync()
            now = time.perf_counter()
            phases["forward_backward"], mark = now - mark, now
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            sync()
            now = time.perf_counter()
            phases["optimizer"], mark = now - mark, now
            if first_step_at is None:
                first_step_at = time.time()
            else:
                steady["micro_batches"] += 1
                for phase, seconds in phases.items():
                    steady[phase] += seconds
            step += 1
            window_loss += loss.detach()
            window_steps += 1
            if step % args.log_every == 0 or step in (1, total_steps):
                dist.all_reduce(window_loss)
                if rank == 0:
                    metrics.write(json.dumps({"step": step, "loss": window_loss.item() / world / window_steps,
                                              "train_time_s": time.perf_counter() - train_start}) + "\n")
                window_loss.zero_()
                window_steps = 0
                mark = time.perf_counter()
            if step >= total_steps:
                break
        model.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for images, labels in test_loader:
                images, labels = images.to(device), labels.to(device)
                hits = (model(to_input(images)).argmax(1) == labels).sum()
                correct += torch.stack([hits, torch.tensor(labels.numel(), device=device)])
        model.train()
        dist.all_reduce(correct)
        accuracy = (correct[0] / correct[1]).item()
        if rank == 0:
            evals.write(json.dumps({"step": step, "epoch": epoch, "test_accuracy": accuracy,
                                    "train_time_s": time.perf_counter() - train_start}) + "\n")
            print(f"epoch {epoch} | step {step} | test accuracy {100 * accuracy:.2f}%", flush=True)
        if step >= total_steps:
            break

    peak = (torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        n, total = max(steady["micro_batches"], 1), sum(steady[p] for p in phases)
        summary = {"recipe": "ddp_baseline", "pipeline": args.pipeline, "distributed_type": "DDP by hand",
                   "world_size": world, "steps": step, "test_accuracy": accuracy,
                   "timing": {"micro_batches": steady["micro_batches"], "first_step_at": first_step_at,
                              **{f"{p}_ms": 1000 * steady[p] / n for p in phases}, "other_ms": 0.0,
                              "samples_per_s": steady["micro_batches"] * args.batch_size / max(total, 1e-9),
                              "data_fraction": steady["data"] / max(total, 1e-9), "optimizer_in_backward": False},
                   "peak_memory_mb": max(peaks), "peak_memory_mb_per_rank": peaks,
                   "peak_memory_kind": "cuda_allocated" if device.type == "cuda" else "cpu_max_rss",
                   "wall_time_s": time.perf_counter() - t_start, "args": vars(args)}
        metrics.close()
        evals.close()
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print("SUMMARY " + json.dumps({k: v for k, v in summary.items() if k != "args"}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
