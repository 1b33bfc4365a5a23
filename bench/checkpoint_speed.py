"""How a checkpoint's save and resume compare with the disk: the real Checkpointer against a raw save and read of the
same bytes, measured in the same run.

    python bench/checkpoint_speed.py [--size-gb 1] [--processes 1 2] [--dir DIR] [--json FILE]

For each number of processes (one: a plain Python process; two: `accelerate launch` with gloo on the CPU) a model of
Linear layers with an AdamW state of about --size-gb in all (fp32 weights and two moments: 12 bytes per parameter)
is saved through accelrun's Checkpointer (accelerate's save_state, the checksums, the flush to disk, the publish)
and resumed from it (its verification: manifest, checksums and formats checked by every rank; then the load). Beside
each, on the main process, in the same run: the raw save of the same state (safetensors' save_file of the weights,
torch.save of the optimizer's state, as save_state writes them) followed by an fsync of each file, and the raw read
of the checkpoint's files (readinto a reused buffer), from the page cache (warm: as right after the save) and from
the disk (cold: the files' pages dropped first with posix_fadvise, as after a restart on another node).

Each round saves the raw state and removes it (before the Checkpointer's save in odd rounds, after it in even ones),
saves a new checkpoint (step 1, 2, ...), resumes from it and removes it, so that every write goes into page-cache
memory used before (two raw saves that are not counted come first: the first write of a GB into memory never used is
slower, several times so on a virtual machine); every column is the median of --repeat rounds, each ratio the median
of the rounds' own ratios (the machine may be shared: a round another job slowed is outvoted). Printed: one table,
every time in seconds and each ratio to its raw counterpart:
  save = write + checksums + flush + publish, against raw save + fsync (the goal: at most 1.25x);
  verify (warm/cold) = Checkpointer.choose, against the raw read of the same files (the goal: at most 1.25x).
A part the code under test does not time on its own is shown as "-" (its time is in the part before it).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = ("save_write_s", "save_checksum_s", "save_flush_s", "save_publish_s")
COLUMNS = ("processes", "GB", "raw write", "raw fsync", "raw save+fsync", "write", "checksums", "flush", "publish",
           "save", "save ratio",
           "raw read warm", "verify warm", "verify ratio warm", "raw read cold", "verify cold", "verify ratio cold",
           "load")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gb", type=float, default=1.0, help="size of the saved state (weights and AdamW moments)")
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="the numbers of processes to measure")
    p.add_argument("--repeat", type=int, default=3, help="rounds of every measurement; each column is their median")
    p.add_argument("--dir", default=None, help="where the checkpoints are written (default: a new temporary "
                                               "directory under the current one, removed afterwards)")
    p.add_argument("--json", default=None, help="also write the table's rows to this JSON file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: a launched process's report file
    return p.parse_args(argv)


# ---- the launched processes ---------------------------------------------------------------------------------------

def build(size_gb):
    """A model of square Linear layers holding about size_gb / 12 GB of fp32 weights (the AdamW moments take the
    rest), and its AdamW optimizer after one step (so that the moments exist)."""
    import torch
    params = max(int(size_gb * 1e9 / 12), 4096)
    width = max(64, min(4096, int((params / 8) ** 0.5)))
    layers = max(1, round(params / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), width


def raw_save(model, optimizer, directory):
    """(seconds to write the same state as save_state does: save_file of the weights, torch.save of the optimizer's
    state; seconds to fsync both files)."""
    import torch
    from safetensors.torch import save_file

    from accelrun.checkpoint.files import fsync
    os.makedirs(directory)
    started = time.perf_counter()
    weights, state = os.path.join(directory, "model.safetensors"), os.path.join(directory, "optimizer.bin")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, weights)
    torch.save(optimizer.state_dict(), state)
    written = time.perf_counter()
    for path in (weights, state):
        fsync(path)  # the Checkpointer's own flush, so both sides pay the same
    return written - started, time.perf_counter() - written


def _files(root):
    return sorted(p for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink())


def drop_cache(root):
    """Drop the pages of the files under root from the page cache (they are clean: synced), so that the next read
    comes from the disk."""
    for path in _files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(root):
    """Seconds to read every file under root once (readinto a reused 4 MB buffer)."""
    buf = bytearray(1 << 22)
    view = memoryview(buf)
    started = time.perf_counter()
    for path in _files(root):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return time.perf_counter() - started


def train_state(step):
    """A train_state as Run keeps it (manifest.TRAIN_STATE), so that the resume accepts the checkpoint."""
    return {"step": step, "total_steps": step + 1, "epoch": 0, "step_in_epoch": step, "epochs_run": 0,
            "first_loss": None, "final_loss": None, "last_eval": None, "train_time": 0.0, "window": None,
            "output_dir": None, "run_id": "0" * 32, "stopped": False}


def resume(acc, model, directory, cold):
    """Collective: (seconds the Checkpointer took to choose and verify the newest checkpoint, seconds to load it)."""
    from accelrun.checkpoint import Checkpointer, lock_directory
    if acc.is_main_process and cold:
        drop_cache(directory)
    acc.wait_for_everyone()
    lock, _ = lock_directory(acc, directory, "auto", "checkpoint_speed")
    ckpt = Checkpointer(acc, directory, 0, {"bench": 1}, model, lock, "checkpoint_speed")
    started = time.perf_counter()
    chosen = ckpt.choose("auto")
    verify = time.perf_counter() - started
    assert chosen is not None, "the benchmark's checkpoint was not chosen"
    ckpt.load(*chosen)
    loaded = ckpt.times["resume_load_s"]
    ckpt.release()
    return verify, loaded


def measure_once(acc, model, optimizer, directory, step, scratch):
    """Collective: one round of every measurement (the raw ones on the main process alone), as a dict."""
    from accelrun.checkpoint import Checkpointer, lock_directory
    row = {}

    def raw():
        if acc.is_main_process:
            row["raw write"], row["raw fsync"] = raw_save(acc.unwrap_model(model), optimizer, scratch)
            shutil.rmtree(scratch)
        acc.wait_for_everyone()

    if step % 2:  # the raw save before the Checkpointer's in odd rounds, after it in even ones: neither goes first
        raw()
    lock, _ = lock_directory(acc, directory, "auto", "checkpoint_speed")
    ckpt = Checkpointer(acc, directory, 0, {"bench": 1}, model, lock, "checkpoint_speed")
    started = time.perf_counter()
    ckpt.save(step, train_state(step))
    row["save"] = time.perf_counter() - started
    ckpt.release()
    row.update({k: ckpt.times.get(k) for k in PARTS})
    if not step % 2:
        raw()
    if acc.is_main_process:
        row["GB"] = sum(p.stat().st_size for p in _files(ckpt.newest)) / 1e9
        row["raw read warm"] = raw_read(ckpt.newest)
    row["verify warm"], row["load"] = resume(acc, model, directory, cold=False)
    if acc.is_main_process:
        drop_cache(ckpt.newest)
        row["raw read cold"] = raw_read(ckpt.newest)
    row["verify cold"], _ = resume(acc, model, directory, cold=True)
    if acc.is_main_process:
        shutil.rmtree(ckpt.newest)  # its pages go back: the next round writes into memory the cache has used
        row["save ratio"] = row["save"] / (row["raw write"] + row["raw fsync"])  # each round's own ratios
        for cache in ("warm", "cold"):
            row[f"verify ratio {cache}"] = row[f"verify {cache}"] / row[f"raw read {cache}"]
    acc.wait_for_everyone()
    return row


def worker(args):
    """One launched process: build, then --repeat rounds of saving through the Checkpointer and raw and resuming
    warm and cold; the main process writes each measurement's median to args.worker."""
    import statistics

    import torch
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)
    model, optimizer, width = build(args.size_gb)
    model, optimizer = acc.prepare(model, optimizer)
    acc.backward(model(torch.ones(1, width)).sum())
    optimizer.step()
    directory = os.path.join(args.dir, "checkpoints")
    if acc.is_main_process:  # not counted: the first write of a GB into memory the page cache never used is slower
        for copy in ("raw", "raw2"):  # (on a VM, several times); two: a round holds a checkpoint and a raw save
            raw_save(acc.unwrap_model(model), optimizer, os.path.join(args.dir, copy))
        for copy in ("raw", "raw2"):
            shutil.rmtree(os.path.join(args.dir, copy))
    rounds = [measure_once(acc, model, optimizer, directory, step, os.path.join(args.dir, "raw"))
              for step in range(1, args.repeat + 1)]
    if acc.is_main_process:
        row = {k: (statistics.median(r[k] for r in rounds) if rounds[0][k] is not None else None)
               for k in rounds[0]}
        row["processes"] = acc.num_processes
        Path(args.worker).write_text(json.dumps(row))
    acc.wait_for_everyone()


# ---- the parent: one launch per number of processes, and the table ----------------------------------------------

def launch(processes, size_gb, repeat, directory, report):
    """Run the worker under `processes` processes (gloo on the CPU, as the tests launch the recipes)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", ACCELERATE_USE_CPU="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p)
    me = [str(Path(__file__).resolve()), "--size-gb", str(size_gb), "--repeat", str(repeat), "--dir", directory,
          "--worker", report]
    if processes == 1:
        cmd = [sys.executable, *me]
    else:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port), *me]
    subprocess.run(cmd, env=env, check=True)
    return json.loads(Path(report).read_text())


def with_ratios(row):
    """The row with its derived columns, the part a run did not time on its own shown as None (the ratios are the
    medians of each round's own)."""
    row = dict(row)
    row["write"], row["checksums"] = row.pop("save_write_s"), row.pop("save_checksum_s")
    row["flush"], row["publish"] = row.pop("save_flush_s", None), row.pop("save_publish_s", None)
    row["raw save+fsync"] = row["raw write"] + row["raw fsync"]
    return row


def table(rows):
    """The rows as a Markdown table, times in seconds, ratios with an x."""
    def cell(column, value):
        if value is None:
            return "-"
        if column == "processes":
            return str(value)
        return f"{value:.2f}x" if "ratio" in column else f"{value:.2f}"
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(c, r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="checkpoint-speed-", dir=args.dir or ".") as scratch:
        for processes in args.processes:
            run_dir = os.path.join(scratch, f"p{processes}")
            os.makedirs(run_dir)
            report = os.path.join(scratch, "report.json")
            rows.append(with_ratios(launch(processes, args.size_gb, args.repeat, run_dir, report)))
            shutil.rmtree(run_dir)
    print(table(rows), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
