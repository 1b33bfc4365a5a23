"""The recipes' models in the leanest single-process loop: the ceiling a recipe run is measured against.

    python bench/lean_loop.py --recipe mnist --batch-size 512                           # ConvNet, fp32
    python bench/lean_loop.py --recipe gpt --preset 124M --mixed-precision bf16 --compile --peak-tflops 989
    python bench/lean_loop.py --recipe gpt --preset tiny --batch-size 8 --steps 20      # a CPU is enough

The model classes are the recipes' own (ConvNet and to_input of recipes/mnist.py, GPT and PRESETS of
recipes/gpt.py), and so are the loss, the AdamW settings (fused=True: one kernel for all parameters),
the parameter groups and the gradient clipping. Everything a training framework adds is left out:
the data are random tensors of the recipe's shapes (MNIST: uint8 28x28 images and int64 labels; GPT:
blocks of block_size + 1 byte tokens) made once, before the loop, on the device, and cycled through;
there is no loader, no scheduler, no logging, no checkpoint, no stop agreement, and no host
synchronisation inside the loop: the loss is summed on the device and read once at the end.
--mixed-precision bf16 runs the model's forward under torch.autocast (bf16), as accelerate does;
fp16 adds a GradScaler (GPU only); --compile wraps the model in torch.compile as the *_compile.yaml
configs do (inductor, full graph, static shapes).

Timing: --warmup-steps untimed steps (the first pays for lazy initialisation and compilation), then
--steps steps in one timed region, the device synchronised only before and after it (CUDA events on
a GPU, the wall clock on a CPU). The phases of a step are not split: that would need marks inside
the loop. Throughput = timed steps x samples (tokens) per step / the region's time; for gpt, with
--peak-tflops, MFU = tokens/s x FLOPs per token / peak, FLOPs per token = 6 (N - T d) + 12 L d T as
in recipes/gpt.py.

Prints one line and writes OUTPUT_DIR/summary.json, whose "timing" block has the keys of the
recipes' (src/accelrun/timing.py) where they mean the same thing; bench/benchmark.py runs this
beside the recipe's 1-process run and reports recipe throughput / lean-loop throughput.
It measures; it trains on noise, so its loss means nothing.
"""

import argparse
import contextlib
import json
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpt import GPT, PRESETS, VOCAB  # noqa: E402
from mnist import ConvNet, to_input  # noqa: E402

# The recipes' defaults (recipes/mnist.py, recipes/gpt.py), used where a flag is left at 0 / unset.
RECIPE_DEFAULTS = {"mnist": {"batch_size": 128, "lr": 1e-3, "weight_decay": 0.0, "seed": 42},
                   "gpt": {"batch_size": 32, "lr": 6e-4, "weight_decay": 0.1, "seed": 1337}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--recipe", choices=["mnist", "gpt"], default="mnist", help="whose model to train")
    p.add_argument("--batch-size", type=int, default=0,
                   help="samples (gpt: sequences) per step, the recipe's GLOBAL batch (0: mnist 128, gpt 32)")
    p.add_argument("--steps", type=int, default=100, help="timed steps, after the warm-up")
    p.add_argument("--warmup-steps", type=int, default=10,
                   help="untimed steps first (lazy initialisation, compilation, allocator); at least 1")
    p.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no",
                   help="bf16: autocast of the forward; fp16: autocast and a GradScaler (GPU only)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (inductor, fullgraph, static shapes), like *_compile.yaml")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: the GPU if there is one")
    p.add_argument("--pool", type=int, default=8, help="distinct random batches kept on the device and cycled")
    p.add_argument("--preset", choices=PRESETS, default="124M", help="gpt: model size, as in recipes/gpt.py")
    p.add_argument("--block-size", type=int, default=0, help="gpt: context length (0: the preset's)")
    p.add_argument("--dropout", type=float, default=0.0, help="gpt: dropout in attention and MLP")
    p.add_argument("--no-batchnorm", action="store_true", help="mnist: the ConvNet without BatchNorm")
    p.add_argument("--lr", type=float, default=0.0, help="AdamW learning rate, constant (0: mnist 1e-3, gpt 6e-4)")
    p.add_argument("--weight-decay", type=float, default=None,
                   help="AdamW weight decay (default: the recipe's, mnist 0, gpt 0.1 not on biases and norms)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm, as the recipes (0: none)")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="gpt: peak TFLOP/s of the device, for MFU (H100 SXM dense bf16: 989)")
    p.add_argument("--seed", type=int, default=None, help="weights and random data (default: the recipe's)")
    p.add_argument("--output-dir", default="runs/lean_loop", help="where summary.json goes")
    args = p.parse_args(argv)
    defaults = RECIPE_DEFAULTS[args.recipe]
    args.batch_size = args.batch_size or defaults["batch_size"]
    args.lr = args.lr or defaults["lr"]
    args.weight_decay = defaults["weight_decay"] if args.weight_decay is None else args.weight_decay
    args.seed = defaults["seed"] if args.seed is None else args.seed
    if args.steps < 1 or args.warmup_steps < 1 or args.pool < 1 or args.batch_size < 1:
        p.error("--steps, --warmup-steps, --pool and --batch-size must be at least 1")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU is visible here")
    if args.mixed_precision == "fp16" and args.device != "cuda":
        p.error("--mixed-precision fp16 needs a GPU (as in accelerate); use bf16 or no on a CPU")
    return args


def build(args, device):
    """(model, optimizer, step inputs pool, loss function, units per step, FLOPs per unit, description)."""
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    batch, pool = args.batch_size, args.pool
    if args.recipe == "mnist":
        model = ConvNet(batchnorm=not args.no_batchnorm)
        optimizer = torch.optim.AdamW(model.to(device).parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                      fused=True)
        data = (torch.randint(0, 256, (pool, batch, 28, 28), dtype=torch.uint8, generator=gen).to(device),
                torch.randint(0, 10, (pool, batch), generator=gen).to(device))

        def loss_of(net, images, labels):  # recipes/mnist.py: fp32 input, autocast inside the forward
            with autocast(args, device):
                logits = net(to_input(images, torch.float32))
            return F.cross_entropy(logits.float(), labels)
        return model, optimizer, data, loss_of, batch, 0, "mnist ConvNet", "samples"
    layers, heads, d, block_size = PRESETS[args.preset]
    block_size = args.block_size or block_size
    model = GPT(layers, heads, d, block_size, args.dropout).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    flops_per_token = 6 * (n_params - block_size * d) + 12 * layers * d * block_size  # recipes/gpt.py
    decay = [p for p in model.parameters() if p.dim() >= 2]  # recipes/gpt.py's groups and betas
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                                  fused=True)
    args.block_size = block_size
    data = (torch.randint(0, VOCAB, (pool, batch, block_size + 1), generator=gen).to(device),)

    def loss_of(net, ids):  # recipes/gpt.py
        with autocast(args, device):
            logits = net(ids[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    return model, optimizer, data, loss_of, batch * block_size, flops_per_token, f"gpt {args.preset}", "tokens"


def autocast(args, device):
    if args.mixed_precision == "no":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if args.mixed_precision == "bf16" else torch.float16)


def chosen_device(name):
    """The device of --device, with an index for a GPU: torch.device("cuda") names none, and torch.cuda.set_device
    refuses it. "cuda" is the current GPU (the first that CUDA_VISIBLE_DEVICES shows, unless one was set)."""
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def step_function(args, net, optimizer, data, loss_of):
    """step(i, loss_sum): one optimizer step on the pool's batch i, its loss added to loss_sum on the device."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    scaler = torch.amp.GradScaler("cuda") if args.mixed_precision == "fp16" else None

    def step(i, loss_sum):
        loss = loss_of(net, *(t[i % args.pool] for t in data))  # a view of a batch already on the device
        (scaler.scale(loss) if scaler else loss).backward()
        if args.max_grad_norm > 0:
            if scaler:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm, foreach=True)  # no host sync
        if scaler:
            scaler.step(optimizer)  # fused AdamW takes the inf check on the device: no host sync
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()  # on the device; read once, at the end
    return step


def timed_steps(args, step, device):
    """(first_step_at, seconds of the timed steps, their mean loss): --warmup-steps untimed, then --steps in one
    region, the device synchronised before and after it and nowhere inside."""
    cuda = device.type == "cuda"
    warm_sum = torch.zeros((), device=device)
    step(0, warm_sum)
    first_step_at = time.time()  # as the recipes' timer: when the host finished issuing the first step
    for i in range(1, args.warmup_steps):
        step(i, warm_sum)
    loss_sum = torch.zeros((), device=device)
    if cuda:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    else:
        started = time.perf_counter()
    for i in range(args.warmup_steps, args.warmup_steps + args.steps):
        step(i, loss_sum)
    if cuda:
        end.record()
        end.synchronize()
        timed_s = start.elapsed_time(end) / 1000
    else:
        timed_s = time.perf_counter() - started
    return first_step_at, timed_s, (loss_sum / args.steps).item()


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    device = chosen_device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    model, optimizer, data, loss_of, units_per_step, flops_per_unit, name, unit = build(args, device)
    param_elements = sum(p.numel() for p in model.parameters())
    net = torch.compile(model, fullgraph=True, dynamic=False) if args.compile else model
    net.train()
    first_step_at, timed_s, final_loss = timed_steps(args, step_function(args, net, optimizer, data, loss_of), device)

    rate = args.steps * units_per_step / timed_s
    mfu = flops_per_unit * rate / (args.peak_tflops * 1e12) if flops_per_unit and args.peak_tflops else None
    peak_mb = (torch.cuda.max_memory_allocated(device) / 2**20 if cuda
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    precision = {"no": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast"}[args.mixed_precision]
    summary = {
        "recipe": "lean_loop", "model": args.recipe, "distributed_type": "lean loop", "world_size": 1,
        "deepspeed_stage": None, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "mixed_precision": args.mixed_precision, "compile": args.compile, "optimizer": "AdamW",
        "optimizer_implementation": "fused", "batch_size": args.batch_size,
        **({"preset": args.preset, "block_size": args.block_size, "flops_per_token": flops_per_unit}
           if args.recipe == "gpt" else {}),
        "param_elements": param_elements, "steps": args.warmup_steps + args.steps, "final_loss": final_loss,
        f"{unit}_per_s": rate, **({"mfu": mfu} if args.recipe == "gpt" else {}),
        # The recipes' timing block, for the timed steps: no loader (data_ms 0) and no bookkeeping (other_ms 0);
        # forward+backward and optimizer are one region here (null), step_ms is its time per step.
        "timing": {"micro_batches": args.steps, "warmup_steps": args.warmup_steps, "first_step_at": first_step_at,
                   "timed_s": timed_s, "step_ms": 1000 * timed_s / args.steps, "data_ms": 0.0,
                   "forward_backward_ms": None, "optimizer_ms": None, "other_ms": 0.0, f"{unit}_per_s": rate,
                   "data_fraction": 0.0, "optimizer_in_backward": False, "phases_split": False},
        "peak_memory_mb": peak_mb, "peak_memory_mb_per_rank": [peak_mb],
        "peak_memory_kind": "cuda_allocated" if cuda else "cpu_max_rss",
        "wall_time_s": time.perf_counter() - t_start, "args": vars(args)}
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"lean loop | {name}, {param_elements / 1e6:.3f} M parameters | {summary['device_name']}, {precision}, "
          f"{'compiled' if args.compile else 'eager'} | batch {args.batch_size}"
          + (f" x {args.block_size} tokens" if args.recipe == "gpt" else "")
          + f" | {args.warmup_steps} warm-up + {args.steps} timed steps | {rate:.0f} {unit}/s | "
          f"{1000 * timed_s / args.steps:.2f} ms/step" + (f" | MFU {100 * mfu:.1f}%" if mfu is not None else "")
          + f" | loss {final_loss:.4f} (random data) | {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
