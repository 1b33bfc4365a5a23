"""torchvision ResNet on an image folder or CIFAR-10: the recipe where the input pipeline decides speed.

    python recipes/resnet.py --data-dir data/cifar10                     # CIFAR-10, downloaded if missing
    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/resnet.py \\
        --data-dir /scratch/imagenet --arch resnet50 --image-size 224 --batch-size 512 --num-workers 8
    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/2gpu.yaml \\
        --mixed_precision no recipes/resnet.py --data-dir my_images --image-size 32 --num-workers 1

Data: a folder with train/ and val/, each holding one subfolder of images per class (the
layout HPC centres keep ImageNet in), read by torchvision's ImageFolder; otherwise
CIFAR-10 in --data-dir, downloaded when possible. JPEG/PNG decoding and augmentation run
in --num-workers DataLoader processes per training process, with pinned memory and
workers that persist across epochs. Images of 64 pixels or less get the usual CIFAR stem
(3x3 first convolution, no max-pool): ImageNet's stride-4 stem would leave a 1x1 map.
--arch picks any torchvision ResNet; by default resnet18 for CIFAR-size images (up to
64 px) and resnet50 for ImageNet-size ones. On a GPU the model and the inputs are
channels_last (under FSDP the inputs only), and the configs' bf16 applies.

Data-bound or compute-bound? Every progress line splits the time per step into
"data" (the training loop blocked, waiting for the loader's next batch), forward+backward
(including waiting for the other ranks' gradients), optimizer, and "other" (the stop
agreement, logging, checkpoints). The summary gives data_fraction for the whole run.
When data_fraction is more than a few percent, the GPUs wait for JPEG decoding: raise
--num-workers (up to the cores per GPU), put the data on local or faster storage, or make
the augmentation cheaper. When it is near 0, the run is compute-bound and more workers
change nothing.

Watching it: --report-to tensorboard (or png) for curves, --profile 5 for a trace of 5 steps
per rank (docs/measuring.md); bench/benchmark.py --recipe resnet compares the configs.

Optimizer: SGD with Nesterov momentum and a cosine schedule, the usual ResNet recipe.
Not for deepspeed_zero3_offload.yaml: optimizer offload replaces SGD by DeepSpeed's
CPU Adam, and a ResNet fits on any GPU without it (use deepspeed_zero2.yaml).

Result: 100% validation accuracy on generated images in 4 epochs, measured 2026-11-22 on a 2-core CPU (docs/recipes.md).
"""

import argparse
import functools
import os
import sys

from accelrun import add_run_args


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-dir", default="data/cifar10",
                   help="a folder with train/ and val/ class subfolders, or where CIFAR-10 is (or goes)")
    p.add_argument("--arch", default="", help="any torchvision ResNet: resnet18 ... resnet152, wide_resnet50_2 "
                                            "(default: resnet18 up to 64 px images, resnet50 above)")
    p.add_argument("--image-size", type=int, default=0, help="training crop (0: 32 for CIFAR-10, 224 for folders)")
    p.add_argument("--epochs", type=int, default=30, help="passes over the training set")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    p.add_argument("--batch-size", type=int, default=256, help="GLOBAL batch, split across all processes")
    p.add_argument("--lr", type=float, default=0.1, help="peak SGD learning rate (cosine decay to 0)")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay")
    p.add_argument("--max-grad-norm", type=float, default=0.0,
                   help="gradient clipping (0: none, the usual for ResNets)")
    p.add_argument("--num-workers", type=int, default=4, help="decoding processes per training process")
    p.add_argument("--seed", type=int, default=0, help="weights, shuffling and augmentation")
    add_run_args(p, "resnet", log_every=20)
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and a wrong flag answer here, before torch and the rest are imported (seconds)

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedType, set_seed
from torch.utils.data import DataLoader
from torchvision import transforms

from accelrun import Run
from accelrun.stopping import ignore_stop_signals

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet statistics, fine for CIFAR too


def load_data(args, accelerator, run):
    """(train dataset, val dataset, classes, source), decoded lazily in the loader's workers."""
    folders = [os.path.join(args.data_dir, split) for split in ("train", "val")]
    source = "folder" if all(map(os.path.isdir, folders)) else "cifar10"
    size = args.image_size or (224 if source == "folder" else 32)
    normalize = [transforms.ToTensor(), transforms.Normalize(MEAN, STD)]
    if size <= 64:  # CIFAR-style augmentation
        train_tf = transforms.Compose([transforms.Resize(size), transforms.RandomCrop(size, padding=size // 8),
                                       transforms.RandomHorizontalFlip(), *normalize])
        val_tf = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size), *normalize])
    else:  # ImageNet-style
        train_tf = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                                       *normalize])
        val_tf = transforms.Compose([transforms.Resize(size * 8 // 7), transforms.CenterCrop(size), *normalize])
    if source == "folder":
        train = torchvision.datasets.ImageFolder(folders[0], train_tf)
        val = torchvision.datasets.ImageFolder(folders[1], val_tf)
        if train.classes != val.classes:
            run.fail(f"train/ and val/ in {args.data_dir} have different class folders "
                     f"({len(train.classes)} vs {len(val.classes)}); they must match.")
        return train, val, train.classes, source, size
    with accelerator.main_process_first(), accelerator.local_main_process_first():  # one download per node
        try:
            train = torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=train_tf,
                                                 download=accelerator.is_local_main_process)
            val = torchvision.datasets.CIFAR10(args.data_dir, train=False, transform=val_tf)
        except Exception as exc:  # offline compute node, proxy, read-only disk
            run.fail(f"{args.data_dir} has no train/ and val/ image folders, and CIFAR-10 could not be "
                     f"loaded or downloaded there ({type(exc).__name__}: {exc}). Download it on a login "
                     f"node (python recipes/resnet.py --data-dir {args.data_dir} --epochs 0) or point "
                     f"--data-dir at an image folder.")
    return train, val, train.classes, source, size


def build_model(arch, num_classes, image_size):
    if not hasattr(torchvision.models, arch) or not arch.startswith(("resnet", "wide_resnet", "resnext")):
        raise ValueError(arch)
    model = getattr(torchvision.models, arch)(num_classes=num_classes)  # random init: nothing to download
    model._no_split_modules = [type(model.layer1[0]).__name__]  # fsdp.yaml: one FSDP unit per residual block
    if image_size <= 64:  # CIFAR stem: keep the resolution a small image needs
        model.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model


def evaluate(model, loader, accelerator, prepare):
    model.eval()
    correct = count = 0
    with torch.no_grad():
        for images, labels in loader:
            logits = model(prepare(images))
            logits, labels = accelerator.gather_for_metrics((logits, labels))  # accelerate: drops padding
            correct += (logits.argmax(1) == labels).sum().item()
            count += labels.numel()
    model.train()
    return {"val_accuracy": correct / max(count, 1), "val_images": count}


def main(argv=None):
    args = parse_args(argv)
    # A resumed run may read the images from elsewhere (the data facts guard them) with other worker counts.
    run = Run("resnet", args, unit="images",
              may_change={"data_dir": "the data facts guard the content", "num_workers": "only how fast"})
    accelerator = Accelerator(  # accelerate
        # non_blocking with the pinned batches below: the copy to the GPU is queued, the host does not wait for it
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True, non_blocking=True))
    run.setup(accelerator, batch_size=args.batch_size, max_grad_norm=args.max_grad_norm,
              refuse_offload=("ResNet trains with SGD and momentum, and fits on a GPU without offload",
                              "deepspeed_zero2.yaml"))
    set_seed(args.seed)
    train_set, val_set, classes, source, size = load_data(args, accelerator, run)
    on_gpu = accelerator.device.type == "cuda"
    # Workers decode and augment; Slurm's stop signal reaches them too, and only the training process acts on it.
    loader_kwargs = dict(num_workers=args.num_workers, pin_memory=on_gpu, persistent_workers=args.num_workers > 0,
                         worker_init_fn=functools.partial(ignore_stop_signals, args.stop_signals))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True, **loader_kwargs)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, **loader_kwargs)
    args.arch = args.arch or ("resnet18" if size <= 64 else "resnet50")
    try:
        model = build_model(args.arch, len(classes), size)
    except ValueError:
        run.fail(f"--arch {args.arch}: not a torchvision ResNet; try resnet18, resnet50 or wide_resnet50_2")
    memory_format = torch.channels_last if on_gpu else torch.contiguous_format  # tensor-core friendly layout
    # FSDP2 refuses non-contiguous parameters, and a channels_last 3x3 weight is one: under FSDP only the inputs
    # are channels_last.
    if accelerator.distributed_type != DistributedType.FSDP:
        model = model.to(memory_format=memory_format)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                weight_decay=args.weight_decay)
    steps_per_epoch = len(train_loader)
    total_steps = steps_per_epoch * args.epochs
    total_steps = min(total_steps, args.max_steps) if args.max_steps else total_steps
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total_steps, 1))
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(  # accelerate
        model, optimizer, train_loader, val_loader, scheduler)
    input_dtype = next(model.parameters()).dtype  # bf16 under DeepSpeed bf16, else fp32 (autocast casts)
    to_input = lambda images: images.to(dtype=input_dtype, memory_format=memory_format)  # noqa: E731
    run.start(model, optimizer, scheduler, steps_per_epoch=steps_per_epoch, total_steps=total_steps,
              evaluate=lambda: evaluate(model, val_loader, accelerator, to_input),
              describe=f"{args.arch} at {size}px | {source}: {len(train_set)} train / {len(val_set)} val images, "
                       f"{len(classes)} classes | {args.num_workers} workers per process",
              data_facts={"source": source, "train_images": len(train_set), "crop_size": size})

    for batches in run.epochs(train_loader):  # resumes mid-epoch; evaluates and checkpoints at each epoch's end
        for images, labels in batches:
            loss = F.cross_entropy(model(to_input(images)).float(), labels)
            accelerator.backward(loss)  # accelerate
            if args.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # accelerate
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if run.step(loss):  # a stop signal, or the last step
                break
    return run.finish(model, arch=args.arch, image_size=size, data_source=source, classes=len(classes))


if __name__ == "__main__":
    sys.exit(main())
