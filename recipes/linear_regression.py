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

Results (defaults: 1024 points of y = 2x - 1 + N(0, 0.5^2), global batch 32, SGD lr 0.1,
5 epochs; measured 2026-11-22 on a 2-core CPU machine without GPU, fp32): m = 1.99,
n = -0.98 after 160 steps, against the least-squares fit m = 2.01, n = -1.00 (full-data
loss 0.2556 vs 0.2551: SGD's noise at a fixed rate); the same (m, n) at every step on
1 process and on 2 (DDP, ZeRO-1/2/3, FSDP), as tests/ check.
Not for deepspeed_zero3_offload.yaml: optimizer offload replaces SGD by DeepSpeed's CPU Adam.
"""

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, broadcast, set_seed
from torch.utils.data import DataLoader, TensorDataset

from runkit import checkpoints, checks, reporting, stopping
from runkit.run import resumable_epochs


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
    p.add_argument("--log-every", type=int, default=20, help="print (m, n) every N steps (all go to metrics.jsonl)")
    p.add_argument("--plot", action="store_true", help="write trajectory.png (needs matplotlib)")
    p.add_argument("--compare-batch-sizes", action="store_true",
                   help="add the trajectories of batch size 1, this batch and the full batch to the plot")
    p.add_argument("--output-dir", default="runs/linear_regression", help="summary.json, metrics.jsonl, trajectory.png")
    checkpoints.add_checkpoint_args(p)
    reporting.add_observability_args(p)
    return p.parse_args(argv)


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


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    stopper = stopping.GracefulStop(args.stop_signals, args.stop_check_every)
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True),
                              log_with="tensorboard" if args.report_to == "tensorboard" else None, project_dir=args.output_dir)
    checks.check_launch(accelerator)
    log = checks.main_print(accelerator)
    setup = checks.engine(accelerator)
    checks.refuse_optimizer_offload(accelerator, "this lab is about SGD", "deepspeed_zero3.yaml (or any config without offload)")
    checks.check_batch(accelerator, args.batch_size)
    set_seed(args.seed)
    x, y = make_points(args)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = torch.nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(args.init_m)
        model.bias.fill_(args.init_n)
    world = accelerator.num_processes
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr * (world if args.scale_lr else 1))
    checks.deepspeed_clip_like(accelerator, 0.0)  # the lab is plain SGD: no clipping
    model, optimizer, loader = accelerator.prepare(model, sgd, loader)
    optimizer_name = checks.stepping_optimizer(optimizer)
    steps_per_epoch, total_steps = len(loader), len(loader) * args.epochs
    log(f"{setup['distributed_type']} | {world} processes | mixed precision {setup['mixed_precision']} | ZeRO stage "
        f"{setup['deepspeed_stage'] or '-'} | {optimizer_name} lr {optimizer.param_groups[0]['lr']:g} | global batch "
        f"{args.batch_size} ({args.batch_size // world} per process) | {total_steps} steps")

    def current_line(model):
        # Collective: under ZeRO-3 and FSDP each rank holds only a shard of (m, n), and the gathered
        # weights reach the main process only; it passes them on, so every rank logs the same line.
        state = accelerator.get_state_dict(model)
        line = [state["weight"].item(), state["bias"].item()] if accelerator.is_main_process else [0.0, 0.0]
        return tuple(broadcast(torch.tensor(line, dtype=torch.float64, device=accelerator.device)).tolist())

    checkpointer = checkpoints.Checkpointer(accelerator, args.checkpoint_dir, args.keep_last, must_match={
        k: getattr(args, k) for k in ("num_points", "true_m", "true_n", "noise", "batch_size", "lr", "scale_lr",
                                      "epochs", "init_m", "init_n", "seed")})
    progress = {"epoch": 0, "step_in_epoch": 0, "step": 0, "path": [[args.init_m, args.init_n]], "train_time": 0.0}
    progress.update(checkpointer.resume(args.resume) or {})
    step, path = progress["step"], progress["path"]
    metrics = reporting.MetricsLog(accelerator, args.output_dir, step)
    reporting.start_tracking(accelerator, args)
    profiler = reporting.StepProfiler(accelerator, args.profile, args.output_dir)
    input_dtype = next(model.parameters()).dtype  # bf16 under DeepSpeed bf16
    stop_now, train_start = False, time.perf_counter()
    for epoch, done, batches in resumable_epochs(accelerator, loader, progress, args.epochs, steps_per_epoch):
        step_in_epoch = done
        for xb, yb in batches:
            loss = F.mse_loss(model(xb.to(input_dtype)).float(), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step, step_in_epoch = step + 1, step_in_epoch + 1
            profiler.step()
            m, n = current_line(model)
            path.append([m, n])
            batch_loss = accelerator.reduce(loss.detach(), "mean").item()
            metrics.write({"step": step, "epoch": epoch, "m": m, "n": n, "batch_loss": batch_loss,
                           "lr": optimizer.param_groups[0]["lr"]})
            if step % args.log_every == 0 or step in (1, total_steps):
                log(f"epoch {epoch} step {step}/{total_steps} | m {m:+.6f} n {n:+.6f} | batch loss {batch_loss:.5f}")
            stop_now = stopper.agreed(accelerator)
            finished = step_in_epoch == steps_per_epoch
            if args.checkpoint_dir and (stop_now or finished or (args.checkpoint_every and step % args.checkpoint_every == 0)):
                checkpointer.save(step, {"epoch": epoch + finished, "step_in_epoch": 0 if finished else step_in_epoch,
                                         "step": step, "path": path,
                                         "train_time": progress["train_time"] + time.perf_counter() - train_start})
            if stop_now:
                break
        if stop_now:
            break
    train_time = progress["train_time"] + time.perf_counter() - train_start
    profiler.stop()
    if stop_now:
        code = stopping.stopped(accelerator, stopper, step, args.checkpoint_dir)
        del model, optimizer, loader
        checks.finish(accelerator)
        return code
    m, n = current_line(model)
    if accelerator.is_main_process:
        # The exact least-squares line, for comparison: what SGD should approach.
        design = torch.cat([x, torch.ones_like(x)], 1).double()
        fit_m, fit_n = torch.linalg.lstsq(design, y.double()).solution.flatten().tolist()
        full_loss = mse_landscape(x.double(), y.double(), m, n).item()
        log(f"fitted y = {m:.4f} x {n:+.4f} (least squares: {fit_m:.4f} x {fit_n:+.4f}; true {args.true_m} x "
            f"{args.true_n:+}) | full-data loss {full_loss:.5f} (least squares "
            f"{mse_landscape(x.double(), y.double(), fit_m, fit_n).item():.5f})")
        if args.plot:
            plot(path, x, y, args, os.path.join(args.output_dir, "trajectory.png"))
            log(f"wrote {os.path.join(args.output_dir, 'trajectory.png')}")
        metrics.close()
        if args.report_to != "none":
            log(f"curves: {reporting.plot_curves(args.output_dir, 'linear regression')}")
        reporting.write_summary(args.output_dir, {
            "recipe": "linear_regression", **setup, "optimizer": optimizer_name, "steps": step,
            "resumed_from_step": progress["step"] or None, "m": m, "n": n, "full_loss": full_loss,
            "least_squares": {"m": fit_m, "n": fit_n}, "distance_to_least_squares": math.hypot(m - fit_m, n - fit_n),
            "samples_per_s": step * args.batch_size / train_time if step else 0.0,
            "wall_time_s": time.perf_counter() - t_start, "args": vars(args)})
    del model, optimizer, loader
    checks.finish(accelerator)
    return 0


if __name__ == "__main__":
    sys.exit(main())
