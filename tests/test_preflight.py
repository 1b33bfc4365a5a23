"""launch/preflight.py: the all-reduce table on 3 CPU processes, and the broken launches it finds (a GPU
launch without GPUs, world sizes that disagree, an unreachable main address, no launcher at all)."""

import os
import subprocess
import sys

import pytest

from launching import REPO, free_port, launch_command, run_command


def preflight_by_hand(ranks, world_sizes, port, timeout=20):
    """Start preflight ranks as a launcher would, with their own (possibly wrong) environments."""
    procs = [subprocess.Popen([sys.executable, "launch/preflight.py", "--timeout", str(timeout), "--max-bytes", "4096"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ACCELERATE_USE_CPU="1"))
             for rank, world in zip(ranks, world_sizes)]
    results = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("preflight hung")
        results.append((proc.returncode, output))
    return results


@pytest.mark.slow
def test_preflight_on_three_cpu_processes(data_dir, tmp_path):
    """Three, not two: with n = 2 the bus bandwidth factor 2(n-1)/n is 1, and busbw = algbw would pass."""
    n = 3
    cmd, env = launch_command("2gpu.yaml", data_dir, tmp_path, recipe="launch/preflight.py",
                              launch_args=("--num_processes", str(n)))
    cmd = cmd[:cmd.index("launch/preflight.py") + 1] + ["--max-bytes", str(4 * 2**20)]
    code, output = run_command(cmd, env=env, timeout=300)
    assert code == 0, output[-3000:]
    rows = [line for line in output.splitlines() if line.startswith("rank ")]
    assert len(rows) == n and all("| cpu (cpu) |" in row and "OMP_NUM_THREADS=1" in row for row in rows), rows
    assert all(f"local rank {rank} |" in row for rank, row in enumerate(rows)), rows
    table = [line.split() for line in output.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in table] == [1024 * 2**i for i in range(11)] + [4 * 2**20]  # doubling, then x4
    factor = 2 * (n - 1) / n  # nccl-tests: busbw = algbw * 2(n-1)/n
    # Printed as %.1f us and %.3f GB/s: each figure is within half its last digit of the true one. That alone
    # bounds the differences below, whatever the speed of this (shared) machine; no timing is asserted.
    half_us, half_gbs = 0.05, 0.0005
    checked = []
    for size, micros, algbw, busbw in table:
        size, micros, algbw, busbw = int(size), float(micros), float(algbw), float(busbw)
        # algbw = bytes / time: between the bounds the printed time allows, widened by algbw's own rounding
        assert size / (micros + half_us) / 1e3 - half_gbs <= algbw <= size / (micros - half_us) / 1e3 + half_gbs, \
            (size, micros, algbw)
        if size >= 64 * 2**10:  # below, the figures are a few units of the last digit: the rounding would dominate
            assert abs(busbw - factor * algbw) <= half_gbs * (1 + factor) + 1e-9, (size, algbw, busbw, factor)
            checked.append(size)
    assert len(checked) == 6, checked
    assert f"preflight: ok, {n} ranks agree on world size {n} and backend gloo" in output


@pytest.mark.slow
def test_preflight_finds_a_gpu_launch_without_gpus(data_dir, tmp_path):
    cmd, env = launch_command("2gpu.yaml", data_dir, tmp_path, recipe="launch/preflight.py")
    cmd = cmd[:cmd.index("launch/preflight.py") + 1]
    env.pop("ACCELERATE_USE_CPU")
    code, output = run_command(cmd, env=env, timeout=300)
    assert code != 0
    assert "preflight: error: rank 0 on" in output and "sees no GPU" in output and "ACCELERATE_USE_CPU=1" in output


def test_preflight_world_sizes_that_disagree():
    (code0, out0), (code1, out1) = preflight_by_hand([0, 1], [2, 3], free_port())
    assert code0 == 1 and code1 == 1
    assert "rank 1 on" in out1 and "has world_size 3 but rank 0" in out1 and "has 2" in out1
    assert "rank 1 on" in out0 and "has world_size 3 but rank 0 has 2" in out0


def test_preflight_a_rank_that_cannot_reach_the_main_address():
    port = free_port()  # nobody listens there
    [(code, output)] = preflight_by_hand([1], [2], port, timeout=3)
    assert code == 1
    assert "preflight: error: rank 1 on" in output and f"cannot reach the main address 127.0.0.1:{port}" in output


def test_preflight_outside_a_launcher():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "launch/preflight.py"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and out.stderr.startswith("preflight: error: RANK is not set: run this under")
