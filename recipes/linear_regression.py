"""Data parallelism is large-batch SGD: fit y = m*x + n by SGD on 1 or many processes.

    python recipes/linear_regression.py --plot                                  # 1 process
    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/linear_regression.py --plot
    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/2gpu.yaml \\
        --mixed_precision no recipes/linear_regression.py                       # 2 processes on a CPU

The HPC-course lab: noisy points around a line, mean squared error, plain SGD. With a
GLOBAL --batch-size B, 2 processes each take B/2 samples of the same batch, each computes
the gradient of its half, and the all-reduce averages them: the average of two half-batch
mean gradients is exactly the mean gradient of the whole batch. So the trajectory of
(m, n) is the one a single process follows with batch B; only faster. tests/ check it
step by step (within 1e-6 in fp32).

--scale-lr multiplies the learning rate by the number of processes. Use it when you keep
the batch PER PROCESS fixed as you add processes (pass --batch-size = per-process batch x
processes): the global batch then grows with the world size, the gradient estimate gets
less noisy, and the linear scaling rule (Goyal et al. 2017) takes proportionally larger
steps to keep the progress per epoch. Leave it off when the global batch is fixed: the
run is then the same computation as on one process and needs the same learning rate.

--report-to tensorboard (or png) logs (m, n) and the loss; --profile 5 traces 5 steps.
--plot writes trajectory.png: the path of (m, n) over the contour lines of the loss,
and with --compare-batch-sizes the paths of batch size 1, this mini-batch and the full
batch computed on the main process for comparison, as in the lab.

Defaults: 1024 points of y = 2x - 1 + N(0, 0.5^2), global batch 32, SGD lr 0.1, 5 epochs.
Not for deepspeed_zero3_offload.yaml: optimizer offload replaces SGD by DeepSpeed's CPU Adam.

Result: m = 1.99, n = -0.98 in 160 steps (least squares 2.01, -1.00), measured 2026-11-22, 2-core CPU (docs/recipes.md).
"""

import argparse
import json
import math
import os
import sys

from accelrun import add_run_args


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num-points", type=int, default=1024, help="generated (x, y) samples")
    p.add_argument("--true-m", type=float, default=2.0, help="slope of the line the points scatter around")
    p.add_argument("--true-n", type=float, default=-1.0, help="intercept of that line")
    p.add_argument("--noise", type=float, default=0.5, help="standard deviation of the noise on y")
    p.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch, split across all processes")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    p.add_argument("--scale-lr", action="store_true",
                   help="multiply --lr by the number of processes (see the docstring for when)")
    p.add_argument("--epochs", type=int, default=5, help="passes over the points")
    p.add_argument("--init-m", type=float, default=-1.0, help="starting slope (the lab starts far from the fit)")
    p.add_argument("--init-n", type=float, default=2.0, help="starting intercept")
    p.add_argument("--seed", type=int, default=0, help="data and shuffling")
    p.add_argument("--plot", action="store_true", help="write trajectory.png (needs matplotlib)")
    p.add_argument("--compare-batch-sizes", action="store_true",
                   help="add the trajectories of batch size 1, this batch and the full batch to the plot")
    add_run_args(p, "linear_regression", log_every=20)  # every step's (m, n) goes to metrics.jsonl
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and a wrong flag answer here, before torch and the rest are imported (seconds)

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, broadcast, set_seed
from torch.utils.data import DataLoader, TensorDataset

from accelrun import Run


def make_points(args):
    generator = torch.Generator().manual_seed(args.seed)  # the same points on every rank
    x = torch.rand(args.num_points, 1, generator=generator) * 2 - 1
    y = args.true_m * x + args.true_n + args.noise * torch.randn(args.num_points, 1, generator=generator)
    return x, y


def mse_landscape(x, y, m, n):
    """Full-data MSE at (m, n) in closed form: mean((m x + n - y)^2); m and n may be grids."""
    sx, sy, sxx, sxy, syy = x.mean(), y.mean(), (x * x).mean(), (x * y).mean(), (y * y).mean()
    return m * m * sxx + n * n + syy + 2 * m * n * sx - 2 * m * sxy - 2 * n * sy


def plain_sgd(x, y, batch, args):
    """The single-process reference path for the plot: SGD on (m, n) with batch size `batch`."""
    generator = torch.Generator().manual_seed(args.seed)
    m, n, path = args.init_m, args.init_n, [(args.init_m, args.init_n)]
    for _ in range(args.epochs):
        order = torch.randperm(len(x), generator=generator)
        for i in range(0, len(x) - batch + 1, batch):
            xb, yb = x[order[i:i + batch]], y[order[i:i + batch]]
            residual = m * xb + n - yb
            m, n = m - args.lr * (2 * residual * xb).mean().item(), n - args.lr * 2 * residual.mean().item()
            path.append((m, n))
    return path


def plot(path, x, y, args, filename):
    import matplotlib
    matplotlib.use("Agg")  # no display on a compute node
    import matplotlib.pyplot as plt
    paths = {f"this run (global batch {args.batch_size})": path}
    if args.compare_batch_sizes:
        paths.update({f"batch size {b}": plain_sgd(x, y, b, args) for b in (1, args.batch_size, len(x))})
    points = [p for trajectory in paths.values() for p in trajectory]
    ms, ns = [p[0] for p in points], [p[1] for p in points]
    grid_m = torch.linspace(min(ms) - 0.5, max(ms) + 0.5, 200)
    grid_n = torch.linspace(min(ns) - 0.5, max(ns) + 0.5, 200)
    mm, nn_ = torch.meshgrid(grid_m, grid_n, indexing="xy")
    fig, ax = plt.subplots(figsize=(7, 6))
    contour = ax.contour(mm, nn_, mse_landscape(x, y, mm, nn_), levels=30, cmap="viridis")
    fig.colorbar(contour, label="mean squared error")
    for label, trajectory in paths.items():
        ax.plot([p[0] for p in trajectory], [p[1] for p in trajectory], ".-", markersize=3, linewidth=1, label=label)
    ax.set(xlabel="m (slope)", ylabel="n (intercept)", title="SGD on y = m x + n")
    ax.legend()
    fig.savefig(filename, dpi=120)
    plt.close(fig)


def current_line(model, accelerator):
    """Collective: (m, n) on every rank. Under ZeRO-3 and FSDP each rank holds only a shard of them, and the
    gathered weights reach the main process only; it passes them on. Under a *_compile.yaml the names carry
    torch.compile's `_orig_mod.` prefix."""
    state = accelerator.get_state_dict(model)  # None on the other ranks under ZeRO-3
    line = [0.0, 0.0]
    if accelerator.is_main_process:
        state = {name.removeprefix("_orig_mod."): value for name, value in state.items()}
        line = [state["weight"].item(), state["bias"].item()]
    return tuple(broadcast(torch.tensor(line, dtype=torch.float64, device=accelerator.device)).tolist())


def main(argv=None):
    args = parse_args(argv)
    run = Run("linear_regression", args, may_change={"plot": "drawn after training",
                                                     "compare_batch_sizes": "drawn after training"})
    accelerator = Accelerator(  # accelerate
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True))
    run.setup(accelerator, batch_size=args.batch_size,  # max_grad_norm 0: the lab is plain SGD, no clipping
              refuse_offload=("this lab is about SGD", "deepspeed_zero3.yaml (or any config without offload)"))
    set_seed(args.seed)
    x, y = make_points(args)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = torch.nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(args.init_m)
        model.bias.fill_(args.init_n)
    lr = args.lr * (accelerator.num_processes if args.scale_lr else 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # accelerate
    input_dtype = next(model.parameters()).dtype  # bf16 under DeepSpeed bf16
    run.start(model, optimizer, None, steps_per_epoch=len(loader), total_steps=len(loader) * args.epochs,
              describe=f"SGD lr {lr:g}")

    for batches in run.epochs(loader):  # resumes mid-epoch; checkpoints at each epoch's end
        for xb, yb in batches:
            loss = F.mse_loss(model(xb.to(input_dtype)).float(), yb)
            accelerator.backward(loss)  # accelerate
            optimizer.step()
            optimizer.zero_grad()
            m, n = current_line(model, accelerator)
            if run.step(loss, m=m, n=n):  # a stop signal, or the last step
                break
    if run.stopping:
        return run.finish(model)
    m, n = current_line(model, accelerator)
    # The exact least-squares line, for comparison: what SGD should approach.
    design = torch.cat([x, torch.ones_like(x)], 1).double()
    fit_m, fit_n = torch.linalg.lstsq(design, y.double()).solution.flatten().tolist()
    full_loss = mse_landscape(x.double(), y.double(), m, n).item()
    run.print(f"fitted y = {m:.4f} x {n:+.4f} (least squares: {fit_m:.4f} x {fit_n:+.4f}; true {args.true_m} x "
              f"{args.true_n:+}) | full-data loss {full_loss:.5f} (least squares "
              f"{mse_landscape(x.double(), y.double(), fit_m, fit_n).item():.5f})")
    if args.plot and accelerator.is_main_process:
        # The whole path, earlier runs of a resumed one included, is in metrics.jsonl.
        with open(os.path.join(run.output_dir, "metrics.jsonl")) as f:
            path = [(args.init_m, args.init_n)] + [(r["m"], r["n"]) for r in map(json.loads, f)]
        plot(path, x, y, args, os.path.join(run.output_dir, "trajectory.png"))
        run.print(f"wrote {os.path.join(run.output_dir, 'trajectory.png')}")
    return run.finish(model, m=m, n=n, full_loss=full_loss, least_squares={"m": fit_m, "n": fit_n},
                      distance_to_least_squares=math.hypot(m - fit_m, n - fit_n))


if __name__ == "__main__":
    sys.exit(main())
