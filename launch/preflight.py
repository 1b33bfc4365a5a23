#!/usr/bin/env python3
"""The check to run before a long job: can every rank meet, see its device, and move data fast?

Run it exactly like the job it precedes, with the same launcher and config:

    accelerate launch --config_file accelerate_configs/2gpu.yaml launch/preflight.py
    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/2gpu.yaml launch/preflight.py
    sbatch launch/multinode.sbatch accelerate_configs/multinode.yaml launch/preflight.py   # under Slurm

What it does, in order (exit 0 when all is well, 1 with one `preflight: error:` line otherwise):
  1. Every rank connects to the main address (MASTER_ADDR:MASTER_PORT) and leaves its facts in the
     rendezvous store: host, device, local rank, world size, backend and the NCCL_* /
     CUDA_VISIBLE_DEVICES / OMP_NUM_THREADS it sees. A rank that cannot connect within --timeout
     says so and names the address; the main process names the ranks that never came.
  2. Every rank compares world size and backend with rank 0's, so disagreeing launches fail with
     the values side by side instead of hanging in init_process_group.
  3. A rank whose launch asks for a GPU (no ACCELERATE_USE_CPU) but sees none, or fewer than its
     local rank needs, fails before anything else.
  4. The process group comes up on that store; rank 0 prints one line per rank.
  5. A timed all-reduce of sizes from --min-bytes to --max-bytes (float32), reported as nccl-tests
     defines it: algbw = bytes / time, busbw = algbw * 2 (n - 1) / n, the time being the slowest
     rank's mean over --iters after --warmup.
It is a launch tool, not a recipe: it talks to torch.distributed directly.
"""

import argparse
import datetime
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

ENV_SHOWN = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--timeout", type=float, default=60, help="seconds to reach the main address and the other ranks")
    p.add_argument("--min-bytes", type=int, default=1024, help="smallest all-reduce")
    p.add_argument("--max-bytes", type=int, default=64 * 2**20, help="largest all-reduce (doubling, then x4)")
    p.add_argument("--iters", type=int, default=10, help="timed all-reduces per size")
    p.add_argument("--warmup", type=int, default=3, help="untimed all-reduces per size")
    return p.parse_args(argv)


def fail(message):
    print(f"preflight: error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def wanted(name):
    value = os.environ.get(name)
    if value is None:
        fail(f"{name} is not set: run this under the job's launcher (accelerate launch, torchrun, or "
             f"srun python3 launch/slurm_launch.py CONFIG launch/preflight.py), not with plain python")
    return value


def local_facts(rank, local_rank, world):
    """This rank's view, and the device it will use (or the reason it has none)."""
    on_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    problem, device = None, torch.device("cpu")
    if not on_cpu:
        count = torch.cuda.device_count()
        if count == 0:
            problem = (f"rank {rank} on {socket.gethostname()} sees no GPU (CUDA_VISIBLE_DEVICES="
                       f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}), and the launch asks for GPUs: ask Slurm "
                       f"for them (--gres=gpu:N), or set ACCELERATE_USE_CPU=1 to run on CPUs")
        elif local_rank >= count:
            problem = (f"rank {rank} on {socket.gethostname()} is local rank {local_rank} but sees only {count} "
                       f"GPU(s): more processes per node than GPUs; lower num_processes or ask for more GPUs")
        else:
            device = torch.device("cuda", local_rank)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_") or k in ENV_SHOWN}
    return device, problem, {"rank": rank, "host": socket.gethostname(), "local_rank": local_rank,
                             "world_size": world, "backend": "nccl" if device.type == "cuda" else "gloo",
                             "device": f"{device} ({name})", "problem": problem, "env": env}


def connect(rank, world, timeout):
    """The rendezvous store on the main address: torchrun's own when there is one, else rank 0 hosts it."""
    host, port = wanted("MASTER_ADDR"), int(wanted("MASTER_PORT"))
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    deadline = time.monotonic() + timeout
    while True:  # rank 0 may not be up yet: retry until the deadline
        try:
            return dist.TCPStore(host, port, world, is_master=rank == 0 and not agent_store,
                                 timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False), host, port
        except Exception as exc:
            if time.monotonic() > deadline:
                fail(f"rank {rank} on {socket.gethostname()} cannot reach the main address {host}:{port} within "
                     f"{timeout:.0f} s ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}). Check that "
                     f"{host} resolves to the main node's address on a network every node reaches "
                     f"(firewall, interface), and that the port is free")
            time.sleep(1)


def gather_facts(store, facts, rank, world, host, port, timeout):
    """Each rank leaves its facts; each compares with rank 0's; rank 0 collects everyone's."""
    prefix = f"preflight/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
    store.set(prefix + str(rank), json.dumps(facts))
    try:
        store.wait([prefix + "0"], datetime.timedelta(seconds=timeout))
    except Exception:
        fail(f"rank {rank} on {facts['host']} reached {host}:{port} but rank 0 never reported within {timeout:.0f} s")
    main = json.loads(store.get(prefix + "0"))
    store.set(prefix + f"read/{rank}", "1")  # rank 0 keeps the store up until every rank has read this
    for key in ("world_size", "backend"):
        if facts[key] != main[key]:
            fail(f"rank {rank} on {facts['host']} has {key} {facts[key]!r} but rank 0 on {main['host']} has "
                 f"{main[key]!r}: every rank must be launched with the same config and process counts")
    if facts["problem"]:
        fail(facts["problem"])
    if rank != 0:
        return None
    return collect_facts(store, prefix, facts, world, host, port, timeout)


def collect_facts(store, prefix, facts, world, host, port, timeout):
    """Rank 0: every rank's facts, once each has left them. A rank that never came, or one with a problem or
    another world size or backend, ends the preflight, after every rank has read rank 0's facts."""
    missing = []
    deadline = time.monotonic() + timeout
    for other in range(1, world):
        try:
            store.wait([prefix + str(other)], datetime.timedelta(seconds=max(deadline - time.monotonic(), 1)))
        except Exception:
            missing.append(other)
    if missing:
        fail(f"ranks {missing} of {world} never reached {host}:{port} within {timeout:.0f} s: see their own "
             f"error lines; a node that cannot route to {host}, or a launch that started fewer processes")
    everyone = [json.loads(store.get(prefix + str(r))) for r in range(world)]

    def fail_after_all_read(message):
        # Rank 0 may host the store: leaving at once would cut off a rank still reading rank 0's facts,
        # and that rank would crash with a connection error instead of printing its own message.
        try:
            store.wait([prefix + f"read/{r}" for r in range(world)], datetime.timedelta(seconds=timeout))
        except Exception:
            pass
        fail(message)
    problems = [other["problem"] for other in everyone if other["problem"]]
    if problems:  # the rank itself says so too; rank 0 must not wait for it in init_process_group
        more = f" (and {len(problems) - 1} more rank(s) like it)" if len(problems) > 1 else ""
        fail_after_all_read(problems[0] + more)
    for other in everyone:  # a rank that joined with another world size or backend
        for key in ("world_size", "backend"):
            if other[key] != facts[key]:
                fail_after_all_read(f"rank {other['rank']} on {other['host']} has {key} {other[key]!r} but rank 0 has "
                     f"{facts[key]!r}: every rank must be launched with the same config and process counts")
    return everyone


def timed_all_reduce(device, world, sizes, iters, warmup):
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rows = []
    for size in sizes:
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
        for _ in range(warmup):
            dist.all_reduce(tensor)
        sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(tensor)
        sync()
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank decides
        seconds = elapsed.item()
        tensor.fill_(1.0)
        dist.all_reduce(tensor)
        if tensor[0].item() != world:
            fail(f"all-reduce of {size} bytes summed to {tensor[0].item()} instead of {world}: the interconnect "
                 f"corrupts data")
        algbw = size / seconds / 1e9
        rows.append((size, seconds * 1e6, algbw, algbw * 2 * (world - 1) / world))
    return rows


def main(argv=None):
    args = parse_args(argv)
    rank, world = int(wanted("RANK")), int(wanted("WORLD_SIZE"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device, _, facts = local_facts(rank, local_rank, world)
    store, host, port = connect(rank, world, args.timeout)
    everyone = gather_facts(store, facts, rank, world, host, port, args.timeout)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(facts["backend"], store=dist.PrefixStore("preflight-pg", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
    if rank == 0:
        print(f"preflight: {world} ranks on {len({f['host'] for f in everyone})} host(s), backend "
              f"{facts['backend']}, main address {host}:{port}", flush=True)
        for f in everyone:
            env = (" ".join(f"{k}={v}" for k, v in f["env"].items())
                   or "(no NCCL_*/CUDA_VISIBLE_DEVICES/OMP_NUM_THREADS)")
            print(f"rank {f['rank']:>3} | host {f['host']} | local rank {f['local_rank']} | {f['device']} | {env}",
                  flush=True)
    sizes, size = [], args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= 2 if size < 2**20 else 4
    rows = timed_all_reduce(device, world, sizes, args.iters, args.warmup)
    if rank == 0:
        print(f"all-reduce, float32, sum; {args.iters} timed after {args.warmup} warm-up; busbw = algbw x 2(n-1)/n")
        print(f"{'bytes':>12} {'time us':>11} {'algbw GB/s':>11} {'busbw GB/s':>11}")
        for size, micros, algbw, busbw in rows:
            print(f"{size:>12} {micros:>11.1f} {algbw:>11.3f} {busbw:>11.3f}")
        print(f"preflight: ok, {world} ranks agree on world size {world} and backend {facts['backend']}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
