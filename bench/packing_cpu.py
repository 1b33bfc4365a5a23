"""Packed against padded examples on the CPU: finetune_lm.py's padding share, examples per block, step time
and real tokens/s, on uneven chat data, --packing and --no-packing.

    python bench/packing_cpu.py [--width 256] [--layers 4] [--block-size 256] [--steps 12] [--batch-size 8]

Builds a random Llama (accelrun.data.tiny_hf's tokenizer and model writer, at the width and depth given) and 800
conversations of one to three question/answer exchanges (accelrun.data.tiny_hf's chat.jsonl generator), then runs
`python recipes/finetune_lm.py` twice, one process, fp32, with the same flags but --packing/--no-packing, and
prints what each run's summary and metrics say. Printed figures, not a test: the CPU shows the direction (how
much of a padded block is padding, and what packing buys per real token); the GPU's figures come from
bench/benchmark.py --gpu-table.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--width", type=int, default=256, help="the model's hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--block-size", type=int, default=256, help="finetune_lm.py's --block-size")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run (the first two are not timed)")
    p.add_argument("--batch-size", type=int, default=8, help="blocks per step")
    return p.parse_args(argv)


def build(root, args):
    """The tokenizer, the model and the chat data in root."""
    from accelrun.data.tiny_hf import conversations, corpus, write_model, write_tokenizer
    tok = write_tokenizer(root / "model", [p + r for p, r in corpus()])
    write_model(root / "model", tok, layers=args.layers, width=args.width, context=args.block_size)
    with open(root / "chat.jsonl", "w") as f:
        for messages in conversations(800):
            f.write(json.dumps({"messages": messages}) + "\n")


def one_run(root, args, packing):
    out = root / packing.strip("-")
    cmd = [sys.executable, str(REPO / "recipes" / "finetune_lm.py"), "--model", str(root / "model"),
           "--data-files", str(root / "chat.jsonl"), "--block-size", str(args.block_size), packing,
           "--max-steps", str(args.steps), "--batch-size", str(args.batch_size), "--lr", "1e-3",
           "--log-every", "1", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
           "--output-dir", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][2:]
    step_ms = sum(m["compute_ms"] + m["data_ms"] for m in steps) / len(steps)  # one micro-batch per step
    real = summary["real_tokens_per_block"] * args.batch_size
    return {"padding": summary["padding_share"], "per_block": summary["examples_per_block"], "step_ms": step_ms,
            "real_per_step": real, "real_tokens_per_s": real / step_ms * 1000,
            "examples_per_s": summary["examples_per_block"] * args.batch_size / step_ms * 1000}


def main(argv=None):
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build(root, args)
        runs = {flag: one_run(root, args, flag) for flag in ("--no-packing", "--packing")}
    print(f"random Llama, width {args.width}, {args.layers} layers; uneven chat (800 conversations); blocks of "
          f"{args.block_size}, {args.batch_size} per step; 1 process, fp32, CPU (steps 3 to {args.steps})")
    print(f"{'':14}{'padding':>9}{'ex/block':>10}{'step ms':>9}{'real tok/step':>15}{'real tok/s':>12}{'ex/s':>8}")
    for flag, r in runs.items():
        print(f"{flag:14}{100 * r['padding']:8.1f}%{r['per_block']:10.2f}{r['step_ms']:9.1f}{r['real_per_step']:15.0f}"
              f"{r['real_tokens_per_s']:12.0f}{r['examples_per_s']:8.1f}")
    packed, padded = runs["--packing"], runs["--no-packing"]
    print(f"packed / padded: step time {packed['step_ms'] / padded['step_ms']:.2f}x, real tokens/s "
          f"{packed['real_tokens_per_s'] / padded['real_tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
