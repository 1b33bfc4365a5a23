"""The run services the recipes share; not a recipe (the recipes are the .py files one folder up).

    run.py          Run: the object a recipe's loop calls (see its docstring for the calls)
    checkpoints.py  --checkpoint-dir: save, verify, choose and load checkpoints; one writer per directory
    integrity.py    checksums shared by the ranks, and loading that never runs code from a checkpoint
    dirlock.py      one writer per --checkpoint-dir
    building.py     run.sharded_init(): the model built sharded under ZeRO-3 and FSDP
    stopping.py     stop signals, the agreement between ranks, exit code 75
    timing.py       the data / forward+backward / optimizer / other split, without stalling the GPU
    reporting.py    metrics.jsonl, --report-to, --profile, memory, summary.json
    checks.py       launch and DeepSpeed checks, each ending in one clear message
    synthetic_mnist.py  MNIST-format digits for machines that cannot download MNIST
"""

from .run import Run, add_run_args  # noqa: F401
