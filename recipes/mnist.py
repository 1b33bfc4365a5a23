"""MNIST ConvNet: one script for 1 CPU, 2 GPUs, several nodes, DeepSpeed ZeRO or FSDP.

    python recipes/mnist.py                                                       # 1 process
    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/mnist.py # DDP, 2 GPUs, bf16
    accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml recipes/mnist.py
    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/2gpu.yaml \\
        recipes/mnist.py                                                          # 2 processes on a CPU

Swapping the config file is the whole change; Slurm users see launch/.
Checkpoints and stopping (README "Stopping and resuming"): add --checkpoint-dir ckpt; a
stop signal (SIGUSR1/SIGTERM) saves and exits 75, and the same command again resumes
exactly where it stopped, mid-epoch included.
Watching a run: --report-to tensorboard (or png) draws curves, --profile 5 traces 5 steps.

The model is the ConvNet of the HPC courses (two 5x5 conv + BatchNorm + max-pool
blocks, one linear layer). `--batch-size` is the GLOBAL batch: accelerate splits
each batch across the processes, so 1 process or 8 see the same samples per step
and need the same learning rate; `--scale-lr` multiplies it by the world size
only for those who want the per-GPU-batch habit of other recipes.

Data: `--data auto` (default) reads real MNIST from --data-dir or downloads it,
and falls back to a synthetic digit set, written in MNIST's own idx format and
read through the same torchvision loader, saying so loudly. `--data mnist`
never falls back; `--data synthetic` never downloads.

Gradient accumulation (`--grad-accum K`) gives exactly the gradients of one
K-times larger batch only without BatchNorm (`--no-batchnorm`): BatchNorm
normalises each micro-batch with its own statistics.

Results (defaults: 3 epochs, global batch 128, AdamW 1e-3 with cosine decay):
  * synthetic digits (20k train / 5k test), fp32, measured 2026-11-22 on a
    2-core CPU machine without GPU: 99.98% test accuracy, final train loss
    0.0019, identically for 1 process (1300 samples/s), DDP on 2 processes
    (1960 samples/s), ZeRO-2, ZeRO-3 and FSDP2 (table in README.md).
  * real MNIST: these are the usual course settings that reach 99% in 3
    epochs, but the machines this was written on cannot download MNIST, so
    that figure is NOT re-measured here.
"""

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset
from torchvision.datasets import MNIST
from tqdm import tqdm

from checkpointing import Checkpointer, GracefulStop, add_checkpoint_args, stopped
from common import (MetricsLog, StepProfiler, Window, add_observability_args, cast_buffers_for_half_precision,
                    check_batch, check_deepspeed_flags, check_launch, deepspeed_clip_like, engine, fail, finish,
                    footprint, plot_curves, printer, resumable_epochs, start_tracking, stepping_optimizer,
                    tracking, write_summary)
from synthetic_mnist import write_synthetic_mnist

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", choices=["auto", "mnist", "synthetic"], default="auto",
                   help="auto: real MNIST if present or downloadable, else synthetic digits")
    p.add_argument("--data-dir", default="data", help="where MNIST lives or is downloaded to")
    p.add_argument("--synthetic-train-size", type=int, default=20000, help="training images when synthetic")
    p.add_argument("--synthetic-test-size", type=int, default=5000, help="test images when synthetic")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    p.add_argument("--batch-size", type=int, default=128, help="GLOBAL batch, split across all processes")
    p.add_argument("--eval-batch-size", type=int, default=1000, help="GLOBAL evaluation batch")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of AdamW")
    p.add_argument("--scale-lr", action="store_true",
                   help="multiply --lr by the number of processes (linear scaling rule); off by default "
                        "because --batch-size is already global")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0,
                   help="gradient clipping; DeepSpeed's own 'auto' value is the same 1.0")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm statistics over the global batch")
    p.add_argument("--no-batchnorm", action="store_true", help="drop BatchNorm (exact --grad-accum equivalence)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log-every", type=int, default=50, help="print a progress line every N steps")
    p.add_argument("--output-dir", default="runs/mnist", help="summary.json, metrics.jsonl, model.safetensors")
    p.add_argument("--timeout", type=int, default=300,
                   help="seconds a collective waits for a missing rank before the run fails")
    add_checkpoint_args(p)
    add_observability_args(p)
    return p.parse_args(argv)


class ConvNet(nn.Module):
    def __init__(self, batchnorm=True):
        super().__init__()
        norm = nn.BatchNorm2d if batchnorm else (lambda channels: nn.Identity())
        # A conv bias right before BatchNorm is cancelled by it: its gradient is pure rounding
        # noise, which Adam would amplify into steps of size lr. Keep the bias only without BN.
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5, padding=2, bias=not batchnorm), norm(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, padding=2, bias=not batchnorm), norm(32), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(7 * 7 * 32, 10)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def load_mnist(args, accelerator):
    """Return (train, test, source); each split is (uint8 images N x 28 x 28, int64 labels)."""
    source = "synthetic" if args.data == "synthetic" else "mnist"
    # The main process downloads or generates first, then the first process of every other node
    # (node-local disks), then the rest read what those wrote.
    with accelerator.main_process_first(), accelerator.local_main_process_first():
        if source == "mnist":
            try:
                splits = [MNIST(args.data_dir, train=t, download=accelerator.is_local_main_process) for t in (True, False)]
            except Exception as exc:  # not on disk and no network, a proxy, a read-only disk...
                if args.data == "mnist":
                    fail(accelerator, f"MNIST is not in {args.data_dir!r} and could not be downloaded "
                                      f"({type(exc).__name__}: {exc}). Compute nodes often have no internet: "
                                      f"download it on a login node (python recipes/mnist.py --data mnist "
                                      f"--epochs 0) or point --data-dir at a local copy.")
                source = "synthetic"
        if source == "synthetic":
            root = os.path.join(args.data_dir, f"synthetic-{args.synthetic_train_size}-{args.synthetic_test_size}")
            if accelerator.is_local_main_process:
                write_synthetic_mnist(root, args.synthetic_train_size, args.synthetic_test_size, seed=0)
            splits = [MNIST(root, train=t) for t in (True, False)]
    # Every rank must train on the same data; a node that lacks MNIST on its own disk would not.
    real = accelerator.gather(torch.tensor([int(source == "mnist")], device=accelerator.device))
    if real.min() != real.max():
        fail(accelerator, f"only some ranks found MNIST in {args.data_dir!r}; put it on storage every node sees.")
    return (splits[0].data, splits[0].targets), (splits[1].data, splits[1].targets), source


def to_input(images, dtype):
    """uint8 batch -> normalised float NCHW, done on the device rather than per sample in Python."""
    return ((images.to(dtype=torch.float32) / 255.0 - MNIST_MEAN) / MNIST_STD).unsqueeze(1).to(dtype)


def evaluate(model, loader, accelerator, input_dtype):
    model.eval()
    correct, count, loss_sum = 0, 0, 0.0
    with torch.no_grad():
        for images, labels in loader:
            logits = model(to_input(images, input_dtype)).float()
            # gather_for_metrics drops the samples accelerate repeated to even out the last batch.
            logits, labels = accelerator.gather_for_metrics((logits, labels))
            correct += (logits.argmax(1) == labels).sum().item()
            loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
            count += labels.numel()
    model.train()
    return correct / count, loss_sum / count, count


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    stopper = GracefulStop(args.stop_signals, args.stop_check_every)  # first: a signal may come during start-up
    accelerator = Accelerator(
        gradient_accumulation_steps=args.grad_accum,
        # split_batches: the loader yields GLOBAL batches and each process takes its slice.
        # use_seedable_sampler: the same shuffle on every rank and for every world size.
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.timeout))],
        **tracking(args),  # --report-to tensorboard: accelerate's own tracker
    )
    check_launch(accelerator)
    log = printer(accelerator)
    world = accelerator.num_processes
    micro_batch = args.batch_size // args.grad_accum  # global samples per forward pass
    check_batch(accelerator, args.batch_size, args.grad_accum, args.eval_batch_size)
    set_seed(args.seed)  # before the loaders: the seedable sampler takes its seed from here

    (train_x, train_y), (test_x, test_y), source = load_mnist(args, accelerator)
    if source == "synthetic":
        log(f"DATA: real MNIST unavailable, training on SYNTHETIC digits ({len(train_x)} train / {len(test_x)} test)")
    train_loader = DataLoader(TensorDataset(train_x, train_y), batch_size=micro_batch, shuffle=True, drop_last=True)
    test_loader = DataLoader(TensorDataset(test_x, test_y), batch_size=args.eval_batch_size)

    model = ConvNet(batchnorm=not args.no_batchnorm)
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    lr = args.lr * (world if args.scale_lr else 1)
    optimizer = adamw = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(train_loader) // args.grad_accum
    total_steps = steps_per_epoch * args.epochs
    total_steps = min(total_steps, args.max_steps) if args.max_steps else total_steps
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total_steps, 1))
    deepspeed_clip_like(accelerator, args.max_grad_norm)
    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, test_loader, scheduler)
    check_deepspeed_flags(accelerator, args.grad_accum, args.max_grad_norm)
    optimizer_name = stepping_optimizer(optimizer, adamw, scheduler)
    cast_buffers_for_half_precision(accelerator, model)
    input_dtype = next(model.parameters()).dtype  # bf16 under DeepSpeed bf16, else fp32 (autocast casts)
    setup = engine(accelerator)
    log(f"{setup['distributed_type']} | {world} processes | mixed precision {setup['mixed_precision']} | "
        f"ZeRO stage {setup['deepspeed_stage'] or '-'} | optimizer {optimizer_name} | global batch {args.batch_size} "
        f"({args.grad_accum} x {micro_batch // world} per process) | {total_steps} steps")

    # Resume before opening the logs: a requeued job continues from its newest complete checkpoint.
    checkpointer = Checkpointer(accelerator, args.checkpoint_dir, args.keep_last, must_match={
        "data_source": source, "train_samples": len(train_x), "total_steps": total_steps,
        **{k: getattr(args, k) for k in ("batch_size", "grad_accum", "seed", "lr", "scale_lr", "weight_decay",
                                         "max_grad_norm", "no_batchnorm", "sync_bn")}})
    progress = {"epoch": 0, "step_in_epoch": 0, "step": 0, "epochs_run": 0, "first_loss": None,
                "final_loss": None, "epoch_loss": 0.0, "data_time": 0.0, "compute_time": 0.0, "train_time": 0.0}
    progress.update(checkpointer.resume(args.resume) or {})
    step, first_loss, final_loss = progress["step"], progress["first_loss"], progress["final_loss"]
    metrics = MetricsLog(accelerator, args.output_dir, step)
    evals = MetricsLog(accelerator, args.output_dir, step, "eval.jsonl")
    start_tracking(accelerator, args)
    profiler = StepProfiler(accelerator, args.profile, args.output_dir)
    bar = tqdm(total=total_steps, initial=step, disable=not (accelerator.is_main_process and sys.stdout.isatty()))
    window = Window(accelerator, progress["data_time"], progress["compute_time"])
    fingerprint = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    accuracy, stopping = None, False
    train_start = time.perf_counter()

    def save_checkpoint(epoch, step_in_epoch, epoch_loss):
        # Collective: the running loss is per rank, the checkpoint keeps its mean over ranks.
        checkpointer.save(step, {
            **progress, "epoch": epoch, "step_in_epoch": step_in_epoch, "step": step, "first_loss": first_loss,
            "final_loss": final_loss, "epoch_loss": accelerator.reduce(epoch_loss, "mean").item(),
            "data_time": window.total_data, "compute_time": window.total_compute,
            "train_time": progress["train_time"] + time.perf_counter() - train_start})

    for epoch, done, batches in resumable_epochs(accelerator, train_loader, progress, args.epochs,
                                                 steps_per_epoch, args.grad_accum):
        if step >= total_steps:
            break
        epoch_loss = torch.tensor(progress["epoch_loss"] if done else 0.0, dtype=torch.float64, device=accelerator.device)
        epoch_micro, step_in_epoch = done * args.grad_accum, done
        progress["epochs_run"] += 0 if done else 1
        window.mark = time.perf_counter()
        for images, labels in batches:
            window.data_ready()
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(to_input(images, input_dtype)).float(), labels)
                accelerator.backward(loss)
                window.backward_done()
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            epoch_loss += loss.detach()
            epoch_micro += 1
            # Changes with the exact samples and their order on this rank: tests compare it across resumes.
            fingerprint += (labels.double() * torch.arange(1, len(labels) + 1, device=labels.device)).sum() \
                + images.double().mean()
            window.step_done(loss)
            if not accelerator.sync_gradients:
                continue
            step, step_in_epoch = step + 1, step_in_epoch + 1
            bar.update(1)
            profiler.step()
            if step % args.log_every == 0 or step == total_steps or step == 1:
                record = window.record(micro_batch, step=step, epoch=epoch, lr=optimizer.param_groups[0]["lr"],
                                       train_time_s=progress["train_time"] + time.perf_counter() - train_start,
                                       rank_fingerprints=accelerator.gather(fingerprint.view(1)).tolist())
                fingerprint.zero_()
                first_loss = record["loss"] if first_loss is None else first_loss
                metrics.write(record)
                line = (f"epoch {epoch} step {step}/{total_steps} | loss {record['loss']:.4f} | "
                        f"{record['samples_per_s']:.0f} samples/s | per micro-batch: data {record['data_ms']:.1f} ms, "
                        f"forward+backward {record['forward_backward_ms']:.1f} ms, optimizer {record['optimizer_ms']:.1f} ms, "
                        f"other {record['other_ms']:.1f} ms")
                tqdm.write(line) if not bar.disable else log(line)
            stopping = stopper.agreed(accelerator)  # every rank, every step: nobody waits for a rank that left
            if args.checkpoint_dir and (stopping or (args.checkpoint_every and step % args.checkpoint_every == 0)):
                save_checkpoint(epoch, step_in_epoch, epoch_loss)
            window.bookkeeping_done()
            if stopping or step >= total_steps:
                break
        if stopping:
            break
        final_loss = accelerator.reduce(epoch_loss / max(epoch_micro, 1), "mean").item()
        accuracy, test_loss, test_count = evaluate(model, test_loader, accelerator, input_dtype)
        evals.write({"step": step, "epoch": epoch, "test_accuracy": accuracy, "test_loss": test_loss,
                     "train_time_s": progress["train_time"] + time.perf_counter() - train_start})
        log(f"epoch {epoch} done | train loss {final_loss:.4f} | test loss {test_loss:.4f} | "
            f"test accuracy {100 * accuracy:.2f}% on {test_count} images")
        finished = step_in_epoch == steps_per_epoch
        if args.checkpoint_dir:
            save_checkpoint(epoch + finished, 0 if finished else step_in_epoch,
                            torch.zeros_like(epoch_loss) if finished else epoch_loss)
        stopping = stopper.agreed(accelerator)
        if stopping:
            break
    train_time = progress["train_time"] + time.perf_counter() - train_start
    bar.close()
    profiler.stop()
    if stopping:
        code = stopped(accelerator, stopper, step, args.checkpoint_dir)
        del model, optimizer, scheduler, train_loader, test_loader  # see finish()
        finish(accelerator)
        return code
    if accuracy is None:  # --epochs 0, or resumed from the final checkpoint: evaluate the model as it is
        accuracy, test_loss, test_count = evaluate(model, test_loader, accelerator, input_dtype)
    # Every rank takes part: under ZeRO-3 and FSDP the full weights are gathered from all shards.
    state_dict = accelerator.get_state_dict(model)
    memory_and_shards = footprint(accelerator, model)
    if accelerator.is_main_process:
        save_file({k: v.contiguous().cpu() for k, v in state_dict.items()},
                  os.path.join(args.output_dir, "model.safetensors"))
        data_time, compute_time = window.total_data, window.total_compute
        summary = {
            "recipe": "mnist", **setup, "optimizer": optimizer_name, "data_source": source, "steps": step,
            "epochs": progress["epochs_run"], "resumed_from_step": progress["step"] or None,
            "first_loss": first_loss, "final_loss": final_loss, "test_loss": test_loss,
            "test_accuracy": accuracy, "test_samples": test_count,
            "samples_per_s": step * args.batch_size / train_time if step else 0.0,
            "data_time_s": data_time, "compute_time_s": compute_time,
            "data_fraction": data_time / max(data_time + compute_time, 1e-9),
            "param_elements": sum(v.numel() for k, v in state_dict.items() if v.is_floating_point() and "running" not in k),
            **memory_and_shards, "timing": window.timing(micro_batch),
            "wall_time_s": time.perf_counter() - t_start, "args": vars(args),
        }
        metrics.close()
        evals.close()
        if args.report_to != "none":
            log(f"curves: {plot_curves(args.output_dir, 'mnist')}")
        if source == "synthetic":
            log("DATA: these results are on SYNTHETIC digits, not real MNIST")
        write_summary(args.output_dir, summary)
    del model, optimizer, scheduler, train_loader, test_loader  # see finish()
    finish(accelerator)
    return 0


if __name__ == "__main__":
    sys.exit(main())
