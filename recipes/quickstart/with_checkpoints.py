r"""Quickstart, third level: with_accelerate.py plus checkpoints and a resume mid-epoch, with accelerate alone.

`diff -u with_accelerate.py with_checkpoints.py` is the whole change (34 added lines, 5 of them replacing the
Accelerator's construction, the loaders and the loops' heads; the docstring aside): accelerate's save_state every
--checkpoint-every steps into --checkpoint-dir/checkpoints/checkpoint_N (the newest 2 kept), and the same command
again load_state()s the newest, skips the batches its epoch already trained (skip_first_batches) and goes on.
    python recipes/quickstart/with_checkpoints.py --epochs 2             # stop it (Ctrl-C), run it again: it resumes
    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/2gpu.yaml --mixed_precision no \
        recipes/quickstart/with_checkpoints.py                  # DDP, 2 processes on a CPU
What this leaves to accelrun (src/accelrun, the full recipes): a save that a kill cannot leave half-written and
taken for a good one, loading that never runs code from a file, a stop signal that saves first, the checks that a
resume keeps the settings it was written with, another world size, a lock so that one run writes the directory.
The resume is exact: the sampler shuffles by (seed, epoch) and the loaders draw from generators of their own, so
the restored RNG state gives the uninterrupted run's dropout masks (tests/test_quickstart.py checks the numbers).
"""

import argparse
import os
import sys


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-dir", default="data", help="MNIST root: the folder that holds (or receives) MNIST/raw")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training set (0: only fetch the data)")
    p.add_argument("--batch-size", type=int, default=64, help="training batch, per process")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of AdamW")
    p.add_argument("--seed", type=int, default=1, help="seed of the initial weights, the shuffling and dropout")
    p.add_argument("--checkpoint-dir", default="quickstart-checkpoints", help="accelerate's save_state writes here")
    p.add_argument("--checkpoint-every", type=int, default=100, help="optimizer steps between checkpoints")
    return p.parse_args()


if __name__ == "__main__":
    parse_args()  # --help and a wrong flag answer here, before torch is imported (seconds)

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 16, 3), nn.Conv2d(16, 32, 3)
        self.fc1, self.fc2 = nn.Linear(32 * 12 * 12, 64), nn.Linear(64, 10)
        self.dropout = nn.Dropout(0.25)

    def forward(self, x):
        x = x.to(self.fc1.weight.dtype)  # bf16 where DeepSpeed made the weights bf16; else a no-op
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.dropout(F.relu(self.fc1(torch.flatten(x, 1))))
        return self.fc2(x).float()


class Progress:
    """The optimizer steps done, saved and restored with the checkpoint (accelerator.register_for_checkpointing)."""
    step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    accelerator = Accelerator(  # checkpoint_N folders, the newest 2 kept; a shuffle that depends on (seed, epoch) only
        project_config=ProjectConfiguration(args.checkpoint_dir, automatic_checkpoint_naming=True, total_limit=2),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    device = accelerator.device
    print = accelerator.print  # print once, on the main process
    print(accelerator.state)

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    try:
        train_set = datasets.MNIST(args.data_dir, train=True, download=True, transform=transform)
        test_set = datasets.MNIST(args.data_dir, train=False, download=True, transform=transform)
    except (OSError, RuntimeError) as exc:  # offline, and not in --data-dir yet: one line, not a traceback
        print(f"error: MNIST is not in {args.data_dir}/MNIST/raw and could not be downloaded "
              f"({str(exc).splitlines()[-1]}). Copy it there, or write stand-in digits in its format for a try "
              f"offline: python -m accelrun.data.synthetic_mnist data/synthetic, then --data-dir data/synthetic",
              file=sys.stderr)
        sys.exit(2)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              generator=torch.Generator().manual_seed(args.seed))  # the checkpoint's RNG state alone
    test_loader = DataLoader(test_set, batch_size=1000, generator=torch.Generator())  # drives the dropout masks
    model = Net().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)  # saved and restored with the model, optimizer and RNG states
    if os.path.isdir(os.path.join(args.checkpoint_dir, "checkpoints")):
        accelerator.load_state()  # the newest checkpoint_N
        accelerator.project_configuration.iteration = progress.step // args.checkpoint_every  # the next save's N
        print(f"resumed from step {progress.step}")

    for epoch in range(progress.step // len(train_loader) + 1, args.epochs + 1):
        model.train()
        train_loss, batches = 0.0, 0
        train_loader.set_epoch(epoch)  # the epoch's shuffle, the same in a resumed run
        done = progress.step - (epoch - 1) * len(train_loader)  # batches a resumed epoch already trained
        for data, target in accelerator.skip_first_batches(train_loader, done) if done else train_loader:
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            accelerator.backward(loss)
            optimizer.step()
            train_loss, batches = train_loss + loss.item(), batches + 1
            progress.step += 1
            if progress.step % args.checkpoint_every == 0:
                accelerator.save_state()  # into checkpoints/checkpoint_N; the oldest beyond 2 removed
        model.eval()
        test_loss, correct, count = 0.0, 0, 0
        with torch.no_grad():
            for data, target in test_loader:
                data, target = data.to(device), target.to(device)
                output = model(data)
                output, target = accelerator.gather_for_metrics((output, target))  # drops the padding
                test_loss += F.cross_entropy(output, target, reduction="sum").item()
                correct += (output.argmax(1) == target).sum().item()
                count += len(target)
        print(f"epoch {epoch}: train loss {train_loss / batches:.4f} | test loss {test_loss / count:.4f} | "
              f"test accuracy {100 * correct / count:.2f}% ({correct}/{count})")
    accelerator.end_training()  # destroys the process group, so every process exits cleanly


if __name__ == "__main__":
    main()
