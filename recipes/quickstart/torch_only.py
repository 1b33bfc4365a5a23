r"""Quickstart: MNIST in plain PyTorch (torch_only.py) and the same file with Accelerate (with_accelerate.py).

`diff -u torch_only.py with_accelerate.py` is the whole change: 9 added lines, each naming accelerate.
    python recipes/quickstart/torch_only.py                    # 1 process: the GPU if there is one, else CPU
    python recipes/quickstart/with_accelerate.py               # the same, through accelerate
    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/quickstart/with_accelerate.py
    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/2gpu.yaml --mixed_precision no \
        recipes/quickstart/with_accelerate.py                  # DDP, 2 processes on a CPU
    PYTHONPATH=cpu_route accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml \
        --deepspeed_config_file accelerate_configs/deepspeed_zero2_fp32.json \
        recipes/quickstart/with_accelerate.py                  # DeepSpeed ZeRO-2 in fp32, 2 processes on a CPU
Any config of accelerate_configs/ fits (ZeRO-1/2/3, ZeRO-3 offload, FSDP2); a DeepSpeed JSON sets the precision,
which --mixed_precision does not change: each has an fp32 twin, NAME_fp32.json. --batch-size is per process; the
train loss is the printing process's, the test numbers cover the whole test set. MNIST is downloaded into
--data-dir: fetch it once (`python recipes/quickstart/torch_only.py --epochs 0`) before launching processes;
offline, `python -m accelrun.data.synthetic_mnist data/synthetic` writes stand-in digits (--data-dir data/synthetic).
Model after pytorch/examples mnist/main.py, narrower. Under DeepSpeed accelerate clips gradients at norm 1.0
('auto'), and ZeRO-3 offload replaces the optimizer by DeepSpeedCPUAdam (lr kept): so AdamW, not Adadelta.
"""

import argparse
import sys


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-dir", default="data", help="MNIST root: the folder that holds (or receives) MNIST/raw")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training set (0: only fetch the data)")
    p.add_argument("--batch-size", type=int, default=64, help="training batch, per process")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of AdamW")
    p.add_argument("--seed", type=int, default=1, help="seed of the initial weights, the shuffling and dropout")
    return p.parse_args()


if __name__ == "__main__":
    parse_args()  # --help and a wrong flag answer here, before torch is imported (seconds)

import torch
import torch.nn as nn
import torch.nn.functional as F
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


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

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
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=1000)
    model = Net().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_loss, batches = 0.0, 0
        for data, target in train_loader:
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            train_loss, batches = train_loss + loss.item(), batches + 1
        model.eval()
        test_loss, correct, count = 0.0, 0, 0
        with torch.no_grad():
            for data, target in test_loader:
                data, target = data.to(device), target.to(device)
                output = model(data)
                test_loss += F.cross_entropy(output, target, reduction="sum").item()
                correct += (output.argmax(1) == target).sum().item()
                count += len(target)
        print(f"epoch {epoch}: train loss {train_loss / batches:.4f} | test loss {test_loss / count:.4f} | "
              f"test accuracy {100 * correct / count:.2f}% ({correct}/{count})")


if __name__ == "__main__":
    main()
